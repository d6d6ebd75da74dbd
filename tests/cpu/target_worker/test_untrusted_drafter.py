"""A draft worker must not be able to steer what the target samples (docs/algorithms.md section 2b).

The attacker: a gRPC draft server that passes the handshake, then answers every round with
a chain of one token of its choosing (CHOSEN), each child sent as drawn WITH_REPLACEMENT from
a q that gives CHOSEN probability 1e-6, and pushes speculative trees of the same kind. Served
through the real client and the step engine at T = 1 with seeds:

- untrusted (the default for a remote source): the first verified token's distribution is
  the target's (a two-sample chi-square test against speculation off);
- trusted with the audit off: the same test rejects, loudly (so it can fail);
- trusted and audited: the audit revokes trust within the first rounds.

And a drafter that knows a request's seed cannot predict the verifier's uniforms.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from draft_client_testlib import (
    client,
    encode_prompts,
    honest_handshake,
    load_runner,
    start_scripted,
    target_handshake,
)

from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc
from outrider.target_worker.draft_client import DraftClientConfig, RemoteDraftSource
from outrider.target_worker.draft_source import DraftSource, InProcessDraftSource
from outrider.target_worker.draft_trust import VerificationMode
from outrider.target_worker.engine import Engine
from outrider.target_worker.sequence import RequestParams

CHOSEN = 1000  # the token the attacker wants in the output
NUM_SAMPLES = 400  # seeded requests per arm
KEY = b"test-key" * 4
PARAMS = dict(temperature=1.0, max_tokens=6, ignore_eos=True)


def lying_chain(seq_id: int, round: int, root: int, budget: pb.TreeBudget, vocab: int) -> pb.CandidateTree:
    depth = max(0, min(budget.max_depth, budget.max_nodes - 1))  # 0: root only (the last round)
    decoy = (CHOSEN + 1) % vocab
    return pb.CandidateTree(
        seq_id=seq_id,
        round=round,
        tokens=[root] + [CHOSEN] * depth,
        parents=list(range(-1, depth)),
        q_nodes=list(range(depth)),
        q_top_k=2,
        q_token_ids=[CHOSEN, decoy] * depth,
        q_probs=[1e-6, 1 - 1e-6] * depth,
        sampling=pb.DRAFT_SAMPLING_WITH_REPLACEMENT,
    )


class LyingDrafter(pb_grpc.DraftServiceServicer):
    """Valid-looking trees of its own choosing, a dishonest q, and pushed guesses too."""

    def __init__(self, handshake: pb.HandshakeResponse, vocab: int):
        self.handshake, self.vocab = handshake, vocab

    def Handshake(self, request, context) -> pb.HandshakeResponse:
        return self.handshake

    def Draft(self, request_iterator, context) -> Iterator[pb.DraftResponse]:
        for request in request_iterator:
            trees, pushed = [], []
            for u in request.updates:
                if u.finished or u.answered:
                    continue
                trees.append(lying_chain(u.seq_id, u.round, u.new_tokens[-1], u.budget, self.vocab))
                for run in range(1, 4):  # guesses for the next round: CHOSEN accepted 1-3 times
                    tree = lying_chain(u.seq_id, u.round + 1, CHOSEN, u.budget, self.vocab)
                    pushed.append(pb.SpeculativeTree(new_tokens=[CHOSEN] * run, tree=tree))
            yield pb.DraftResponse(trees=trees, speculative=pushed)


@pytest.fixture(scope="module")
def runner(tiny_family):
    return load_runner(tiny_family.target_dir)


@pytest.fixture(scope="module")
def prompt(tiny_family):
    return encode_prompts(tiny_family.tokenizer_dir)[0]


@pytest.fixture(scope="module")
def liar(tiny_family) -> Iterator[str]:
    request = target_handshake(tiny_family)
    server, port = start_scripted(LyingDrafter(honest_handshake(request), request.vocab_size))
    yield f"127.0.0.1:{port}"
    server.stop(None)


def sample(runner, prompt, source: DraftSource | None, seeds: range, auditing: bool = True):
    """Outputs of one seeded request per seed (all batched together), and the engine."""
    engine = Engine(runner, source, eos_token_id=None, max_batch=64, draft_timeout_s=2.0, seed_key=KEY)
    if engine.trust is not None:
        engine.trust.auditing = auditing
    params = [RequestParams(seed=seed, **PARAMS) for seed in seeds]
    return [c.token_ids for c in engine.generate([prompt] * len(seeds), params)], engine


def chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; cells expected below 5 are pooled."""
    n_a, n_b = sum(a.values()), sum(b.values())
    big = [t for t in set(a) | set(b) if (a[t] + b[t]) * min(n_a, n_b) / (n_a + n_b) >= 5]
    cells = [(a[t], b[t]) for t in big]
    cells.append((n_a - sum(x for x, _ in cells), n_b - sum(y for _, y in cells)))
    cells = [c for c in cells if sum(c)]
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def plain_first_verified(runner, prompt) -> Counter:
    """The first token verification decides (output index 1), speculation off."""
    outputs, _ = sample(runner, prompt, None, range(NUM_SAMPLES, 2 * NUM_SAMPLES))
    return Counter(o[1] for o in outputs)


def run_against_liar(tiny_family, runner, prompt, liar, trust_q: bool, auditing: bool = True):
    source = client(tiny_family, [liar], round_deadline_s=2.0, trust_q=trust_q)
    try:
        assert source.wait_ready(10)
        outputs, engine = sample(runner, prompt, source, range(NUM_SAMPLES), auditing)
        assert source.counters.trees_received > 0 and source.counters.trees_invalid == 0
        return Counter(o[1] for o in outputs), engine, source.counters
    finally:
        source.close()


def test_a_remote_source_is_untrusted_unless_configured(tiny_family, runner, liar):
    source = RemoteDraftSource([liar], target_handshake(tiny_family))
    try:
        assert not source.trusts_q and not DraftClientConfig().trust_q
        assert Engine(runner, source, eos_token_id=None).trust.mode == VerificationMode.DETERMINISTIC
    finally:
        source.close()


def test_an_untrusted_lying_drafter_cannot_change_the_distribution(
    tiny_family, runner, prompt, liar, plain_first_verified
):
    spec, engine, counters = run_against_liar(tiny_family, runner, prompt, liar, trust_q=False)
    assert engine.trust.mode == VerificationMode.DETERMINISTIC
    assert engine.trust.demoted_trees >= NUM_SAMPLES and engine.stats.num_trees == counters.trees_received
    assert chi_square_p_value(spec, plain_first_verified) > 1e-3
    assert spec[CHOSEN] <= plain_first_verified[CHOSEN] + 4 * math.sqrt(plain_first_verified[CHOSEN] + 1)


def test_trusting_a_remote_q_lets_the_liar_write_the_output(
    tiny_family, runner, prompt, liar, plain_first_verified
):
    """The check above can fail: with the liar's q believed, CHOSEN takes over."""
    spec, engine, _ = run_against_liar(tiny_family, runner, prompt, liar, trust_q=True, auditing=False)
    assert engine.trust.mode == VerificationMode.DRAFT_Q
    assert spec[CHOSEN] > NUM_SAMPLES // 2 > 10 * (plain_first_verified[CHOSEN] + 1)
    assert chi_square_p_value(spec, plain_first_verified) < 1e-6


def test_the_audit_revokes_a_trusted_liar_in_its_first_rounds(tiny_family, runner, prompt, liar):
    _, engine, _ = run_against_liar(tiny_family, runner, prompt, liar, trust_q=True)
    assert engine.trust.mode == VerificationMode.REVOKED
    assert engine.trust.audited_rounds <= 2 and engine.trust.demoted_trees > 0


class RecordingSource(InProcessDraftSource):
    """An in-process proposer that also keeps every update it is given."""

    def __init__(self, proposer):
        super().__init__(proposer)
        self.seen = []

    def submit(self, updates):
        self.seen.extend(updates)
        super().submit(updates)


def test_a_drafter_that_knows_the_seed_cannot_predict_the_verifiers_uniforms(tiny_family, runner, prompt):
    from outrider.draft_worker.proposer import build_proposer

    proposer = build_proposer(
        {"method": "ngram", "num_speculative_tokens": 3}, vocab_size=runner.model.vocab_size
    )
    source = RecordingSource(proposer)
    engine = Engine(runner, source, eos_token_id=None, max_batch=4, seed_key=KEY)
    request_id = engine.add_request(prompt, RequestParams(seed=7, **PARAMS))
    verify_generator = engine.waiting[-1].generator
    while engine.has_unfinished():
        engine.step()
    (draft_seed,) = {u.sampling.seed for u in source.seen if u.seq_id == request_id}
    assert draft_seed not in (None, 7)
    # What the drafter could compute from either seed it knows is not what the verifier draws.
    verifier = torch.rand(64, generator=torch.Generator().manual_seed(verify_generator.initial_seed()))
    for known in (7, draft_seed):
        assert not torch.equal(torch.rand(64, generator=torch.Generator().manual_seed(known)), verifier)
    assert verify_generator.initial_seed() not in (7, draft_seed)


@pytest.mark.parametrize("same_key", [True, False])
def test_seeded_requests_reproduce_under_one_key_only(runner, prompt, same_key):
    engine = Engine(runner, None, eos_token_id=None, seed_key=KEY if same_key else b"another key")
    params = [RequestParams(seed=seed, **(PARAMS | {"max_tokens": 12})) for seed in range(4)]
    again = [c.token_ids for c in engine.generate([prompt] * 4, params)]
    first = [
        c.token_ids
        for c in Engine(runner, None, eos_token_id=None, seed_key=KEY).generate([prompt] * 4, params)
    ]
    assert (again == first) == same_key
