"""The typed messages between ingress, target replicas, draft replicas and metrics, and the
one sampling-parameter type the ingress builds from the HTTP request."""

from __future__ import annotations

import dataclasses

import pytest

from outrider.cluster.config import DEFAULT_SPECULATIVE_CONFIG, load_args
from outrider.cluster.messages import DraftAnnouncement, ReplicaSnapshot, StreamChunk
from outrider.cluster.openai_api import ChatCompletionRequest, CompletionRequest
from outrider.proto import DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_TREE_BUDGET, SamplingParams, TreeBudget
from outrider.target_worker.sequence import RequestParams


def test_replica_snapshots_total_every_counter():
    a = ReplicaSnapshot("a", num_drafts=2, num_accepted_tokens_per_pos=(2, 1), draft_round_trip_s=0.5)
    b = ReplicaSnapshot("b", num_drafts=3, num_accepted_tokens_per_pos=(4,), running=2, max_num_seqs=8)
    total = ReplicaSnapshot.total([a, b])
    assert (total.num_drafts, total.num_accepted_tokens_per_pos) == (5, (6, 1))
    assert (total.running, total.max_num_seqs, total.draft_round_trip_s) == (2, 8, 0.5)
    assert ReplicaSnapshot.total([]) == ReplicaSnapshot("*")
    drafts = DraftAnnouncement.total(
        [DraftAnnouncement("h:1", "d1", cache_hits=1), DraftAnnouncement("h:2", "d2")]
    )
    assert (drafts.cache_hits, drafts.trees_sent) == (1, 0)


def test_a_misspelt_or_changed_field_fails_loudly():
    with pytest.raises(TypeError):
        ReplicaSnapshot("a", num_draft=1)  # not a field: no silent 0
    chunk = StreamChunk(admitted=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.token_ids = (1,)


def test_the_ingress_builds_the_engines_params_from_the_http_request():
    req = CompletionRequest(model="m", prompt="x", temperature=0.5, top_p=0.9, top_k=-1, seed=5, stop="END")
    params = req.request_params(max_tokens=10, index=1)
    # top_k -1 (vLLM's "off") is the engine's 0; choice 1 of a seeded request gets seed + 1;
    # stop strings stay at the ingress (matched on its text), not in the engine.
    assert params == RequestParams(max_tokens=10, temperature=0.5, top_k=0, top_p=0.9, seed=6)
    assert params.sampling == SamplingParams(temperature=0.5, top_k=0, top_p=0.9, seed=6)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.request_params(max_tokens=3, index=0) == RequestParams(max_tokens=3, temperature=1.0)


def test_tree_budget_defaults_come_from_one_place():
    assert load_args({}).tree_budget_limit == DEFAULT_TREE_BUDGET
    partial = load_args({"tree_budget": {"max_nodes": 20}}).tree_budget_limit
    assert partial == TreeBudget(
        20, DEFAULT_TREE_BUDGET.max_depth, DEFAULT_TREE_BUDGET.top_k, DEFAULT_TREE_BUDGET.q_width
    )
    assert DEFAULT_SPECULATIVE_CONFIG["num_speculative_tokens"] == DEFAULT_NUM_SPECULATIVE_TOKENS
