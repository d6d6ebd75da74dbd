"""`medusa`: tree buffers, both published checkpoint layouts, the feature offset against the
target's own hidden states, losslessness of sampled trees, and greedy equality through the
engine (in-process and over gRPC) on the tiny demo family.

Checkpoints here are random heads written in exactly the published layouts; trained heads are
tested in tests/cpu/draft_worker/test_train_medusa.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from outrider.draft_worker import build_proposer
from outrider.draft_worker.medusa import HEADS_FILE, StaticTree, best_choices, load_medusa_heads
from outrider.kernels import draw_verify_randoms, pack_trees, process_logits, verify
from outrider.proto import DraftSampling, SamplingParams, SequenceUpdate, TreeBudget, check_trees
from outrider.target_worker.batch import HiddenCapture, SequenceChunk, build_forward_batch
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.loader import CheckpointError
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

CHOICES = [(0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0)]


def random_heads(num_heads: int, hidden: int, vocab: int, seed: int = 0, scale: float = 1.0) -> dict:
    """Per-head tensors {w [H, H], b [H], lm [V, H]} with non-zero blocks, so the ResBlock matters."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "w": torch.randn(hidden, hidden, generator=gen) * 0.3 / hidden**0.5,
            "b": torch.randn(hidden, generator=gen) * 0.1,
            "lm": torch.randn(vocab, hidden, generator=gen) * scale / hidden**0.5,
        }
        for _ in range(num_heads)
    ]


def write_faster_decoding(folder: Path, heads: list[dict], **config) -> Path:
    """FasterDecoding's layout: medusa_lm_head.safetensors with `{k}.0.linear.*` and `{k}.1.weight`."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, head in enumerate(heads):
        tensors[f"{k}.0.linear.weight"] = head["w"]
        tensors[f"{k}.0.linear.bias"] = head["b"]
        tensors[f"{k}.1.weight"] = head["lm"]
    save_file(tensors, folder / HEADS_FILE)
    vocab, hidden = heads[0]["lm"].shape
    fields = dict(medusa_num_heads=len(heads), medusa_num_layers=1, hidden_size=hidden, vocab_size=vocab)
    (folder / "config.json").write_text(json.dumps(fields | config))
    return folder


def write_vllm(folder: Path, heads: list[dict], **config) -> Path:
    """vLLM's layout: `blocks.{k}.layers.0.weight/bias`, `lm_heads.{k}.weight`."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, head in enumerate(heads):
        tensors[f"blocks.{k}.layers.0.weight"] = head["w"]
        tensors[f"blocks.{k}.layers.0.bias"] = head["b"]
        tensors[f"lm_heads.{k}.weight"] = head["lm"]
    save_file(tensors, folder / "model.safetensors")
    vocab, hidden = heads[0]["lm"].shape
    fields = dict(
        num_heads=len(heads), num_hidden_layers=1, hidden_size=hidden, vocab_size=vocab, medusa_fc_bias=True
    )
    (folder / "config.json").write_text(json.dumps(fields | config))
    return folder


def reference_logits(heads: list[dict], hidden: torch.Tensor) -> torch.Tensor:
    """[K, V]: head k = lm_k(h + SiLU(W_k h + b_k)), written out independently of MedusaHeads."""
    rows = []
    for head in heads:
        x = hidden + torch.nn.functional.silu(head["w"] @ hidden + head["b"])
        rows.append(head["lm"] @ x)
    return torch.stack(rows)


def depth_of(parents: list[int]) -> list[int]:
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    return depth


# ---- the static tree ------------------------------------------------------------------------


def test_choices_compile_to_buffers_parents_first_siblings_by_rank():
    tree = StaticTree.compile(CHOICES, num_heads=3)
    # layout: root, (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert tree.rank.tolist() == [0, 0, 1, 2, 0, 1, 0, 0]
    assert tree.sibling.tolist() == [0, 0, 1, 2, 0, 1, 0, 0]
    assert tree.expanded.tolist() == [0, 1, 2, 4] and tree.width == 3


def test_a_budget_keeps_the_first_paths_that_fit_prefix_closed():
    tree = StaticTree.compile(CHOICES, num_heads=3)
    cut = tree.cut(TreeBudget(max_nodes=5, max_depth=2, top_k=2))
    assert cut.paths == ((0,), (1,), (0, 0), (0, 1))  # (2,) is past top_k, (0, 0, 0) past the depth
    # A path whose prefix was cut goes too, even when it fits.
    sparse = StaticTree.compile([(0,), (2,), (2, 0), (0, 0)], num_heads=2)
    assert sparse.cut(TreeBudget(max_nodes=8, max_depth=2, top_k=2)).paths == ((0,), (0, 0))


@pytest.mark.parametrize(
    "choices, message",
    [
        ([(0, 0)], "without"),
        ([(0,), (0,)], "twice"),
        ([(0,), (0, 0, 0, 0)], "ranks"),
        ([(-1,)], "ranks"),
    ],
)
def test_bad_choices_are_refused(choices, message):
    with pytest.raises(ValueError, match=message):
        StaticTree.compile(choices, num_heads=3)


def test_a_path_listed_before_its_prefix_waits_for_it():
    tree = StaticTree.compile([(0, 0), (1,), (0,), (0, 0, 0)], num_heads=3)
    assert tree.paths == ((1,), (0,), (0, 0), (0, 0, 0))
    assert tree.cut(TreeBudget(max_nodes=3, max_depth=3, top_k=2)).paths == ((1,), (0,))


def test_best_choices_follow_the_accuracies():
    accuracy = [[0.8, 0.1, 0.05], [0.5, 0.3, 0.1], [0.4, 0.2, 0.1]]
    assert best_choices(accuracy, TreeBudget(max_nodes=4, max_depth=3, top_k=1)) == [(0,), (0, 0), (0, 0, 0)]
    # values: (0,) .8, (0,0) .4, (0,1) .24, (0,0,0) .16, (1,) .1, (0,1,0) .096, (0,0,1) .08 ...
    choices = best_choices(accuracy, TreeBudget(max_nodes=7, max_depth=3, top_k=3))
    assert choices == [(0,), (0, 0), (0, 1), (0, 0, 0), (1,), (0, 1, 0)]
    StaticTree.compile(choices, num_heads=3)  # prefix-closed in priority order


# ---- checkpoints ----------------------------------------------------------------------------

VOCAB, HIDDEN = 12, 8


def small_proposer(folder: Path, **keys):
    config = {"method": "medusa", "model": str(folder), "num_speculative_tokens": 3, "target_num_layers": 2}
    return build_proposer(config | keys, vocab_size=VOCAB)


GREEDY, BUDGET = SamplingParams(), TreeBudget(max_nodes=8, max_depth=3, top_k=3)


def update(seq_id, hidden, *, tokens=(3,), sampling=GREEDY, budget=BUDGET, **kw):
    features = torch.zeros(len(tokens), hidden.shape[0])
    features[-1] = hidden
    return SequenceUpdate(seq_id, 0, torch.tensor(tokens), sampling, budget, features=features, **kw)


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
    for update, tree in zip(recorder.updates, recorder.trees, strict=True):
        ranked = reference_logits(heads, update.features[-1].float()).argsort(-1, descending=True)
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
