"""`medusa`: seeded and lossless sampled trees, the feature offset against the target's own
hidden states, and greedy equality through the engine (in-process and over gRPC) on the tiny
demo family. Tree buffers: test_medusa_tree.py; checkpoint layouts: test_medusa_checkpoint.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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
)

from outrider.draft_worker import build_proposer
from outrider.draft_worker.medusa.checkpoint import load_medusa_heads
from outrider.kernels import draw_verify_randoms, pack_trees, process_logits, verify
from outrider.proto import DraftSampling, SamplingParams, TreeBudget, check_trees
from outrider.target_worker.batch import HiddenCapture, SequenceChunk, build_forward_batch
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams


def depth_of(parents: list[int]) -> list[int]:
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    return depth


# ---- sampled trees --------------------------------------------------------------------------

SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=None)


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement", "deterministic"])
def test_sampled_trees_are_valid_and_seeded_ones_repeat(tmp_path, mode):
    folder = write_faster_decoding(tmp_path, random_heads(3, HIDDEN, VOCAB, seed=3, scale=4.0))
    keys = dict(medusa_choices=CHOICES, tree_top_k=3, tree_max_nodes=8, draft_sampling=mode)
    hidden = torch.randn(HIDDEN)
    budget = TreeBudget(8, 3, 3)
    seeded = SamplingParams(temperature=0.9, top_p=0.6, seed=7)
    runs = []
    for _ in range(2):
        proposer = small_proposer(folder, **keys)
        updates = [update(i, hidden, sampling=seeded if i == 0 else SAMPLED) for i in range(50)]
        trees = proposer.propose(updates)
        assert check_trees(trees, [budget] * len(trees), VOCAB) == [None] * len(trees)
        assert {t.sampling for t in trees} == {DraftSampling[mode.upper()]}
        runs.append(trees[0].tokens.tolist())
    assert runs[0] == runs[1]
    if mode != "deterministic":  # fresh draws per node: the trees differ
        assert len({tuple(t.tokens.tolist()) for t in trees}) > 1


NUM_DRAWS, DELTA = 12_000, 1e-6


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement", "deterministic"])
def test_sampled_trees_are_lossless(tmp_path, mode):
    """The first two output tokens of a round follow the target: p(x1) p(x2 | x1).

    NUM_DRAWS sequences share a root and a hidden state; the target's next-token p at any node
    is a bigram table row of the node's token, processed like the sequence's p. Where the round
    ends after x1, x2 is drawn from p(. | x1) as the next round's first token would be. TV over
    V^2 cells as in test_tree_lossless.py.
    """
    torch.manual_seed(0)
    folder = write_faster_decoding(tmp_path, random_heads(3, HIDDEN, VOCAB, seed=4, scale=2.0))
    proposer = small_proposer(
        folder, medusa_choices=CHOICES, tree_top_k=3, tree_max_nodes=8, draft_sampling=mode
    )
    hidden = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(8))
    # The target agrees with the heads in part (their mean), so every depth gets accepted.
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(9)) * 0.7
    table += reference_logits_for(folder, hidden).mean(0)
    ones = torch.ones(VOCAB)
    p = process_logits(table, ones * SAMPLED.temperature, None, ones * SAMPLED.top_p)  # [V, V]

    root = 3
    trees = proposer.propose([update(i, hidden, tokens=(root,), sampling=SAMPLED) for i in range(NUM_DRAWS)])
    packed = pack_trees(trees)
    randoms = draw_verify_randoms(packed.cu_num_draft_tokens, VOCAB, torch.Generator().manual_seed(2))
    out = verify(
        packed, p[packed.token_ids], torch.zeros(NUM_DRAWS, dtype=torch.bool), randoms, backend="torch"
    )
    first = out.output_token_ids[:, 0]
    second = torch.where(
        out.num_output_tokens >= 2,
        out.output_token_ids[:, 1],
        torch.multinomial(p[first], 1, generator=torch.Generator().manual_seed(3)).squeeze(1),
    )
    joint = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).double() / NUM_DRAWS
    expected = (p[root][:, None] * p).reshape(-1).double()
    cells = VOCAB * VOCAB
    bound = math.sqrt(2 * (cells * math.log(2) + math.log(1 / DELTA)) / NUM_DRAWS) / 2
    assert 0.5 * float((joint - expected).abs().sum()) < bound
    assert float((out.num_output_tokens >= 3).float().mean()) > 0.01  # depth-2 residuals were exercised


def reference_logits_for(folder: Path, hidden: torch.Tensor) -> torch.Tensor:
    heads, _ = load_medusa_heads(folder)
    return heads(hidden[None])[0]


# ---- through the engine on the tiny family --------------------------------------------------

PROMPT_TOKENS, NEW_TOKENS = 48, 32


@pytest.fixture(scope="module")
def family(tiny_family, tmp_path_factory):
    from transformers import AutoTokenizer

    from outrider.benchmarks.prompts import load_prompts

    config = json.loads((tiny_family.target_dir / "config.json").read_text())
    heads = random_heads(3, config["hidden_size"], config["vocab_size"], seed=6, scale=2.0)
    folder = write_faster_decoding(
        tmp_path_factory.mktemp("medusa_heads"), heads, base_model_name_or_path=str(tiny_family.target_dir)
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.tokenizer_dir)
    prompts = [p.token_ids for p in load_prompts("mid", tokenizer, count=3, prompt_tokens=PROMPT_TOKENS)]
    return tiny_family, folder, heads, prompts


class Recorder:
    """A medusa proposer that keeps every update and tree it sees."""

    def __init__(self, proposer):
        self.proposer, self.updates, self.trees = proposer, [], []

    @property
    def feature_spec(self):
        return self.proposer.feature_spec

    def propose(self, updates):
        trees = self.proposer.propose(updates)
        self.updates += [u for u in updates if not u.finished]
        self.trees += trees
        return trees


def run_engine(fam, spec: dict | None, prompts, params, wrap=None):
    runner = ModelRunner.from_pretrained(fam.target_dir, max_model_len=128, kv_cache_rows=1024)
    source = None
    if spec is not None:
        proposer = build_proposer(spec, vocab_size=runner.model.vocab_size)
        source = InProcessDraftSource(wrap(proposer) if wrap else proposer)
    engine = Engine(runner, source, eos_token_id=None, max_batch=8, max_prefill_tokens=1024)
    return [c.token_ids for c in engine.generate(prompts, params)], engine.stats


def medusa_spec(folder: Path, **keys) -> dict:
    return {"method": "medusa", "model": str(folder), "num_speculative_tokens": 3} | keys


def test_features_are_the_states_that_predicted_each_token(family):
    """Row j of the features is the target's final hidden state before new_tokens[j]; head k on
    the last row drafts depth k + 1, checked against a direct forward over the whole sequence."""
    fam, folder, heads, prompts = family
    recorder = None

    def wrap(proposer):
        nonlocal recorder
        recorder = Recorder(proposer)
        return recorder

    greedy = RequestParams(max_tokens=12, ignore_eos=True)
    outputs, _ = run_engine(
        fam, medusa_spec(folder, tree_top_k=2, tree_max_nodes=6), prompts[:1], [greedy], wrap
    )
    sequence = prompts[0] + outputs[0]
    runner = ModelRunner.from_pretrained(fam.target_dir, max_model_len=128, kv_cache_rows=128)
    chunk = SequenceChunk(runner.cache.allocate(0, len(sequence)), 0, torch.tensor(sequence), all_logits=True)
    out = runner.forward(build_forward_batch([chunk], capture=HiddenCapture(final=True)))
    final = out.final_hidden  # [T, H]; row t predicted token t + 1
    assert out.logits.argmax(-1)[len(prompts[0]) - 1 : -1].tolist() == outputs[0]

    features = torch.cat([u.features for u in recorder.updates]).float()
    tokens = torch.cat([u.new_tokens for u in recorder.updates]).tolist()
    assert tokens == sequence[: len(tokens)] and len(tokens) >= len(prompts[0]) + 2
    assert torch.equal(features[0], torch.zeros_like(features[0]))
    torch.testing.assert_close(features[1:], final[: len(tokens) - 1], atol=1e-4, rtol=1e-4)
    for recorded, tree in zip(recorder.updates, recorder.trees, strict=True):
        ranked = reference_logits(heads, recorded.features[-1].float()).argsort(-1, descending=True)
        depth = depth_of(tree.parents.tolist())
        first = [t for t, d in zip(tree.tokens.tolist(), depth, strict=True) if d == 1]
        assert first == ranked[0, : len(first)].tolist()


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_output_equals_speculation_off(family, shape):
    fam, folder, _, prompts = family
    params = RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    plain, _ = run_engine(fam, None, prompts, params)
    keys = {} if shape == "chain" else {"tree_top_k": 3, "tree_max_nodes": 10}
    spec, stats = run_engine(fam, medusa_spec(folder, **keys), prompts, params)
    assert spec == plain
    assert stats.num_invalid_trees == 0 and stats.spec.num_drafts > 0


def test_greedy_through_the_draft_server_equals_plain(family):
    from outrider.draft_worker.server import DraftIdentity, serve
    from outrider.proto import Limits
    from outrider.target_worker.draft_client import (
        DraftClientConfig,
        RemoteDraftSource,
        target_handshake,
        tokenizer_fingerprint,
    )

    fam, folder, _, prompts = family
    params = RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    plain, _ = run_engine(fam, None, prompts, params)
    runner = ModelRunner.from_pretrained(fam.target_dir, max_model_len=128, kv_cache_rows=1024)
    proposer = build_proposer(
        medusa_spec(folder, tree_top_k=2, tree_max_nodes=6), vocab_size=runner.model.vocab_size
    )
    fingerprint = tokenizer_fingerprint(fam.tokenizer_dir)
    server = serve(
        proposer, DraftIdentity("medusa-test", proposer.vocab_size, fingerprint), address="127.0.0.1:0"
    )
    handshake = target_handshake(
        fam.target_dir,
        fam.tokenizer_dir,
        model_id="tiny",
        limits=Limits(max_batch=64, max_nodes=16, max_depth=8, max_top_k=4),
    )
    source = RemoteDraftSource(
        [f"127.0.0.1:{server.port}"], handshake, DraftClientConfig(round_deadline_s=5.0)
    )
    try:
        assert source.wait_ready(10) and source.feature_spec.layer_ids == (2,)
        engine = Engine(runner, source, eos_token_id=None, max_batch=8, max_prefill_tokens=1024)
        outputs = [c.token_ids for c in engine.generate(prompts, params)]
        assert outputs == plain
        assert (
            engine.stats.num_trees > 0
            and engine.stats.num_invalid_trees == engine.stats.num_missing_trees == 0
        )
        assert source.counters.trees_received == engine.stats.num_trees
    finally:
        source.close()
        server.stop(1)
