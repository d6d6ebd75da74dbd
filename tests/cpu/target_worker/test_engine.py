"""Engine end to end on the tiny demo target: speculation never changes greedy output.

Whatever the drafter (prompt lookup, suffix trees, a model-based tree builder, the demo draft
model, or a random and malicious one), greedy generation with speculation on is token for
token the generation with speculation off, for a batch of mixed-length prompts that is
admitted in waves and prefilled in chunks. Plain decoding itself is checked against
`transformers`' greedy argmax; sampled generation with a seed against itself, alone and in
other batches.
"""

from __future__ import annotations

import random

import draft_testlib  # noqa: F401 - registers `test_bigram` (the conftest puts its folder on sys.path)
import pytest
import torch

import outrider.draft_worker.draft_model  # noqa: F401 - registers `draft_model`
from outrider.draft_worker import build_proposer
from outrider.proto import CandidateTree, DraftSampling, FeatureSpec, Limits, SequenceUpdate, validate_update
from outrider.target_worker import drafter_features
from outrider.target_worker.batch import HiddenCapture, SequenceChunk, build_forward_batch
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

MAX_TOKENS = 24
TEXTS = [
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n",
]


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=4096)


@pytest.fixture(scope="module")
def prompts(runner, tokenizer):
    """Random-token prompts of mixed lengths and two code prompts."""
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model.vocab_size
    random_prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 6, 23, 47, 60)]
    return random_prompts + [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def make_engine(runner, proposer=None, **kwargs) -> Engine:
    """Fewer slots than prompts and a small prefill budget: waves of admission, chunked prompts."""
    source = InProcessDraftSource(proposer) if proposer is not None else None
    options = dict(eos_token_id=None, max_batch=4, max_prefill_tokens=24) | kwargs
    return Engine(runner, source, **options)


@pytest.fixture(scope="module")
def plain(runner, prompts):
    return [c.token_ids for c in make_engine(runner).generate(prompts, RequestParams(max_tokens=MAX_TOKENS))]


def test_plain_decoding_is_transformers_greedy(tiny_family, prompts, plain):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_family.target_dir, dtype=torch.float32)
    for prompt, ours in zip(prompts, plain, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert ours == ids[len(prompt) :]


class RandomDrafter:
    """Random trees over the sequence's recent tokens (so some are accepted), often broken."""

    feature_spec = FeatureSpec()
    KINDS = ("valid", "valid", "none", "oversize", "wrong_root", "out_of_vocab", "stale", "parents", "nan_q")

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size, self.rng = vocab_size, random.Random(seed)
        self.context: dict[int, list[int]] = {}

    def propose(self, updates: list[SequenceUpdate]) -> list[CandidateTree]:
        trees = []
        for u in updates:
            if u.finished:
                self.context.pop(u.seq_id, None)
                continue
            context = ([] if u.reset else self.context[u.seq_id]) + u.new_tokens.tolist()
            self.context[u.seq_id] = context
            kind = self.rng.choice(self.KINDS)
            if kind != "none":
                trees.append(self.tree(u, context, kind))
        return trees

    def tree(self, u: SequenceUpdate, context: list[int], kind: str) -> CandidateTree:
        pool = torch.tensor(list(dict.fromkeys(reversed(context[-16:]))))
        top_k = min(u.budget.top_k, len(pool))
        depth = u.budget.max_depth
        fits = sum(top_k**d for d in range(depth + 1))
        size = min(self.rng.randint(1, u.budget.max_nodes), fits)
        mode = self.rng.choice([DraftSampling.DETERMINISTIC, DraftSampling.WITHOUT_REPLACEMENT])
        tree = CandidateTree.make_dummy(
            size, vocab_size=len(pool), top_k=max(top_k, 1), max_depth=depth, sampling=mode,
            seq_id=u.seq_id, round=u.round, seed=self.rng.randrange(1 << 30),
        )  # fmt: skip
        tree.tokens = pool[tree.tokens]
        tree.q_token_ids = torch.where(tree.q_token_ids >= 0, pool[tree.q_token_ids.clamp(min=0)], -1)
        tree.tokens[0] = context[-1]
        last = tree.num_nodes - 1
        if kind == "oversize":
            n = u.budget.max_nodes + 1
            tree.tokens = torch.full((n,), context[-1])
            tree.parents = torch.arange(-1, n - 1)
            tree.q_nodes, tree.q_token_ids, tree.q_probs = (
                tree.q_nodes[:0],
                tree.q_token_ids[:0],
                tree.q_probs[:0],
            )
            tree.sampling = DraftSampling.DETERMINISTIC
        elif kind == "wrong_root":
            tree.tokens[0] = (context[-1] + 1) % self.vocab_size
        elif kind == "out_of_vocab":
            tree.tokens[last] = self.vocab_size + 5
        elif kind == "stale":
            tree.round -= 1
        elif kind == "parents":
            tree.parents[last] = last if last else 0  # a self-loop (or a root with a parent)
        elif kind == "nan_q" and tree.q_probs.numel():
            tree.q_probs[0, 0] = float("nan")
        return tree


CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "suffix": {"method": "suffix", "num_speculative_tokens": 5, "tree_top_k": 2, "tree_max_nodes": 8},
    "test_bigram": {
        "method": "test_bigram",
        "num_speculative_tokens": 3,
        "tree_top_k": 2,
        "tree_max_nodes": 7,
    },
    "draft_model": {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        "tree_top_k": 2,
        "tree_max_nodes": 10,
    },
}


def proposer_for(name: str, vocab_size: int, tiny_family=None):
    if name == "random":
        return RandomDrafter(vocab_size)
    config = CONFIGS[name]
    if name == "draft_model":
        config = config | {"model": str(tiny_family.draft_dir)}
    return build_proposer(config, vocab_size=vocab_size)


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "test_bigram", "draft_model", "random"])
def test_greedy_speculation_equals_plain(drafter, runner, prompts, plain, tiny_family):
    engine = make_engine(runner, proposer_for(drafter, runner.model.vocab_size, tiny_family))
    out = engine.generate(prompts, RequestParams(max_tokens=MAX_TOKENS))
    assert [c.token_ids for c in out] == plain
    assert all(c.finish_reason == "length" for c in out)
    stats = engine.stats
    assert stats.spec.num_drafts > 0
    assert stats.num_rounds < stats.num_output_tokens  # some rounds committed several tokens per sequence
    assert not engine.blocks.tables and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    if drafter == "random":
        assert stats.num_invalid_trees > 0 and stats.num_missing_trees > 0
        assert stats.spec.num_accepted_tokens > 0
    else:
        assert stats.num_invalid_trees == 0


class OverlappingSource(InProcessDraftSource):
    """An in-process proposer that claims to draft elsewhere, recording what each step collects."""

    overlaps_drafting = True

    def __init__(self, proposer):
        super().__init__(proposer)
        self.collected: list[list[int]] = []

    def collect(self, seq_ids, timeout_s=None):
        self.collected.append(list(seq_ids))
        return super().collect(seq_ids, timeout_s)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_two_lanes_take_turns_and_change_nothing(drafter, runner, prompts, plain, tiny_family):
    """With a source that drafts elsewhere the batch splits into two lanes verified in turn;
    output is still plain greedy, and no step verifies both lanes while both have work."""
    source = OverlappingSource(proposer_for(drafter, runner.model.vocab_size, tiny_family))
    engine = Engine(runner, source, eos_token_id=None, max_batch=4, max_prefill_tokens=24, lanes=2)
    assert engine.lanes == 2 and engine.lane_tuner is None
    out = engine.generate(prompts, RequestParams(max_tokens=MAX_TOKENS))
    assert [c.token_ids for c in out] == plain
    assert engine.stats.spec.num_drafts > 0 and engine.stats.num_invalid_trees == 0
    assert not engine.blocks.tables and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    # Steps with 4 decoding sequences verify 2 of them: one lane, never the whole batch.
    assert any(len(ids) == 2 for ids in source.collected)
    assert not any(len(ids) == 4 for ids in source.collected)
    # In-process drafting happens inside collect: one lane, the whole batch each step.
    assert make_engine(runner, proposer_for("ngram", runner.model.vocab_size)).lanes == 1
    with pytest.raises(ValueError, match="lanes"):
        make_engine(runner, lanes=3)


def test_by_default_the_engine_measures_one_lane_against_two(runner, prompts, plain, tiny_family):
    """A source that drafts elsewhere gets a LaneTuner: it tries both modes while decoding and
    keeps the faster; output is plain greedy whatever it picks, even when it switches often."""
    from outrider.target_worker.lanes import LaneTuner

    source = OverlappingSource(proposer_for("draft_model", runner.model.vocab_size, tiny_family))
    engine = Engine(runner, source, eos_token_id=None, max_batch=4, max_prefill_tokens=24)
    assert engine.lanes == 2 and engine.lane_tuner is not None
    engine.lane_tuner = LaneTuner(trial_steps=2, exploit_steps=3)  # switch often
    out = engine.generate(prompts, RequestParams(max_tokens=MAX_TOKENS))
    assert [c.token_ids for c in out] == plain
    assert set(engine.lane_tuner.rates) == {1, 2} and engine.lane_tuner.switches >= 2
    sizes = {len(ids) for ids in source.collected}
    assert {2, 4} <= sizes  # steps of one lane and steps of the whole batch
    assert not engine.blocks.tables and engine.blocks.num_free_blocks == engine.blocks.num_blocks


class LateSource(OverlappingSource):
    """A drafter late for every round: `collect` returns no tree by its deadline."""

    def collect(self, seq_ids, timeout_s=None):
        super().collect(seq_ids, timeout_s)
        return {}


def test_the_policy_learns_which_asked_trees_missed_the_deadline(runner, prompts, plain, tiny_family):
    """Each round tells the adaptive policy how many of the trees it asked for did not come by
    the deadline (all of them here), so it can tell a drafter that is late from one that had
    nothing to draft; the output is plain greedy."""
    source = LateSource(proposer_for("ngram", runner.model.vocab_size, tiny_family))
    engine = Engine(
        runner, source, eos_token_id=None, max_batch=4, max_prefill_tokens=24, budget_policy="adaptive"
    )
    seen, observe = [], engine.policy.observe

    def spy(outcomes, *args, missing=0, **kwargs):
        asked = sum(o[1] > 0 for o in outcomes) + sum(o[0] in engine.policy.shadowed for o in outcomes)
        seen.append((asked, missing))
        observe(outcomes, *args, missing=missing, **kwargs)

    engine.policy.observe = spy
    out = engine.generate(prompts, RequestParams(max_tokens=MAX_TOKENS))
    assert [c.token_ids for c in out] == plain
    assert any(asked for asked, _ in seen)
    assert all(missing == asked for asked, missing in seen)
    assert engine.stats.num_missing_trees == sum(missing for _, missing in seen) > 0


def test_with_no_sequence_drafting_one_forward_verifies_the_whole_batch(runner, prompts, plain, tiny_family):
    """Two lanes hide a remote drafter's time; where the policy asked no sequence to draft
    (speculation off) there is nothing to hide, and two half-batch forwards would only cost
    more: every decoding sequence is verified each step, and the lane tuner counts nothing."""
    source = OverlappingSource(proposer_for("ngram", runner.model.vocab_size, tiny_family))
    engine = Engine(
        runner, source, eos_token_id=None, max_batch=4, max_prefill_tokens=24, budget_policy="adaptive"
    )
    assert engine.lanes == 2 and engine.lane_tuner is not None
    policy = engine.policy

    def off(num_seqs: int, arrived: bool = False) -> bool:  # the policy keeps speculation off for all
        policy._quiet = True
        return True

    policy.quiet = off
    ids = [engine.add_request(p, RequestParams(max_tokens=MAX_TOKENS)) for p in prompts]
    tokens = {i: [] for i in ids}
    full_steps = 0
    while engine.has_unfinished():
        decoding = {s.seq_id for s in engine.running if not s.prefilling}
        outputs = engine.step()
        assert decoding <= {o.request_id for o in outputs}  # none waits for its lane's turn
        full_steps += len(decoding) == 4
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids
    assert [tokens[i] for i in ids] == plain
    assert full_steps > 0 and source.collected == []
    assert engine.lane_tuner.steps == {1: 0, 2: 0}


def test_the_lane_tuner_keeps_the_faster_mode_and_checks_the_other_now_and_then():
    """Trials of both modes, then the faster one for stretches that double while trials of
    the other confirm it; a trial that finds the other faster switches and starts over."""
    import itertools

    from outrider.target_worker.lanes import LaneTuner

    tuner = LaneTuner(trial_steps=2, exploit_steps=5, max_exploit_steps=20)
    speed = {1: 300.0, 2: 200.0}  # tokens per second of each mode

    def run(steps: int) -> list[tuple[int, int]]:
        modes = []
        for _ in range(steps):
            modes.append(tuner.mode)
            tuner.record(int(speed[tuner.mode] * 0.01), 0.01)
        return [(mode, len(list(group))) for mode, group in itertools.groupby(modes)]

    runs = run(73)
    # trial 2, trial 1, then 1 for 5, 10, 20, 20 steps with two-step trials of 2 between
    assert runs == [(2, 2), (1, 2 + 5), (2, 2), (1, 10), (2, 2), (1, 20), (2, 2), (1, 20), (2, 2), (1, 6)]
    assert tuner.rates == pytest.approx({1: 300.0, 2: 200.0}) and tuner.steps == {1: 63, 2: 10}
    speed[2] = 500.0  # conditions change: the next trial of two lanes finds them faster
    runs = run(30)
    assert runs[:3] == [(1, 14), (2, 2 + 5), (1, 2)] and tuner.rates[2] == pytest.approx(500.0)
    with pytest.raises(ValueError):
        LaneTuner(trial_steps=0)


def test_lanes_even_out_when_sequences_end_unevenly():
    """Lane sizes drift as sequences end; each step first moves sequences so the two lanes
    differ by at most one, or the lane left alone would wait for its drafts every step."""
    from outrider.target_worker.lanes import lane_to_verify
    from outrider.target_worker.sequence import Sequence

    seqs = [
        Sequence(i, RequestParams(), [1, 2], 1, None, RequestParams().sampling) for i in range(5)
    ]  # all in lane 0
    first, turn = lane_to_verify(seqs, 0)
    sizes = sorted(sum(s.lane == lane for s in seqs) for lane in (0, 1))
    assert sizes == [2, 3] and turn == 1
    second, turn = lane_to_verify(seqs, turn)
    assert sorted(s.seq_id for s in first + second) == list(range(5))  # the lanes take turns


def test_greedy_rows_unaffected_by_sampled_neighbours(runner, prompts, plain, tiny_family):
    """One batch, greedy and sampled requests interleaved, with a tree drafter."""
    greedy = RequestParams(max_tokens=MAX_TOKENS)
    sampled = RequestParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7)
    params = [greedy if i % 2 == 0 else sampled for i in range(len(prompts))]
    engine = make_engine(
        runner, proposer_for("test_bigram", runner.model.vocab_size, tiny_family), max_batch=8
    )
    out = engine.generate(prompts, params)
    for i in range(0, len(prompts), 2):
        assert out[i].token_ids == plain[i]


@pytest.mark.parametrize("drafter", [None, "ngram", "test_bigram"])
def test_seeded_sampling_is_reproducible_in_any_batch(drafter, runner, prompts, tiny_family):
    def new_engine(**kwargs):
        proposer = proposer_for(drafter, runner.model.vocab_size, tiny_family) if drafter else None
        return make_engine(runner, proposer, **kwargs)

    params = [
        RequestParams(max_tokens=16, temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, seed=100 + i)
        for i in range(len(prompts))
    ]
    first = [c.token_ids for c in new_engine().generate(prompts, params)]
    again = [c.token_ids for c in new_engine(max_batch=16, max_prefill_tokens=512).generate(prompts, params)]
    reversed_batch = new_engine().generate(prompts[::-1], params[::-1])[::-1]
    alone = [new_engine().generate([p], q)[0].token_ids for p, q in zip(prompts[:3], params[:3], strict=True)]
    assert first == again == [c.token_ids for c in reversed_batch]
    assert first[:3] == alone
    assert len({tuple(t) for t in first}) > 1
    other_seed = new_engine().generate(prompts[:1], RequestParams(max_tokens=16, temperature=0.8, seed=1))
    assert other_seed[0].token_ids != first[0]


@pytest.mark.parametrize("held, max_batch", [(False, 4), (True, 4), (True, 1)])
def test_features_are_the_hidden_states_that_predicted_each_token(
    runner, prompts, held, max_batch, monkeypatch
):
    """Updates carry, per new token, the captured layer inputs at the position before it,
    through prefill chunks, decodes and accepted tree paths alike; `held`: the policy asks
    for drafts one round in 12, so a sequence's rows pile up for 11 rounds (views of a
    batch-1 round, copies beside other sequences) and go in one update; MAX_HELD_TENSORS = 2
    joins them as they come."""
    layers = (0, 1)
    spec = FeatureSpec(layer_ids=layers, hidden_size=runner.model.hidden_size, dtype="float32")
    limits = Limits(max_batch=16, max_nodes=64, max_depth=16, max_top_k=16, max_q_width=64)
    updates: dict[int, list[SequenceUpdate]] = {}

    ngram = proposer_for("ngram", runner.model.vocab_size)

    class Recorder:
        feature_spec = spec

        def propose(self, batch):
            for u in batch:
                validate_update(u, vocab_size=runner.model.vocab_size, limits=limits, features=spec)
                updates.setdefault(u.seq_id, []).append(u)
            return ngram.propose(batch)

    engine = make_engine(runner, Recorder(), budget_policy="fixed", max_batch=max_batch)
    if held:
        engine.policy.quiet = lambda num_sequences, arrived=False: engine.round % 12 != 0
        monkeypatch.setattr(drafter_features, "MAX_HELD_TENSORS", 2)
    engine.generate(prompts[2:], RequestParams(max_tokens=40 if held else 16))
    if held:
        assert max(len(u.new_tokens) for us in updates.values() for u in us[1:]) >= 12
    assert engine.stats.spec.num_accepted_tokens > 0
    for seq_updates in updates.values():
        live = [u for u in seq_updates if not u.finished]
        assert live[0].reset and not any(u.reset for u in live[1:])
        tokens = torch.cat([u.new_tokens for u in live])
        features = torch.cat([u.features for u in live])
        start = runner.cache.allocate(999, len(tokens))
        chunk = SequenceChunk(start, 0, tokens[:-1])
        out = runner.forward(build_forward_batch([chunk], capture=HiddenCapture(layer_inputs=layers)))
        runner.cache.free(999)
        expected = torch.cat([out.layer_inputs[layer] for layer in layers], dim=-1)
        assert features[0].abs().max() == 0
        assert (features[1:] - expected).abs().max() <= 1e-4
