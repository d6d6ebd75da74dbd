"""Demo heads (draft_worker.training.demo_heads): cached beside the family, never in its manifest; a cache
hit trains nothing; a corrupt head is rebuilt; `--demo` resolves a method to its head."""

from __future__ import annotations

import json
from dataclasses import replace

from outrider.cluster.cli import _demo_draft_dirs
from outrider.demo.family import recipe_for, verify_family
from outrider.draft_worker.training import demo_heads as heads
from outrider.draft_worker.training.demo_heads import HeadRecipe, ensure_demo_heads

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


def test_lanes_balance_the_expected_time(monkeypatch):
    monkeypatch.setitem(heads.SECONDS_PER_STEP, "tiny", {"a": 3.0, "b": 2.0, "c": 2.0, "d": 1.0})
    recipes = {m: HeadRecipe(steps=10) for m in "abcd"}
    plan = heads.lanes("tiny", recipes, 2)
    assert [list(lane) for lane in plan] == [["a", "d"], ["b", "c"]]
    assert all(lane[m] is recipes[m] for lane in plan for m in lane)  # the recipes travel with them
    assert [list(lane) for lane in heads.lanes("tiny", recipes, 8)] == [["a"], ["b"], ["c"], ["d"]]


def test_heads_build_side_by_side_in_spawned_processes(tiny_family, monkeypatch):
    """Two heads in two lanes: the lanes get the recipes from here (a recipe patched in this
    process is the one they train), the log lines come back, and a second call is a hit."""
    eagle3 = replace(QUICK, steps=2)  # not the head the test above builds
    medusa = HeadRecipe(steps=2, num_sequences=48, prompt_tokens=32, new_tokens=64, options={"num_heads": 2})
    monkeypatch.setitem(heads.HEAD_RECIPES["tiny"], "eagle3", eagle3)
    monkeypatch.setitem(heads.HEAD_RECIPES["tiny"], "medusa", medusa)
    logs: list[str] = []
    folders = ensure_demo_heads(tiny_family, ["eagle3", "medusa"], progress=False, log=logs.append, workers=2)
    assert any("in 2 processes" in line for line in logs), logs
    assert sum("training the" in line for line in logs) == 2
    for method, recipe in (("eagle3", eagle3), ("medusa", medusa)):
        assert folders[method] == heads.head_dir(tiny_family, method, recipe)
        assert heads.verify_head(folders[method])["recipe"]["steps"] == recipe.steps
    logs.clear()
    assert (
        ensure_demo_heads(tiny_family, ["eagle3", "medusa"], progress=False, log=logs.append, workers=2)
        == folders
    )
    assert logs == []
