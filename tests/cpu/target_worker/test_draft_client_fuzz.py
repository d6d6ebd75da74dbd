"""A hostile drafter against the target's draft client, with generated messages (hypothesis).

One scripted draft worker stays connected; each generated case replaces its script: how many
trees it answers an update with, and what they hold (wrong seq_id or round, a wrong or
out-of-vocabulary root, random tokens and parents, sparse q of any shape with NaN, infinite,
negative or unnormalised probabilities, draft-sampling values outside the enum, trees past
the negotiated limits), and pushed speculative trees of the same kinds. The invariant is the
architecture's first one: greedy output through the client equals plain decoding, token for
token, and nothing raises.
"""

from __future__ import annotations

import time

import pytest
from draft_client_testlib import (
    ScriptedDrafter,
    client,
    encode_prompts,
    generate,
    honest_handshake,
    load_runner,
    start_scripted,
    target_handshake,
)
from fuzz_testlib import Outcomes, fuzz
from hypothesis import given
from hypothesis import strategies as st

from outrider.proto import outrider_pb2 as pb

MAX_TOKENS = 10
INT32 = 2**31 - 1
EXTREME = st.sampled_from([-(2**31), -1, INT32, 2**20])
PROB = st.one_of(
    st.floats(0, 1), st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.5, 1.5, 1e30])
)


class FuzzDrafter(ScriptedDrafter):
    """A ScriptedDrafter whose `script(update)` returns whole DraftResponses (pushed trees too)."""

    def __init__(self, handshake: pb.HandshakeResponse):
        super().__init__(handshake, reply=None)
        self.script = lambda update: []

    def Draft(self, request_iterator, context):
        for request in request_iterator:
            for update in request.updates:
                yield from self.script(update)


@pytest.fixture(scope="module")
def runner(tiny_family):
    return load_runner(tiny_family.target_dir)


@pytest.fixture(scope="module")
def prompts(tiny_family):
    return encode_prompts(tiny_family.tokenizer_dir)[:3]


@pytest.fixture(scope="module")
def plain(runner, prompts):
    return generate(runner, prompts, max_tokens=MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def hostile(tiny_family):
    request = target_handshake(tiny_family)
    drafter = FuzzDrafter(honest_handshake(request))
    server, port = start_scripted(drafter)
    source = client(tiny_family, [f"127.0.0.1:{port}"], round_deadline_s=0.1)
    assert source.wait_ready(10)
    yield drafter, source, request.vocab_size
    source.close()
    server.stop(None)


@pytest.fixture(scope="module")
def outcomes():
    recorded = Outcomes("grpc draft client (hostile drafter)")
    yield recorded
    recorded.save()


# ------------------------------------------------------------------------------ strategies


@st.composite
def tree_spec(draw) -> dict:
    """How one tree is derived from the update it answers (pure data, applied per round)."""
    size = draw(st.integers(1, 9))
    return {
        "seq_shift": draw(st.sampled_from([0, 0, 0, 1, -1, 2**40])),
        "round_shift": draw(st.sampled_from([0, 0, 0, 1, -1, 2**32])),
        "root": draw(st.sampled_from(["right", "right", "right", "wrong", "out", "none"])),
        "tokens": draw(
            st.one_of(
                st.just("echo"),  # the context's last tokens again: sometimes what the target says
                st.lists(st.one_of(st.integers(0, 40), st.integers(-3, 5000), EXTREME), max_size=size),
            )
        ),
        "parents": draw(
            st.one_of(
                st.just("chain"),
                st.just("star"),
                st.lists(st.one_of(st.integers(-2, size + 2), EXTREME), min_size=size, max_size=size + 1),
            )
        ),
        "q": draw(
            st.one_of(
                st.none(),
                st.fixed_dictionaries(
                    {
                        "q_nodes": st.lists(st.integers(-1, size + 1), max_size=4),
                        "q_top_k": st.one_of(st.integers(0, 4), st.just(2**20)),
                        "q_token_ids": st.lists(st.one_of(st.integers(-1, 50), EXTREME), max_size=16),
                        "q_probs": st.lists(PROB, max_size=16),
                    }
                ),
            )
        ),
        "sampling": draw(st.sampled_from([1, 1, 2, 3, 0, 7, -1])),
        "huge": draw(st.sampled_from([False] * 9 + [True])),
    }


def build_tree(spec: dict, update: pb.SequenceUpdate, vocab: int) -> pb.CandidateTree:
    root = update.new_tokens[-1] if update.new_tokens else 0
    root = {"right": [root], "wrong": [(root + 1) % vocab], "out": [vocab + 3], "none": []}[spec["root"]]
    drafts = list(update.new_tokens[-4:]) * 2 if spec["tokens"] == "echo" else spec["tokens"]
    tokens = root + drafts
    if spec["huge"]:
        tokens = tokens + [1] * 20_000
    parents = spec["parents"]
    if parents == "chain":
        parents = list(range(-1, len(tokens) - 1))
    elif parents == "star":
        parents = [-1] + [0] * (len(tokens) - 1)
    q = spec["q"] or {}
    return pb.CandidateTree(
        seq_id=(update.seq_id + spec["seq_shift"]) % 2**64,
        round=(update.round + spec["round_shift"]) % 2**64,
        tokens=tokens,
        parents=parents,
        sampling=spec["sampling"],
        **q,
    )


SCRIPT = st.fixed_dictionaries(
    {
        "trees": st.lists(tree_spec(), max_size=3),  # 0: no answer, 2+: duplicates
        "pushed": st.lists(
            st.tuples(st.lists(st.integers(-1, 60), max_size=4), tree_spec()), max_size=2
        ),  # speculative trees for guessed outcomes
        "every": st.sampled_from([1, 1, 2, 3]),  # the script answers one round in `every`
    }
)


def make_script(script: dict, vocab: int):
    def reply(update: pb.SequenceUpdate) -> list[pb.DraftResponse]:
        if update.round % script["every"]:
            return []
        trees = [build_tree(spec, update, vocab) for spec in script["trees"]]
        pushed = [
            pb.SpeculativeTree(new_tokens=guess, tree=build_tree(spec, update, vocab))
            for guess, spec in script["pushed"]
        ]
        return [pb.DraftResponse(trees=trees, speculative=pushed)]

    return reply


@fuzz(20)
@given(script=SCRIPT)
def test_a_hostile_drafter_never_changes_greedy_output(runner, prompts, plain, hostile, outcomes, script):
    drafter, source, vocab = hostile
    drafter.script, started = make_script(script, vocab), time.monotonic()
    before = source.counters.trees_received, source.counters.trees_invalid
    outputs, stats = generate(runner, prompts, source, max_tokens=MAX_TOKENS)
    assert outputs == plain
    received = source.counters.trees_received - before[0]
    invalid = source.counters.trees_invalid - before[1]
    if stats.spec.num_accepted_tokens:
        outcome = "drafts accepted, output unchanged"
    elif received:
        outcome = "trees verified, none accepted, output unchanged"
    elif invalid:
        outcome = "every tree refused, output unchanged"
    else:
        outcome = "no tree in time, output unchanged"
    outcomes.add(outcome, started)
