"""Peers for `outrider bench`: Hugging Face `transformers` `generate()` on the same models and prompts.

Three configurations every user of `transformers` can reproduce, run inside the same
interleaved sweep as Outrider's methods (same process, same torch threads, same prompts):

    hf-plain          generate(), greedy or sampled
    hf-assisted       generate(assistant_model=<draft LM>), its assisted generation at its
                      defaults (transformers' num_assistant_tokens / confidence cut-off)
    hf-assisted-k4    the same, tuned like Outrider's draft_model-chain: 4 draft tokens per
                      round, no confidence cut-off (set on the assistant's generation_config,
                      which is where transformers reads them)
    hf-prompt-lookup  generate(prompt_lookup_num_tokens=K), its n-gram prompt lookup

EOS is ignored as in Outrider's runs (`min_new_tokens = max_new_tokens`). At T = 1 sampling
is pure (top_k 0, top_p 1), seeded per prompt with `torch.manual_seed`. Deterministic counts
come from forward hooks: target forwards per output token, and the assistant's forward time
(the drafter time share; prompt lookup's drafting is not a module call and is not timed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPT_LOOKUP_TOKENS = 4
# hf-assisted-k4: the assistant's generation_config during the call (0 = no confidence cut-off).
ASSISTED_K4 = {
    "num_assistant_tokens": 4,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.0,
}


@dataclass
class PeerRun:
    """One `generate()` call: what `bench` turns into a `bench_drafting.Run`."""

    tokens: list[int]
    seconds: float
    target_forwards: int
    draft_s: float


class _ForwardCounter:
    """Counts a module's forward calls and the wall time spent inside them."""

    def __init__(self, module: torch.nn.Module):
        self.calls, self.seconds, self._started = 0, 0.0, 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, module, args) -> None:
        self.calls += 1
        self._started = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._started

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


class HFPeers:
    """The target (and the draft LM, when there is one) loaded with `transformers`."""

    def __init__(self, target_dir: Path, draft_dir: Path | None, pad_token_id: int | None):
        import transformers

        def load(folder: Path):
            return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

        self.target = load(target_dir)
        self.draft = load(draft_dir) if draft_dir else None
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0
        self.target_calls = _ForwardCounter(self.target)
        self.draft_calls = _ForwardCounter(self.draft) if self.draft is not None else None

    def names(self) -> list[str]:
        assisted = ["hf-assisted", "hf-assisted-k4"] if self.draft is not None else []
        return ["hf-plain", *assisted, "hf-prompt-lookup"]

    def config(self, name: str) -> dict:
        """What each peer passes to `generate()` besides the sampling settings (for the report)."""
        if name == "hf-assisted":
            cfg, defaults = (
                self.draft.generation_config,
                self.draft.generation_config._get_default_generation_params(),
            )
            keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
            # None in the model's own config means transformers' global default applies.
            return {"assistant_model": "<draft LM>"} | {
                k: getattr(cfg, k) if getattr(cfg, k) is not None else defaults.get(k) for k in keys
            }
        if name == "hf-assisted-k4":
            return {"assistant_model": "<draft LM>", **ASSISTED_K4}
        if name == "hf-prompt-lookup":
            return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
        return {}

    @torch.inference_mode()
    def generate(
        self, name: str, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> PeerRun:
        extra: dict = {}
        if name in ("hf-assisted", "hf-assisted-k4"):
            extra["assistant_model"] = self.draft
        elif name == "hf-prompt-lookup":
            extra["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        if temperature > 0:
            extra.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            extra.update(do_sample=False)
        ids = torch.tensor([prompt])
        self.target_calls.reset()
        if self.draft_calls is not None:
            self.draft_calls.reset()
        saved = {}
        if name == "hf-assisted-k4":
            saved = {k: getattr(self.draft.generation_config, k) for k in ASSISTED_K4}
            for key, value in ASSISTED_K4.items():
                setattr(self.draft.generation_config, key, value)
        try:
            started = time.perf_counter()
            out = self.target.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=self.pad_token_id,
                **extra,
            )
            seconds = time.perf_counter() - started
        finally:
            for key, value in saved.items():
                setattr(self.draft.generation_config, key, value)
        return PeerRun(
            tokens=out[0, len(prompt) :].tolist(),
            seconds=seconds,
            target_forwards=self.target_calls.calls,
            draft_s=self.draft_calls.seconds if "assisted" in name else 0.0,
        )
