"""Held-out prompt sets for benchmarks, drawn from the demo corpus's held-out files only.

- `start`: the first `prompt_tokens` tokens of a file (licence headers, module docstrings,
  imports). Easy to predict, so acceptance runs high.
- `mid`: `prompt_tokens` tokens of code starting at a line boundary at a deterministic spot
  in the middle half of a file. The primary set: small models fall into repetition loops
  from file starts, and loops inflate acceptance (docs/algorithms.md section 9).

Both are deterministic given (tokenizer, count, prompt_tokens, seed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from outrider.demo.corpus import load_corpus

PROMPT_SETS = ("start", "mid")


@dataclass(frozen=True)
class Prompt:
    source: str  # held-out file path relative to the stdlib root
    token_ids: list[int]

    def text(self, tokenizer) -> str:
        return tokenizer.decode(self.token_ids)


def load_prompts(
    name: str, tokenizer, *, count: int = 16, prompt_tokens: int = 128, seed: int = 0
) -> list[Prompt]:
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {PROMPT_SETS}")
    _, held_out = load_corpus()
    rng = random.Random(f"{name}-{seed}")
    files = list(held_out)
    rng.shuffle(files)
    prompts: list[Prompt] = []
    for f in files:
        text = f.text
        if name == "mid":
            lines = text.splitlines(keepends=True)
            if len(lines) < 40:
                continue
            first = rng.randrange(len(lines) // 4, len(lines) // 2)
            text = "".join(lines[first:])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # Need room for the prompt and a continuation from the same file.
        if len(ids) < prompt_tokens * 2:
            continue
        prompts.append(Prompt(source=f.path, token_ids=ids[:prompt_tokens]))
        if len(prompts) == count:
            return prompts
    raise ValueError(
        f"only {len(prompts)} held-out files are long enough for {count} prompts of {prompt_tokens} tokens"
    )


def mid_prompt_ids(tokenizer_dir, count: int, prompt_tokens: int) -> list[list[int]]:
    """Token ids of `count` held-out `mid` prompts for the tokenizer in `tokenizer_dir`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [p.token_ids for p in load_prompts("mid", tokenizer, count=count, prompt_tokens=prompt_tokens)]
