"""`outrider draft-server`: run one proposer as a gRPC draft worker.

    outrider draft-server --method ngram --port 50051 --demo tiny
    outrider draft-server --method draft_model --port 50051 --model /models/draft \\
        --tls-cert server.pem --tls-key server.key --tls-client-ca ca.pem --token-file token

`outrider/cluster/cli.py` owns the command map; it calls `add_draft_server_parser(commands, ...)` and
passes a `resolve_demo` callback that turns `--demo SIZE` into the demo family's folders,
since draft_worker must not import cluster (docs/architecture.md, "Layout").

A user mistake (an unknown method or option, a missing folder, half a TLS pair) raises
`ValueError` or `FileNotFoundError` with a one-line message, which the `outrider` entry point
prints as `outrider: error: ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outrider.draft_worker.proposer import Proposer

# (SIZE, method) -> (the method's demo drafter folder, tokenizer folder)
DemoResolver = Callable[[str, str], tuple[Path, Path]]


def add_draft_server_parser(
    subparsers: argparse._SubParsersAction,
    resolve_demo: DemoResolver | None = None,
    demo_sizes: Sequence[str] = ("tiny", "small"),
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "draft-server",
        help="serve a drafting method over gRPC (a disaggregated draft worker)",
        description="Serve one proposer as outrider.v1.DraftService, with health checking and reflection. "
        "Targets connect with the gRPC draft client; SIGTERM drains in-flight rounds, then exits.",
    )
    parser.add_argument(
        "--method", required=True, help="registered proposer, e.g. ngram, suffix, draft_model"
    )
    parser.add_argument("--port", type=int, required=True, help="port to listen on (0 = any free port)")
    parser.add_argument("--host", default="[::]", help="address to bind (default: %(default)s)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--demo", choices=list(demo_sizes), help="use the demo family's draft and tokenizer")
    source.add_argument("--model", metavar="DIR", help="the drafter's checkpoint folder (HF layout)")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the model's own)")
    parser.add_argument("--num-speculative-tokens", type=int, help="K: draft tokens on the longest path")
    parser.add_argument(
        "--speculative-config", metavar="JSON", default="{}", help="further vLLM-style keys, as a JSON object"
    )
    parser.add_argument(
        "--max-sequences",
        type=positive_int,
        default=32,
        help="sequences it holds drafting state for at once, over all its targets (a model drafter's KV "
        "cache; past it a sequence is decoded without drafts until room frees); size it to the targets' "
        "max_num_seqs summed (default: %(default)s)",
    )
    parser.add_argument("--target-model-id", default="", help="refuse targets serving another model")
    parser.add_argument(
        "--max-batch", type=int, default=256, help="sequences per request (default: %(default)s)"
    )
    parser.add_argument(
        "--max-message-mb", type=int, default=64, help="gRPC message size limit (default: %(default)s)"
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="server certificate chain (enables TLS)")
    parser.add_argument("--tls-key", metavar="PEM", help="server private key")
    parser.add_argument(
        "--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA"
    )
    parser.add_argument("--token-file", metavar="FILE", help="require `authorization: Bearer <token>`")
    parser.add_argument(
        "--no-speculation-cache",
        action="store_true",
        help="do not pre-draft the next round while the target verifies (ngram and suffix only)",
    )
    parser.add_argument(
        "--speculation-outcomes",
        type=int,
        default=4,
        help="verify outcomes pre-drafted per sequence and round (default: %(default)s)",
    )
    parser.add_argument(
        "--grace-s", type=float, default=10.0, help="drain time on shutdown (default: %(default)s)"
    )
    parser.set_defaults(func=lambda args: run_draft_server(args, resolve_demo))
    return parser


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_draft_server(args: argparse.Namespace, resolve_demo: DemoResolver | None = None) -> int:
    from outrider.draft_worker.proposer import proposer_class
    from outrider.draft_worker.server import DraftIdentity, ServerTls, serve
    from outrider.draft_worker.speculation import SpecCacheConfig
    from outrider.proto.gc_heap import freeze_gc_heap

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proposer_class(args.method)  # an unknown method is refused before any folder is looked up or built
    model_dir, tokenizer_dir, model_id = _model_folders(args, resolve_demo)
    config = _speculative_options(args.speculative_config)
    if args.num_speculative_tokens is not None:
        config["num_speculative_tokens"] = args.num_speculative_tokens
    proposer = build_server_proposer(args.method, config, model_dir, tokenizer_dir, args.max_sequences)
    from outrider.target_worker.draft_client import tokenizer_fingerprint

    identity = DraftIdentity(
        draft_model_id=model_id,
        vocab_size=proposer.vocab_size,
        vocab_fingerprint=tokenizer_fingerprint(tokenizer_dir),
        target_model_id=args.target_model_id,
    )
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        client_ca = Path(args.tls_client_ca).read_bytes() if args.tls_client_ca else None
        tls = ServerTls(Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes(), client_ca)
    elif args.tls_client_ca:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    server = serve(
        proposer,
        identity,
        address=f"{args.host}:{args.port}",
        tls=tls,
        token=token,
        max_message_bytes=args.max_message_mb << 20,
        max_batch=args.max_batch,
        speculation_cache=None if args.no_speculation_cache else SpecCacheConfig(args.speculation_outcomes),
    )
    print(f"draft server: {args.method} ({model_id}) on port {server.port}", flush=True)
    freeze_gc_heap("draft server")  # start-up done: full collections skip all it made
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.stop(args.grace_s)
    return 0


def build_server_proposer(
    method: str, options: dict[str, Any], model_dir: Path | None, tokenizer_dir: Path, max_sequences: int = 32
) -> Proposer:
    """The proposer for `method` with vLLM-style `options`; `model` goes only to methods taking one.

    K (`num_speculative_tokens`) defaults to the method's own default, else to
    `proto.DEFAULT_NUM_SPECULATIVE_TOKENS`, the serving config's default too.
    """
    from outrider.draft_worker.proposer import build_proposer, proposer_class
    from outrider.proto import DEFAULT_NUM_SPECULATIVE_TOKENS

    cls = proposer_class(method)
    config = {"method": method, **options}
    if cls.default_num_speculative_tokens is None:
        config.setdefault("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
    takes_model = "model" in {f.name for f in dataclasses.fields(cls.Options)}
    if model_dir is not None and takes_model:  # model-free methods (ngram, suffix) refuse the key
        config.setdefault("model", str(model_dir))
    return build_proposer(
        config, vocab_size=_vocab_size(model_dir, tokenizer_dir), max_sequences=max_sequences
    )


def _speculative_options(text: str) -> dict[str, Any]:
    """`--speculative-config`: a JSON object of vLLM-style keys."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--speculative-config is not valid JSON ({error})") from None
    if not isinstance(options, dict):
        raise ValueError(f"--speculative-config must be a JSON object, not {text!r}")
    return options


def _model_folders(
    args: argparse.Namespace, resolve_demo: DemoResolver | None
) -> tuple[Path | None, Path, str]:
    """(draft checkpoint or None, tokenizer folder, the id the handshake reports)."""
    if args.demo:
        if resolve_demo is None:
            raise ValueError("--demo is not available here: this entry point has no demo resolver")
        draft_dir, tokenizer_dir = resolve_demo(args.demo, args.method)
        return draft_dir, Path(args.tokenizer or tokenizer_dir), f"demo-{args.demo}-{args.method}"
    model_dir = Path(args.model) if args.model else None
    if model_dir is not None and not model_dir.is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such folder")
    tokenizer_dir = args.tokenizer or model_dir
    if tokenizer_dir is None:
        raise ValueError("give --tokenizer (or --model / --demo): the handshake needs the vocabulary")
    model_id = f"{model_dir.name}-{args.method}" if model_dir else args.method
    return model_dir, Path(tokenizer_dir), model_id


def _vocab_size(model_dir: Path | None, tokenizer_dir: Path) -> int:
    """The model's logits width when there is a model (it may pad the tokenizer), else the tokenizer's."""
    if model_dir is not None and (model_dir / "config.json").exists():
        return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    from tokenizers import Tokenizer

    tokenizer_file = tokenizer_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"{tokenizer_file}: no such file (give --tokenizer DIR, a folder holding one)"
        )
    return Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
