"""`medusa`: both published checkpoint layouts (and Medusa-2's prefixed one) draft what an
independent reference computes; pickle is refused; the target's layer count is found.

Checkpoints here are random heads written in exactly the published layouts; trained heads are
tested in tests/cpu/draft_worker/test_train_medusa.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from medusa_testlib import (
    CHOICES,
    HIDDEN,
    VOCAB,
    random_heads,
    reference_logits,
    small_proposer,
    update,
    write_faster_decoding,
    write_vllm,
)
from safetensors.torch import save_file

from outrider.draft_worker import build_proposer
from outrider.draft_worker.medusa.checkpoint import load_medusa_heads
from outrider.proto import DraftSampling, TreeBudget, check_trees
from outrider.target_worker.loader import CheckpointError


@pytest.mark.parametrize("layout", ["faster_decoding", "vllm"])
def test_published_layouts_draft_the_reference_tokens(tmp_path, layout):
    heads = random_heads(3, HIDDEN, VOCAB, seed=1, scale=3.0)
    folder = (write_faster_decoding if layout == "faster_decoding" else write_vllm)(tmp_path, heads)
    proposer = small_proposer(folder, medusa_choices=CHOICES, tree_top_k=3, tree_max_nodes=8)
    assert proposer.feature_spec.layer_ids == (2,) and proposer.feature_spec.hidden_size == HIDDEN
    hidden = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))
    (tree,) = proposer.propose([update(0, hidden, tokens=(4, 9, 3))])
    ranked = reference_logits(heads, hidden).argsort(-1, descending=True)  # [K, V]
    # Node (r0, r1, ...) takes rank r_d of head d: layout root, (0,), (1,), (2,), (0,0), (0,1), (1,0), (0,0,0).
    expected = [
        3,
        ranked[0, 0],
        ranked[0, 1],
        ranked[0, 2],
        ranked[1, 0],
        ranked[1, 1],
        ranked[1, 0],
        ranked[2, 0],
    ]
    assert tree.tokens.tolist() == [int(t) for t in expected]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert tree.sampling == DraftSampling.DETERMINISTIC
    assert check_trees([tree], [TreeBudget(8, 3, 3)], VOCAB) == [None]


def test_heads_with_one_lm_head_read_it_once(tmp_path):
    """A FasterDecoding checkpoint whose heads hold equal lm_heads (trained with the target's head
    frozen) is served with one shared head: same trees, one [V, H] matrix."""
    heads = random_heads(3, HIDDEN, VOCAB, seed=7, scale=3.0)
    for head in heads[1:]:
        head["lm"] = heads[0]["lm"].clone()
    proposer = small_proposer(write_faster_decoding(tmp_path, heads), medusa_choices=CHOICES, tree_top_k=3)
    assert proposer.heads.shared_head and proposer.heads.lm_head.shape == (1, VOCAB, HIDDEN)
    hidden = torch.randn(HIDDEN)
    (tree,) = proposer.propose([update(0, hidden)])
    ranked = reference_logits(heads, hidden).argsort(-1, descending=True)
    assert tree.tokens[1:4].tolist() == ranked[0, :3].tolist() and int(tree.tokens[-1]) == int(ranked[2, 0])


def test_vllm_token_map_and_shared_head(tmp_path):
    heads = random_heads(2, HIDDEN, 5, seed=2, scale=3.0)
    token_map = torch.tensor([11, 2, 7, 0, 5])
    tensors = {f"blocks.{k}.layers.0.weight": h["w"] for k, h in enumerate(heads)}
    tensors |= {"lm_head.weight": heads[0]["lm"], "token_map": token_map}
    save_file(tensors, tmp_path / "model.safetensors")
    config = dict(
        num_heads=2, num_hidden_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, truncated_vocab_size=5
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    proposer = small_proposer(tmp_path, num_speculative_tokens=2)
    hidden = torch.randn(HIDDEN)
    (tree,) = proposer.propose([update(0, hidden)])
    shared = [{"w": h["w"], "b": torch.zeros(HIDDEN), "lm": heads[0]["lm"]} for h in heads]
    top = reference_logits(shared, hidden).argmax(-1)
    assert tree.tokens.tolist() == [3, int(token_map[top[0]]), int(token_map[top[1]])]


def test_medusa2_prefixed_heads_without_a_count_load(tmp_path):
    """Medusa-2 keeps the heads inside the whole model (`medusa_head.{k}...`); with no
    medusa_num_heads in config.json, every head in the file is read."""
    heads = random_heads(3, HIDDEN, VOCAB, seed=8, scale=3.0)
    tensors = {"model.norm.weight": torch.ones(HIDDEN)}
    for k, head in enumerate(heads):
        tensors |= {
            f"medusa_head.{k}.0.linear.weight": head["w"],
            f"medusa_head.{k}.0.linear.bias": head["b"],
        }
        tensors[f"medusa_head.{k}.1.weight"] = head["lm"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "medusa_num_layers": 1}))
    loaded, _ = load_medusa_heads(tmp_path)
    hidden = torch.randn(HIDDEN)
    assert loaded.num_heads == 3
    torch.testing.assert_close(loaded(hidden[None])[0], reference_logits(heads, hidden))


def test_pickle_checkpoints_are_refused_with_a_way_out(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_medusa_heads(tmp_path)


def test_the_target_layer_count_comes_from_the_base_model_folder(tmp_path):
    base = tmp_path / "target"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"num_hidden_layers": 7}))
    folder = write_faster_decoding(
        tmp_path / "heads", random_heads(2, HIDDEN, VOCAB), base_model_name_or_path=str(base)
    )
    config = {"method": "medusa", "model": str(folder), "num_speculative_tokens": 2}
    assert build_proposer(config, vocab_size=VOCAB).feature_spec.layer_ids == (7,)
    hub = write_faster_decoding(
        tmp_path / "hub", random_heads(2, HIDDEN, VOCAB), base_model_name_or_path="org/x"
    )
    with pytest.raises(ValueError, match="target_num_layers"):
        build_proposer(config | {"model": str(hub)}, vocab_size=VOCAB)
