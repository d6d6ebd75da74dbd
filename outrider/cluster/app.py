"""`build_app(args)`: the Outrider Ray Serve application, three deployments composed.

HTTP ──> OpenAIIngress ──(token ids over Serve gRPC)──> TargetWorker x N (engine, TP group)
                                                           │ gRPC rounds
                                                           v
                                                     DraftWorker x M   (or in-process / external)

serve run cluster.app:build_app demo=tiny         # args as key=value
serve run outrider/cluster/serve_demo.yaml                  # import_path + args
outrider serve --demo tiny                         # the same, with an embedded local Ray
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from outrider.cluster.config import OutriderArgs, load_args
from outrider.cluster.draft import DraftWorker
from outrider.cluster.ingress import OpenAIIngress
from outrider.cluster.placement import cluster_pools, draft_options, target_options
from outrider.cluster.served_model import resolve_model
from outrider.cluster.target import TargetWorker, speculative_for

# Set in every Ray process of a cluster that serves Outrider (`ray start`'s environment; the
# KubeRay manifests set it in each pod): Serve's HTTP proxy reaches the ingress over gRPC
# instead of a Ray object per batch of ASGI messages (benchmarks/results/http_transport_small.md).
RAY_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1"}


def set_ray_env() -> None:
    """`RAY_ENV` in this process's environment, where not set already: before `ray.init`
    starts a local Ray, whose processes (Serve's proxy among them) inherit it."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)


def draft_capacity(args: OutriderArgs) -> int:
    """Sequences each draft replica is sized for (`DraftPoolArgs.max_sequences`)."""
    if args.draft_pool.max_sequences is not None:
        return args.draft_pool.max_sequences
    target = args.target
    replicas = target.autoscaling.max_replicas if target.autoscaling else target.num_replicas
    return max(32, args.engine.max_num_seqs * replicas)


def build_app(args: OutriderArgs | dict[str, Any] | None = None) -> serve.Application:
    args = load_args(args)
    model, pools = resolve_model(args, progress=True), cluster_pools(args)
    spec = speculative_for(args, model)
    if spec is not None and args.draft_pool.mode == "deployment":
        # Bound only so Serve deploys it: targets reach drafters over gRPC, found by registry.
        drafts = DraftWorker.options(**draft_options(args, pools)).bind(
            model, spec, args.draft_pool.grpc_port, args.draft_pool.model_dump(), draft_capacity(args)
        )
    else:
        drafts = None
    target = TargetWorker.options(**target_options(args, pools)).bind(
        model, args.model_dump(), drafts, args.engine.seed_key()
    )
    ingress = OpenAIIngress.options(ray_actor_options={"num_cpus": args.ingress_num_cpus})
    return ingress.bind(
        target,
        model,
        args.engine.default_max_tokens,
        args.chat_template,
        args.api_key_file,
        args.request_limits,
        args.target.transport,
    )
