"""`outrider`: the one command-line entry point.

Each subcommand is a function taking the parsed arguments; `build_parser` is the whole map.
Heavy imports (torch, transformers) happen inside the subcommands so `outrider --help` is fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from outrider.cluster.serve_cli import add_serve_parser
from outrider.demo.recipe import DEFAULT_SIZE, RECIPES

# The repository's top-level folders, installed as `outrider.<name>` (pyproject.toml).
PACKAGES = ("proto", "kernels", "target_worker", "draft_worker", "demo", "cluster", "benchmarks")


def _cmd_demo_build(args: argparse.Namespace) -> int:
    from outrider.demo.family import ensure_demo_family, export_family

    family = ensure_demo_family(args.size, seed=args.seed, force=args.force, progress=not args.quiet)
    m = family.manifest
    print(f"demo family {family.size!r} ready at {family.root}")
    print(
        f"  target: {m['target']['parameters']:,} parameters, held-out loss {m['target']['held_out_loss']:.3f} nats/token"
    )
    print(
        f"  draft:  {m['draft']['parameters']:,} parameters, held-out loss {m['draft']['held_out_loss']:.3f}, "
        f"greedy agreement {m['draft']['greedy_agreement_with_target']:.3f}"
    )
    if not args.no_heads:
        from outrider.draft_worker.training.demo_heads import ensure_demo_heads

        for method, folder in ensure_demo_heads(family, progress=not args.quiet).items():
            print(f"  {method} head: {folder}")
    if args.out:
        print(f"copied to {export_family(family, Path(args.out))}")
    return 0


def _cmd_demo_info(args: argparse.Namespace) -> int:
    from outrider.demo.family import CorruptCacheError, family_dir, recipe_for, verify_family

    recipe = recipe_for(args.size, args.seed)
    root = family_dir(recipe)
    try:
        family = verify_family(root, recipe)
    except CorruptCacheError as e:
        print(f"the {args.size!r} demo family is not built (or not usable): {e}", file=sys.stderr)
        print(f"build it with: outrider demo build --size {args.size}", file=sys.stderr)
        return 1
    manifest = {k: v for k, v in family.manifest.items() if k != "files"}
    print(json.dumps({"path": str(family.root), **manifest}, indent=2))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model:
        model_dir = Path(args.model)
    else:
        from outrider.demo.family import ensure_demo_family

        model_dir = ensure_demo_family(args.demo).target_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    torch.manual_seed(args.seed)
    sampling = (
        {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    )
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, **sampling)
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


def _cmd_check_install(args: argparse.Namespace) -> int:
    """Versions of Outrider and what it runs on, and where each of its packages is imported from."""
    import importlib
    import importlib.metadata

    for dist in ("outrider", "torch", "transformers", "ray", "grpcio", "protobuf", "tokenizers"):
        try:
            print(f"{dist:13} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"outrider: error: {dist} is not installed", file=sys.stderr)
            return 1
    for name in PACKAGES:
        module = importlib.import_module(f"outrider.{name}")
        print(f"outrider.{name:14} {Path(module.__file__).parent}")
    return 0


def _demo_draft_dirs(size: str, method: str = "draft_model") -> tuple[Path, Path]:
    """For `outrider draft-server --demo SIZE`: the method's demo drafter and the tokenizer folder.

    draft_model drafts with the family's draft LM; a method with a trainer (eagle3, peagle,
    ...) with its trained head (built and cached on first use); others need no model.
    """
    from outrider.demo.family import ensure_demo_family

    family = ensure_demo_family(size)
    if method != "draft_model":
        from outrider.draft_worker.training.demo_heads import demo_head_dir, head_methods

        if method in head_methods():
            return demo_head_dir(family, method), family.tokenizer_dir
    return family.draft_dir, family.tokenizer_dir


def _cmd_train_draft(args: argparse.Namespace) -> int:
    from outrider.draft_worker.training import TrainArgs, train_draft

    options = json.loads(args.options)
    metrics = train_draft(
        TrainArgs(
            method=args.method,
            target_dir=args.target,
            out_dir=args.out,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            resume=args.resume,
            device=args.device,
            num_sequences=args.num_sequences,
            method_options=options,
            progress=not args.quiet,
        )
    )
    summary = {k: v for k, v in metrics.items() if k != "losses"}
    print(json.dumps({"out": args.out, **summary}, indent=2, default=str))
    return 0


def _add_train_draft_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train-draft",
        help="train a draft head (eagle3, peagle, medusa, mtp, draft_model) against a target",
        description="Self-distillation: the target's own continuations of training-corpus prompts, with "
        "the features its runner captures, train the head; the checkpoint goes to --out in the method's "
        "published key layout plus config.json. Data is cached under $OUTRIDER_HOME/distill; a progress "
        "bar shows loss and ETA; --resume continues from the state saved in --out.",
    )
    train.add_argument("--method", required=True, help="eagle3, peagle, medusa, mtp or draft_model")
    train.add_argument(
        "--target", required=True, metavar="DIR", help="the target checkpoint folder (HF layout)"
    )
    train.add_argument("--out", required=True, metavar="DIR", help="where the head checkpoint is written")
    train.add_argument("--steps", type=int, default=600, help="optimizer steps (default: %(default)s)")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: %(default)s)")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    train.add_argument("--seed", type=int, default=0, help="data and init seed (default: %(default)s)")
    train.add_argument(
        "--num-sequences",
        type=int,
        default=256,
        help="target continuations to train on (default: %(default)s)",
    )
    train.add_argument("--resume", action="store_true", help="continue from the training state in --out")
    train.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    train.add_argument(
        "--options",
        default="{}",
        metavar="JSON",
        help='the method\'s own knobs as a JSON object, e.g. \'{"ttt_steps": 7, "draft_vocab_size": 32000}\'',
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=_cmd_train_draft)


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """`outrider bench`: its options and its run live in `outrider.benchmarks`, imported only here."""
    from outrider.benchmarks.bench import add_bench_arguments, cli_main

    bench = commands.add_parser(
        "bench",
        help="benchmark every drafting method against plain decoding and transformers (JSON, Markdown, PNG)",
        description="Plain decoding, every registered drafting method (chain and tree shapes) and the "
        "transformers peers (generate() plain, assisted generation with the same draft LM, prompt lookup) "
        "on held-out prompts (mid-file code, file starts) at T=0 and T=1, interleaved per prompt in a "
        "shuffled order and repeated, so speedups are ratios within one run; then a tree-size sweep and "
        "the Ray Serve app over HTTP at several concurrencies (speculation off, co-located, disaggregated). "
        "Writes a JSON report (schema: --schema, benchmarks/README.md), a Markdown report and PNG plots "
        "beside it. --quick: the tiny family, every path, under 3 minutes; the default full run on the "
        "small family took 20-36 minutes on the 2-core machines measured.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=cli_main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outrider",
        description="Outrider: speculative decoding with disaggregated draft and target workers.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="build or inspect the demo model family (trained here from the Python stdlib, no download)",
        description="The demo family: a byte-level BPE tokenizer, a Llama-architecture target and a "
        "small draft LM, trained on this interpreter's standard library source and cached under "
        "$OUTRIDER_HOME (default ~/.cache/outrider).",
    )
    demo_commands = demo.add_subparsers(dest="demo_command", metavar="ACTION", required=True)
    sizes = sorted(RECIPES)

    build = demo_commands.add_parser(
        "build",
        help="train (or fetch from cache) the demo family",
        description="Train the demo family, or return at once when a verified copy is cached. "
        "`tiny` takes about 3 minutes on 2 CPU cores (5 with its heads); `small` about 35 minutes on a free 2-core CPU (50 measured with the CPU shared; its four heads 16 more).",
    )
    build.add_argument(
        "--size", choices=sizes, default=DEFAULT_SIZE, help="which recipe (default: %(default)s)"
    )
    build.add_argument(
        "--out", metavar="DIR", help="also copy the finished family to DIR (must be empty or absent)"
    )
    build.add_argument(
        "--seed", type=int, default=0, help="training seed; same seed, same weights (default: 0)"
    )
    build.add_argument("--force", action="store_true", help="rebuild even when a verified copy is cached")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    build.add_argument(
        "--no-heads", action="store_true", help="skip the trained draft heads (eagle3, peagle, ...)"
    )
    build.set_defaults(func=_cmd_demo_build)

    info = demo_commands.add_parser(
        "info",
        help="print a cached family's path and manifest",
        description="Print the manifest of a built family.",
    )
    info.add_argument(
        "--size", choices=sizes, default=DEFAULT_SIZE, help="which recipe (default: %(default)s)"
    )
    info.add_argument("--seed", type=int, default=0, help="training seed (default: 0)")
    info.set_defaults(func=_cmd_demo_info)

    generate = commands.add_parser(
        "generate",
        help="generate from one prompt, without speculation (a smoke test of a model folder)",
        description="Plain generation from one prompt with the `transformers` reference implementation. "
        "Speculative serving is `outrider serve`.",
    )
    source = generate.add_mutually_exclusive_group()
    source.add_argument(
        "--demo", choices=sizes, default=DEFAULT_SIZE, help="use the demo target (default: %(default)s)"
    )
    source.add_argument(
        "--model", metavar="DIR", help="a Hugging Face model folder instead of the demo target"
    )
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)"
    )
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    generate.set_defaults(func=_cmd_generate)

    from outrider.draft_worker.server_cli import add_draft_server_parser

    add_draft_server_parser(commands, resolve_demo=_demo_draft_dirs, demo_sizes=sizes)
    _add_train_draft_parser(commands)

    check = commands.add_parser(
        "check-install",
        help="list the versions Outrider runs on and where each outrider package is imported from",
        description="Prints the versions of Outrider and its main dependencies, then the folder each "
        "outrider.<package> is imported from; fails when a dependency is not installed.",
    )
    check.set_defaults(func=_cmd_check_install)
    add_serve_parser(commands)
    _add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand. A user mistake that a subcommand reports as `ValueError` or a missing
    file (bad option values, unknown methods, absent folders) is one line on stderr and exit
    status 2, as argparse reports its own; `OUTRIDER_DEBUG=1` shows the traceback instead."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError) as error:
        if os.environ.get("OUTRIDER_DEBUG"):
            raise
        message = str(error).strip() or type(error).__name__
        print(f"outrider {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
