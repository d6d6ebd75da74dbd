"""`outrider serve`: the Serve application on an embedded local Ray, in one command.

    outrider serve                                   # the small demo family, ngram drafting
    outrider serve --demo tiny --port 8000
    outrider serve --model /models/Llama-3.1-8B --tp 2 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'
    outrider serve --config serve.yaml               # OutriderArgs as YAML (flags override it)

It builds (or finds) the model, starts Ray and Serve, deploys `cluster.app:build_app`, prints
the URL once the application answers, and shuts everything down on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible API with speculative decoding on a local Ray",
        description="Start Ray Serve with the ingress, target and draft deployments. With no --model, "
        "the demo family is built (first use) or loaded from the cache.",
    )
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--demo", choices=("tiny", "small"), help="demo family to serve (default: small)")
    source.add_argument("--model", metavar="DIR", help="a Hugging Face model folder instead of the demo")
    serve.add_argument("--served-model-name", help="the model name clients send")
    serve.add_argument("--speculative-config", metavar="JSON", help="vLLM-style speculative config as JSON")
    serve.add_argument("--no-speculation", action="store_true", help="plain decoding (the baseline)")
    serve.add_argument("--tp", type=int, metavar="N", help="tensor-parallel ranks per target replica")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP host (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    serve.add_argument("--config", metavar="YAML", help="OutriderArgs as YAML (the Serve config's `args`)")
    serve.add_argument("--num-cpus", type=int, help="CPUs for the local Ray (default: all)")
    serve.set_defaults(func=_cmd_serve)
    return serve


def args_from_cli(ns: argparse.Namespace) -> dict:
    """The YAML (if any), then each flag given on top of it."""
    args: dict = {}
    if ns.config:
        import yaml

        with open(ns.config) as f:
            try:
                loaded = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"--config {ns.config} is not valid YAML ({e})") from None
        # Either OutriderArgs itself or a whole Serve config: take the first application's args.
        if "applications" in loaded:
            loaded = loaded["applications"][0].get("args", {})
        args.update(loaded)
    if ns.demo:
        args["demo"] = ns.demo
    if ns.model:
        args["model"] = ns.model
    if ns.served_model_name:
        args["served_model_name"] = ns.served_model_name
    if ns.speculative_config:
        try:
            args["speculative_config"] = json.loads(ns.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON ({e})") from None
    if ns.no_speculation:
        args["no_speculation"] = True
    if ns.tp:
        args["tensor_parallel_size"] = ns.tp
    return args


def _cmd_serve(ns: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from outrider.cluster.config import load_args

    try:
        config = load_args(args_from_cli(ns))
    except ValidationError as e:  # one line per wrong field, each naming it
        print(f"outrider serve: error: bad configuration:\n{e}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from outrider.cluster.app import build_app, set_ray_env
    from outrider.cluster.gpu_pools import classify, gpu_inventory

    pools = classify(gpu_inventory(), config.gpu_pools)
    set_ray_env()
    ray.init(num_cpus=ns.num_cpus, resources=pools.ray_resources(), include_dashboard=False)
    try:
        serve.start(http_options={"host": ns.host, "port": ns.port})
        start = time.monotonic()
        print("starting the Outrider application (building the demo family on first use) ...", flush=True)
        serve.run(build_app(config), name="outrider", route_prefix="/")
        url = f"http://{ns.host}:{ns.port}"
        print(
            f"Outrider is ready at {url} ({time.monotonic() - start:.0f} s); OpenAI base URL: {url}/v1",
            flush=True,
        )
        print(
            f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
            f"""-d '{{"model": "{_model_name(config)}", "prompt": "def fib(n):", "max_tokens": 32}}'""",
            flush=True,
        )
        print("Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("shutting down ...", flush=True)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def _model_name(config) -> str:
    from pathlib import Path

    if config.served_model_name:
        return config.served_model_name
    return Path(config.model).resolve().name if config.model else f"outrider-demo-{config.demo}"
