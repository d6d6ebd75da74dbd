"""The serving layer's pieces without Ray: config edge, stop strings, metrics page, draft policy,
step-loop overload and abort."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from outrider.cluster.config import OutriderArgs, load_args
from outrider.cluster.engine_loop import EngineLoop, EngineOverloaded
from outrider.cluster.messages import DraftAnnouncement, ReplicaSnapshot
from outrider.cluster.metrics import Metrics
from outrider.cluster.placement import DraftLoadPolicy, draft_options, target_options
from outrider.cluster.serve_cli import add_serve_parser, args_from_cli
from outrider.cluster.text import Detokenizer


def test_config_validates_at_the_edge():
    args = load_args({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    assert args.speculative == {"method": "ngram", "num_speculative_tokens": 3}
    assert load_args({"no_speculation": True}).speculative is None
    assert load_args({"draft_pool": {"draft_endpoints": ["10.0.0.2:50051"]}}).draft_pool.mode == "external"
    for bad, field in [
        ({"speculative_config": {"method": "nope"}}, "speculative_config"),
        ({"speculative_config": {"method": "ngram", "bogus": 1}}, "speculative_config"),
        ({"draft_pool": {"draft_endpoints": ["no-port"]}}, "draft_pool"),
        ({"target": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "target"),
        ({"engin": {}}, "engin"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ]:
        with pytest.raises(ValidationError) as error:
            load_args(bad)
        first = error.value.errors()[0]
        assert (first["loc"] or (None,))[0] == field or first["msg"].startswith(f"Value error, {field}:")


@pytest.mark.parametrize(
    "pool,trusted",
    [
        ({}, True),  # colocated: the proposer runs in the target's own process
        ({"mode": "deployment"}, True),  # the application's own draft deployment
        ({"draft_endpoints": ["10.0.0.2:50051"]}, False),  # external: never trusted by default
        ({"draft_endpoints": ["10.0.0.2:50051"], "trust_draft_distribution": True}, True),
        ({"mode": "deployment", "trust_draft_distribution": False}, False),
    ],
)
def test_whose_draft_q_is_trusted_is_the_operators_choice(pool, trusted):
    assert load_args({"draft_pool": pool}).draft_pool.trusts_drafts is trusted


@pytest.mark.parametrize("trusted", [True, False])
def test_the_timed_wrapper_keeps_its_sources_capabilities(trusted):
    from outrider.cluster.target import TimedDraftSource

    inner = SimpleNamespace(
        validates_trees=True, trusts_q=trusted, label="draft workers a:1", overlaps_drafting=True
    )
    timed = TimedDraftSource(inner)
    assert timed.trusts_q is trusted and timed.label == "draft workers a:1" and timed.overlaps_drafting


def test_seed_key_comes_from_its_file_or_fresh(tmp_path):
    engine = load_args({}).engine
    assert len(engine.seed_key()) == 32 and engine.seed_key() != engine.seed_key()
    key_file = tmp_path / "seed.key"
    key_file.write_bytes(b"a secret")
    engine = load_args({"engine": {"seed_key_file": str(key_file)}}).engine
    assert engine.seed_key() == engine.seed_key() and len(engine.seed_key()) == 64
    key_file.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        engine.seed_key()


def test_every_config_field_has_a_description():
    def check(model) -> None:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            for inner in getattr(annotation, "__args__", (annotation,)):
                if isinstance(inner, type) and hasattr(inner, "model_fields"):
                    check(inner)

    check(OutriderArgs)


def test_deployment_options_without_gpus():
    from outrider.cluster.gpu_pools import PoolAssignment

    none = PoolAssignment(draft=(), target=())
    args = load_args({"tensor_parallel_size": 2, "target": {"num_cpus": 1}, "engine": {"max_num_seqs": 4}})
    options = target_options(args, none)
    assert options["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
    assert options["placement_group_strategy"] == "PACK"  # one node when it fits; may span nodes
    assert options["max_queued_requests"] == args.engine.max_queued_requests
    draft = draft_options(load_args({"draft_pool": {"autoscaling": {"max_replicas": 3}}}), none)
    assert (
        draft["autoscaling_config"]["policy"]["policy_function"]
        == "outrider.cluster.placement:DraftLoadPolicy"
    )
    assert draft["ray_actor_options"]["num_gpus"] == 0


@pytest.mark.parametrize("transport,by_reference", [(None, False), ("grpc", False), ("ray", True)])
def test_the_ingress_streams_from_targets_on_the_configured_transport(transport, by_reference):
    """gRPC unless `target.transport: ray` says otherwise (one Ray object per chunk)."""
    from outrider.cluster.ingress import target_handle

    class Handle:  # a DeploymentHandle's `options` (a real one needs a running Serve)
        def __init__(self, **options):
            self.options_set = options

        def options(self, **options):
            return Handle(**self.options_set, **options)

    args = load_args({"demo": "tiny", "target": {} if transport is None else {"transport": transport}})
    assert target_handle(Handle(), args.target.transport).options_set == {"_by_reference": by_reference}


def test_draft_policy_scales_on_busy_share():
    policy = DraftLoadPolicy(target_busy_fraction=0.5)
    ctx = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, aggregated_metrics={})
    assert policy(ctx)[0] == 2  # no signal yet: stay
    ctx.aggregated_metrics = {"draft_busy_fraction": {"a": 0.9, "b": 0.9}}
    assert policy(ctx)[0] == 4
    ctx.aggregated_metrics = {"draft_busy_fraction": {"a": 0.1, "b": 0.1}}
    assert policy(ctx)[0] == 1


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_detokenizer_holds_back_a_possible_stop_and_cuts_at_it():
    detok = Detokenizer(_CharTokenizer(), ["END"])
    assert detok.add([ord("a"), ord("b"), ord("E")]) == "ab"  # "E" may start "END"
    assert detok.add([ord("x")]) == "Ex"
    assert detok.add([ord("E"), ord("N")]) == ""
    assert detok.add([ord("D"), ord("z")]) == ""
    assert detok.stopped and detok.flush() == ""
    plain = Detokenizer(_CharTokenizer(), ["END"])
    plain.add([ord("E")])
    assert plain.flush() == "E"


def test_metrics_page_sums_replica_snapshots():
    metrics = Metrics("m")
    metrics.snapshot(
        ReplicaSnapshot(replica="a", num_drafts=2, num_accepted_tokens=3, num_accepted_tokens_per_pos=(2, 1))
    )
    metrics.snapshot(
        ReplicaSnapshot(replica="b", num_drafts=2, num_accepted_tokens=1, num_accepted_tokens_per_pos=(1,))
    )
    metrics.request_done(5, [1.0, 1.1, 1.2], 0.9, "length")
    page = metrics.render()
    assert 'outrider:spec_decode_num_drafts_total{model_name="m"} 4' in page
    assert 'outrider:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3' in page
    assert 'outrider:spec_decode_mean_acceptance_length{model_name="m"} 2.0' in page
    assert 'outrider:time_to_first_token_seconds_count{model_name="m"} 1' in page
    assert 'outrider:generation_tokens_total{model_name="m"} 3' in page


def test_metrics_page_takes_the_cache_hit_rate_from_the_draft_replicas():
    metrics = Metrics("m")
    metrics.snapshot(ReplicaSnapshot(replica="t", num_drafts=5))  # target replicas report no cache counters
    metrics.draft_snapshots(
        [
            DraftAnnouncement("a:1", "draft-a", cache_hits=3, cache_lookups=4, trees_sent=9, trees_pushed=6),
            DraftAnnouncement("b:1", "draft-b", cache_hits=1, cache_lookups=4, trees_sent=1),
        ]
    )
    metrics.draft_snapshots(
        [DraftAnnouncement("b:1", "draft-b", cache_hits=2, cache_lookups=4, trees_sent=2)]
    )
    page = metrics.render()
    assert 'outrider:spec_cache_hits_total{model_name="m"} 5' in page
    assert 'outrider:spec_cache_lookups_total{model_name="m"} 8' in page
    assert 'outrider:spec_cache_hit_rate{model_name="m"} 0.625' in page
    assert 'outrider:draft_trees_sent_total{model_name="m"} 11' in page
    assert 'outrider:draft_trees_pushed_total{model_name="m"} 6' in page


def test_metrics_page_shows_the_policys_budgets_and_its_calibration():
    metrics = Metrics("m")
    metrics.snapshot(
        ReplicaSnapshot(
            replica="a",
            budget_depths=(3, 0, 2),
            policy_predicted_tokens=8.5,
            policy_measured_tokens=9,
            policy_shadow_drafts=4,
            policy_shadow_kept_tokens=3,
        )
    )
    metrics.snapshot(ReplicaSnapshot(replica="b", budget_depths=(1,)))
    page = metrics.render()
    assert 'outrider:spec_decode_draft_depth_bucket{model_name="m",le="0"} 4' in page
    assert 'outrider:spec_decode_draft_depth_bucket{model_name="m",le="2"} 6' in page
    assert 'outrider:spec_decode_draft_depth_count{model_name="m"} 6' in page
    assert 'outrider:spec_decode_draft_depth_sum{model_name="m"} 4' in page
    assert 'outrider:spec_policy_predicted_tokens_total{model_name="m"} 8.5' in page
    assert 'outrider:spec_policy_measured_tokens_total{model_name="m"} 9' in page
    assert 'outrider:spec_policy_shadow_drafts_total{model_name="m"} 4' in page
    assert 'outrider:spec_policy_shadow_kept_tokens_total{model_name="m"} 3' in page


def test_metrics_page_says_how_each_replica_verifies_its_drafts():
    metrics = Metrics("m")
    metrics.snapshot(ReplicaSnapshot(replica="a", draft_verification="deterministic", trees_demoted=7))
    metrics.snapshot(
        ReplicaSnapshot(
            replica="b",
            draft_verification="draft_q",
            audited_children=4,
            audit_ratio_sum=3.0,
            trees_demoted=1,
        )
    )
    metrics.snapshot(ReplicaSnapshot(replica="c"))  # speculation off: no mode
    page = metrics.render()
    assert 'outrider:draft_verification_mode{model_name="m",replica="a",mode="deterministic"} 1' in page
    assert 'outrider:draft_verification_mode{model_name="m",replica="b",mode="draft_q"} 1' in page
    assert 'replica="c"' not in page
    assert 'outrider:draft_trees_demoted_total{model_name="m"} 8' in page
    assert 'outrider:draft_audit_mean_ratio{model_name="m"} 0.75' in page


@dataclass
class _Out:
    request_id: int
    new_token_ids: list
    finished: bool
    finish_reason: str | None


class _FakeEngine:
    """One token per step per request, `length` after prompt[0] tokens."""

    def __init__(self):
        self.live, self.length, self.next_id, self.aborted = {}, {}, 0, []

    def add_request(self, prompt, params, output_token_ids=()):
        self.next_id += 1
        self.live[self.next_id], self.length[self.next_id] = len(output_token_ids), prompt[0]
        return self.next_id

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.live.pop(request_id, None)

    def step(self):
        time.sleep(0.005)
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] == self.length[rid]
            outs.append(_Out(rid, [self.live[rid]], done, "length" if done else None))
            if done:
                del self.live[rid]
        return outs


def test_engine_loop_streams_refuses_overload_and_aborts():
    async def scenario():
        engine = _FakeEngine()
        loop = EngineLoop(engine, max_num_seqs=1, max_queued=1)
        try:
            first, q1 = loop.submit([3], None)
            _, q2 = loop.submit([10_000], None)
            with pytest.raises(EngineOverloaded):
                loop.submit([3], None)
            tokens = []
            while not (out := await asyncio.wait_for(q1.get(), 5)).finished:
                tokens += out.new_token_ids
            assert tokens + out.new_token_ids == [1, 2, 3]
            first_of_second = await asyncio.wait_for(q2.get(), 5)
            assert first_of_second.new_token_ids == [1]
            loop.abort(2)
            await asyncio.sleep(0.2)
            assert engine.aborted == [2] and loop.num_running == 0
        finally:
            loop.stop()

    asyncio.run(scenario())


def test_serve_cli_flags_over_yaml(tmp_path):
    import argparse

    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(
        "applications:\n  - import_path: outrider.cluster.app:build_app\n    args: {demo: tiny, tensor_parallel_size: 2}\n"
    )
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    ns = parser.parse_args(
        ["serve", "--config", str(yaml_file), "--tp", "1", "--speculative-config", '{"method": "suffix"}']
    )
    args = load_args(args_from_cli(ns))
    assert (args.demo, args.tensor_parallel_size, args.speculative_config) == (
        "tiny",
        1,
        {"method": "suffix"},
    )
