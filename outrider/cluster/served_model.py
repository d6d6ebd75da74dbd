"""What is being served, resolved once in `build_app` and handed to every deployment.

`OutriderArgs` says "the small demo" or "this folder"; `ServedModel` is the answer: the
folders, the name clients use, the context length and the EOS ids. Resolving it in the driver
means the demo family is built (or found) once, before any replica starts, and every
replica agrees on the same paths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from outrider.cluster.config import OutriderArgs


@dataclass(frozen=True)
class ServedModel:
    name: str  # the `model` field clients send
    target_dir: str
    tokenizer_dir: str
    draft_dir: str | None  # the demo family's draft LM, for model-based drafting
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # every one stops generation (config.json and generation_config.json)
    head_dir: str | None = None  # the demo family's trained head for the configured method


def resolve_model(args: OutriderArgs, progress: bool = False) -> ServedModel:
    head = None
    if args.model:
        target, draft = Path(args.model), None
        tokenizer = Path(args.tokenizer or args.model)
        default_name = target.resolve().name
    else:
        from outrider.demo.family import ensure_demo_family

        family = ensure_demo_family(args.demo, progress=progress)
        target, draft = family.target_dir, family.draft_dir
        head = _demo_head(family, args, progress)
        tokenizer = Path(args.tokenizer) if args.tokenizer else family.tokenizer_dir
        default_name = f"outrider-demo-{args.demo}"
    config = json.loads((target / "config.json").read_text())
    context = int(config.get("max_position_embeddings", 2048))
    max_len = min(args.engine.max_model_len or context, context)
    return ServedModel(
        name=args.served_model_name or default_name,
        target_dir=str(target),
        tokenizer_dir=str(tokenizer),
        draft_dir=str(draft) if draft else None,
        max_model_len=max_len,
        vocab_size=int(config["vocab_size"]),
        eos_token_ids=eos_token_ids(config, target, tokenizer),
        head_dir=str(head) if head else None,
    )


def _demo_head(family, args: OutriderArgs, progress: bool) -> Path | None:
    """The demo head of the speculative method (trained and cached on first use), if it has one."""
    spec = args.speculative
    if spec is None or "model" in spec:
        return None
    from outrider.draft_worker.training.demo_heads import demo_head_dir, head_methods

    return (
        demo_head_dir(family, spec["method"], progress=progress) if spec["method"] in head_methods() else None
    )


def eos_token_ids(config: dict, target_dir: Path, tokenizer_dir: Path) -> tuple[int, ...]:
    """Every EOS id the model declares: config.json's and generation_config.json's (the target's,
    else the tokenizer folder's), each an int or a list. Llama-3-Instruct lists two there and
    ends a chat turn with the second (<|eot_id|>), so any of them stops a sequence."""
    declared = [config.get("eos_token_id")]
    for folder in (target_dir, tokenizer_dir):
        generation = folder / "generation_config.json"
        if generation.is_file():
            declared.append(json.loads(generation.read_text()).get("eos_token_id"))
            break
    ids: list[int] = []
    for eos in declared:
        for token in eos if isinstance(eos, list) else [eos]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)
