"""Demo heads (cluster.demo.heads): cached beside the family, never in its manifest; a cache
hit trains nothing; a corrupt head is rebuilt; `--demo` resolves a method to its head."""

from __future__ import annotations

import json

from cluster.cli import _demo_draft_dirs
from cluster.demo import heads
from cluster.demo.family import recipe_for, verify_family
from cluster.demo.heads import HeadRecipe, ensure_demo_heads

QUICK = HeadRecipe(
    steps=3,
    num_sequences=48,
    prompt_tokens=32,
    new_tokens=64,
    options={"ttt_steps": 2, "draft_vocab_size": 256},
)


def test_heads_are_cached_beside_the_family(tiny_family, monkeypatch):
    monkeypatch.setitem(heads.HEAD_RECIPES["tiny"], "eagle3", QUICK)
    logs: list[str] = []
    folder = ensure_demo_heads(tiny_family, ["eagle3"], progress=False, log=logs.append)["eagle3"]
    assert folder.parent == tiny_family.root / "heads" and any("training" in line for line in logs)
    verify_family(tiny_family.root, recipe_for("tiny"))  # the family's own manifest still verifies
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["metrics"]["steps"] == 3 and "train_state" not in {p.name for p in folder.iterdir()}
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == 256

    stamp, logs[:] = (folder / "model.safetensors").stat().st_mtime_ns, []
    assert ensure_demo_heads(tiny_family, ["eagle3"], progress=False, log=logs.append)["eagle3"] == folder
    assert logs == [] and (folder / "model.safetensors").stat().st_mtime_ns == stamp  # a hit trains nothing

    (folder / "config.json").write_text("{}")  # corrupt: rebuilt, not loaded
    ensure_demo_heads(tiny_family, ["eagle3"], progress=False, log=logs.append)
    assert any("not usable" in line for line in logs)
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == 256

    assert _demo_draft_dirs("tiny", "eagle3") == (folder, tiny_family.tokenizer_dir)
    assert _demo_draft_dirs("tiny", "draft_model") == (tiny_family.draft_dir, tiny_family.tokenizer_dir)
