"""The demo family: loadable by transformers, deterministic, cached, and safe against corruption."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from outrider.demo.family import (
    CorruptCacheError,
    ensure_demo_family,
    export_family,
    family_dir,
    recipe_for,
    verify_family,
)


def test_transformers_loads_target_draft_and_tokenizer_and_generates(tiny_family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_family.target_dir)
    prompt = tokenizer(
        ["def main(", "import os\nimport"], return_tensors="pt", padding=True, padding_side="left"
    )
    for folder in (tiny_family.target_dir, tiny_family.draft_dir):
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.model_type == "llama"
        assert model.config.vocab_size == len(tokenizer)
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
        assert out.shape == (2, prompt["input_ids"].shape[1] + 8)
        assert tokenizer.decode(out[0][-8:])  # decodes to text


def test_manifest_records_recipe_parameters_tokens_and_losses(tiny_family):
    m = tiny_family.manifest
    assert m["size"] == "tiny" and m["seed"] == 0
    assert m["recipe"]["target"]["hidden_size"] == 64
    for role in ("target", "draft"):
        assert m[role]["parameters"] > 0
        assert (
            m[role]["tokens_seen"]
            == m[role]["steps"] * m["recipe"][f"{role}_train"]["batch_size"] * m[role]["context"]
        )
        # A trained model beats the uniform distribution (ln 2048 = 7.6 nats) by a margin.
        assert m[role]["held_out_loss"] < 7.0
    assert 0 < m["draft"]["greedy_agreement_with_target"] <= 1
    assert m["target"]["parameters"] > m["draft"]["parameters"]
    assert "model.safetensors" in " ".join(m["files"])


def test_second_call_is_a_fast_cache_hit(tiny_family, outrider_home):
    messages: list[str] = []
    start = time.monotonic()
    again = ensure_demo_family("tiny", home=outrider_home, progress=False, log=messages.append)
    assert time.monotonic() - start < 2.0
    assert again.root == tiny_family.root and messages == []


def test_cli_second_build_returns_from_cache_under_two_seconds(tiny_family, outrider_home):
    import subprocess
    import sys

    command = [sys.executable, "-m", "outrider.cluster.cli", "demo", "build", "--size", "tiny", "--quiet"]
    # The first call builds whatever draft heads the session has not built yet (untimed).
    first = subprocess.run(command, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert time.monotonic() - start < 2.0, "a cache hit must not import torch or train anything"
    assert str(tiny_family.root) in result.stdout
    assert "building" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "damage",
    ["truncate_weights", "delete_manifest", "flip_config_byte", "stray_file", "other_recipe"],
)
def test_damaged_entry_is_detected(tiny_family, tmp_path, damage):
    copy = tmp_path / tiny_family.root.name
    shutil.copytree(tiny_family.root, copy)
    recipe = recipe_for("tiny")
    verify_family(copy, recipe)  # the pristine copy verifies
    if damage == "truncate_weights":
        weights = copy / "target" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "delete_manifest":
        (copy / "manifest.json").unlink()
    elif damage == "flip_config_byte":
        config = copy / "draft" / "config.json"
        config.write_text(config.read_text().replace('"hidden_size": 32', '"hidden_size": 33'))
    elif damage == "stray_file":
        (copy / "target" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    else:
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["recipe_digest"] = "000000000000"
        (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCacheError):
        verify_family(copy, recipe)


@pytest.mark.slow
def test_corrupt_entry_is_rebuilt_deterministically(tiny_family, tmp_path):
    """A corrupt cache entry is rebuilt, not loaded; the rebuild reproduces the same weights."""
    home = tmp_path / "home"
    root = family_dir(recipe_for("tiny"), home)
    shutil.copytree(tiny_family.root, root)
    weights = root / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # a partial copy
    messages: list[str] = []
    rebuilt = ensure_demo_family("tiny", home=home, progress=False, log=messages.append)
    assert any("not usable, rebuilding" in m for m in messages)
    # Same seed, same recipe: byte-identical weights (sha256 of every file but the timing-bearing manifest).
    assert rebuilt.manifest["files"] == tiny_family.manifest["files"]
    assert rebuilt.manifest["target"]["held_out_loss"] == tiny_family.manifest["target"]["held_out_loss"]


def test_another_seed_gives_other_weights_key():
    assert recipe_for("tiny", 0).digest() != recipe_for("tiny", 1).digest()
    with pytest.raises(ValueError, match="unknown demo size"):
        recipe_for("huge")


def test_export_copies_and_refuses_to_overwrite(tiny_family, tmp_path):
    out = export_family(tiny_family, tmp_path / "exported")
    verify_family(out, recipe_for("tiny"))
    with pytest.raises(FileExistsError):
        export_family(tiny_family, out)


def test_weights_are_float32_safetensors(tiny_family):
    from safetensors.torch import load_file

    tensors = load_file(tiny_family.target_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert "model.embed_tokens.weight" in tensors
