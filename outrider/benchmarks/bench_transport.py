"""What each hop's transport costs over HTTP: Serve's proxy to the ingress, the ingress to the target.

Every token a stream carries crosses two Ray Serve hops after the engine made it:

    client ──HTTP──> proxy ──(hop 1)──> OpenAIIngress ──(hop 2)──> TargetWorker (engine)

and each hop moves one message per chunk, at about the same cost whatever the chunk carries.
Each hop can go as Ray objects (Serve's default: one object per chunk, or per batch of ASGI
messages) or over Serve's gRPC transport: hop 1 with `RAY_SERVE_PROXY_USE_GRPC=1` in Ray's
environment (`cluster.app.RAY_ENV`, set by `outrider serve` and the KubeRay manifests), hop 2
with `target.transport` ("grpc", the default, or "ray").

Two local Ray sessions, one per proxy setting (it is read once, when the proxy starts); in
each, two applications of the same config that differ only in `target.transport`, measured
in alternating blocks at each concurrency (`bench_http_sweep.rotated_levels`, the target
replicas pinned to the last core). Ratios within a session are paired; across sessions they
compare different processes (each runs at its own speed, +-3% on this machine).

    python -m outrider.benchmarks.bench_transport --size small
"""

from __future__ import annotations

import argparse
import os
import time

from outrider.benchmarks.bench_http_sweep import level_parser, measure_level, run_level
from outrider.benchmarks.bench_serving import app_args, start_local_ray, unpin
from outrider.benchmarks.report import write_run_report

PROXY_SETTINGS = {"ray": "0", "grpc": "1"}  # RAY_SERVE_PROXY_USE_GRPC
TRANSPORTS = ("ray", "grpc")  # TargetDeploymentArgs.transport


def session(args: argparse.Namespace, proxy: str, prompts: list, log=print) -> list[dict]:
    """One Ray session with Serve's proxy on `proxy`: a row per target transport and level."""
    import ray
    from ray import serve

    from outrider.cluster.app import build_app

    os.environ["RAY_SERVE_PROXY_USE_GRPC"] = PROXY_SETTINGS[proxy]  # before Ray starts the proxy
    port = start_local_ray()
    name, context = f"outrider-demo-{args.size}", args.prompt_tokens + args.max_tokens + 16
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        apps = []
        for transport in TRANSPORTS:
            variant = "off" if args.method == "off" else "colocated"
            spec = {"method": args.method, "num_speculative_tokens": 8}
            config = app_args(variant, {"demo": args.size}, spec, context)
            config["engine"]["max_num_seqs"] = config["engine"]["max_queued_requests"] = max(args.concurrency)
            config["target"]["transport"] = transport
            serve.run(build_app(config), name=transport, route_prefix=f"/{transport}")
            base = f"http://127.0.0.1:{port}/{transport}"
            run_level(base, name, prompts, 2, 8, args.temperature, args.max_tokens, True)  # warm-up
            apps.append((transport, base))
        for j, concurrency in enumerate(args.concurrency):
            started = time.perf_counter()
            # (every answer runs to --max-tokens: `ignore_eos`, which this parser does not offer)
            n, measured = measure_level(  # every answer runs to --max-tokens (ignore_eos)
                apps, args, j % 2 == 1, name, prompts, concurrency, args.temperature, True, True
            )
            base_tok_s = measured["ray"]["output_tok_s"]
            for transport in TRANSPORTS:
                figures = {k: v for k, v in measured[transport].items() if k in FIGURES}
                rows.append(
                    {
                        "proxy": proxy,
                        "target_transport": transport,
                        "concurrency": concurrency,
                        "requests": n,
                        **figures,
                        "vs_target_ray_same_session": figures["output_tok_s"] / base_tok_s,
                    }
                )
            log(
                f"proxy {proxy} c={concurrency}: target ray {base_tok_s:.0f} tok/s, grpc "
                f"{measured['grpc']['output_tok_s']:.0f} ({time.perf_counter() - started:.0f} s)"
            )
    finally:
        serve.shutdown()
        ray.shutdown()
        unpin()
    return rows


FIGURES = ("output_tok_s", "ttft_ms_median", "tpot_ms_median", "itl_ms_median", "itl_ms_p99")


def main(argv: list[str] | None = None) -> None:
    parser = level_parser(__doc__)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--method", default="off", help="off (plain decoding: the transport alone) or a speculative method"
    )
    args = parser.parse_args(argv)
    from outrider.benchmarks.prompts import mid_prompt_ids
    from outrider.demo.family import ensure_demo_family

    family = ensure_demo_family(args.size, progress=False)
    prompts = [tuple(p) for p in mid_prompt_ids(family.tokenizer_dir, args.prompts, args.prompt_tokens)]
    rows = [row for proxy in PROXY_SETTINGS for row in session(args, proxy, prompts)]
    old = {r["concurrency"]: r["output_tok_s"] for r in rows if r["proxy"] == r["target_transport"] == "ray"}
    for row in rows:
        row["vs_all_ray"] = row["output_tok_s"] / old[row["concurrency"]]
    write_run_report(
        "http_transport",
        rows,
        args,
        title="Serve's transports over HTTP: proxy to ingress, ingress to target",
        notes="Each token crosses two Ray Serve hops after the engine: Serve's HTTP proxy to the "
        "ingress (`proxy`: Ray objects, or gRPC with RAY_SERVE_PROXY_USE_GRPC=1) and the ingress "
        "to the target replica (`target_transport`: `target.transport` ray or grpc). One local Ray "
        "session per proxy setting; in each, the two target transports in alternating blocks, "
        "target replicas pinned to the last core."
        + f" Method {args.method}, T = {args.temperature:g}, every answer {args.max_tokens} tokens "
        "(ignore_eos). `vs_target_ray_same_session`: paired, against target transport ray in the "
        "same session; `vs_all_ray`: against both hops on Ray objects (Serve's defaults, the first "
        "session), across sessions.",
    )


if __name__ == "__main__":
    main()
