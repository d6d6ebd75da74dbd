"""Loading HF folders: shards, dtypes, tied heads, and errors that name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from target_runner_testlib import save_random_checkpoint

from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.loader import CheckpointError, MissingTensorError
from outrider.target_worker.models import UnsupportedArchitectureError
from outrider.target_worker.runner import ModelRunner

IDS = torch.tensor([5, 17, 3, 88, 41, 2])


def _logits(path, **kwargs) -> torch.Tensor:
    runner = ModelRunner.from_pretrained(path, max_model_len=16, **kwargs)
    start = runner.cache.allocate(0, 16)
    return runner.forward(build_forward_batch([SequenceChunk(start, 0, IDS, all_logits=True)])).logits


def test_sharded_checkpoint_with_index(tmp_path):
    model = save_random_checkpoint(tmp_path / "one", "llama")
    model.save_pretrained(tmp_path / "many", max_shard_size="60KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    assert torch.equal(_logits(tmp_path / "many"), _logits(tmp_path / "one"))


def test_bf16_checkpoint_upcast_to_fp32(tmp_path):
    import transformers

    save_random_checkpoint(tmp_path, "qwen2", dtype=torch.bfloat16)  # tied embeddings
    ours = _logits(tmp_path, dtype=torch.float32)
    # transformers reading the same bf16 file into fp32 (its RoPE tables stay fp32 this way).
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(IDS[None]).logits[0]
    assert (ours - theirs).abs().max() <= 1e-4


def test_missing_tensor_is_named(tmp_path):
    save_random_checkpoint(tmp_path, "mistral")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match="model.layers.2.mlp.up_proj.weight"):
        ModelRunner.from_pretrained(tmp_path, max_model_len=16)


def test_unsupported_architecture_is_named(tmp_path):
    save_random_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedArchitectureError, match="'GPT2LMHeadModel'.*supported: .*LlamaForCausalLM"
    ):
        ModelRunner.from_pretrained(tmp_path, max_model_len=16)


def test_unknown_rope_type_is_refused(tmp_path):
    save_random_checkpoint(tmp_path, "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        ModelRunner.from_pretrained(tmp_path, max_model_len=16)


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle checkpoints are never loaded"):
        ModelRunner.from_pretrained(tmp_path, max_model_len=16)


def test_sliding_window_bounds_max_model_len(tmp_path):
    save_random_checkpoint(tmp_path, "mistral", sliding_window=8)
    with pytest.raises(CheckpointError, match="exceeds sliding_window 8"):
        ModelRunner.from_pretrained(tmp_path, max_model_len=16)
