"""One request inside the engine: what was asked, what it holds, and when it stops.

A sequence's tokens, seen from the KV cache and the drafter:

    tokens:   p0 p1 ... p(P-1) o0 o1 ... o(k-1)      prompt, then output so far
              |-------- cached (num_cached) ------|root|   root = tokens[-1], K/V not yet cached
              |--- sent to the drafter (num_sent) ---|--- unsent delta ---|

Until its first output token a sequence is prefilling: prompt chunks are cached round by
round, and the chunk that reaches the last prompt token is a plain decode of it, which gives
the first output token (whatever the chunking, so a seeded request draws the same random
numbers in any batch). From then on it is decoding: every round verifies one tree rooted at
tokens[-1] and appends accepted + (recovered or bonus) tokens, so num_cached == len(tokens) - 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from outrider.proto import SamplingParams, TreeBudget, shared_budget
from outrider.target_worker.stop_strings import find_stop


class GrammarMatcherLike(Protocol):
    """What a sequence needs of its grammar matcher (xgrammar's GrammarMatcher has it)."""

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint, compiled by the engine's grammar backend (xgrammar)."""

    kind: str  # "json_schema", "json_object", "regex", "choice", "grammar" (EBNF)
    source: str  # the schema (JSON text), the regex, the choices as a JSON list, or the EBNF


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the target's processed distribution, and the top-N."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), likeliest first
    rank: int | None = None  # 1 + how many tokens are likelier (vLLM's Logprob.rank)


@dataclass(frozen=True)
class RequestParams:
    """Per-request generation settings (vLLM's SamplingParams, the subset the engine serves)."""

    max_tokens: int = 16  # output tokens at most, EOS excluded
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1 = disabled
    min_p: float = 0.0  # 0 = disabled
    seed: int | None = None  # a seeded request samples the same tokens whatever it is batched with
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized output; not part of `text`
    ignore_eos: bool = False  # the model's EOS ids do not stop it (`stop_token_ids` still do)
    stop_token_ids: tuple[int, ...] = ()  # these stop it too (not emitted, like EOS)
    min_tokens: int = 0  # EOS and stop_token_ids masked, stop strings unchecked, before this many outputs
    # Logit processors (target_worker.logits_processors), applied at every tree node with the
    # tokens on that node's path: vLLM's semantics, counted over the output (presence,
    # frequency) or prompt + output (repetition).
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: GrammarSpec | None = None  # structured output: every node masked to the grammar
    logprobs: int | None = None  # per output token: its logprob and the top-N (0 = the token's only)
    prompt_logprobs: int | None = None  # per prompt token after the first: the same (echo with logprobs)

    @property
    def processes_logits(self) -> bool:
        """Whether any path-dependent processor applies (the plain path skips them all)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.grammar is not None
        )

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens = {self.max_tokens} must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature = {self.temperature} must be finite and >= 0")
        if self.top_k < 0:
            problems.append(f"top_k = {self.top_k} must be >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p = {self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p = {self.min_p} must be in [0, 1]")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if self.min_tokens < 0:
            problems.append(f"min_tokens = {self.min_tokens} must be >= 0")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            problems.append(f"repetition_penalty = {self.repetition_penalty} must be > 0")
        if not all(math.isfinite(x) for x in (self.presence_penalty, self.frequency_penalty)):
            problems.append("presence_penalty and frequency_penalty must be finite")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            problems.append(f"logprobs = {self.logprobs} must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            problems.append(f"prompt_logprobs = {self.prompt_logprobs} must be in [0, {MAX_LOGPROBS}]")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def sampling(self) -> SamplingParams:
        """What the drafter is told, so its q goes through the same processing as p (the
        sequence adds its prompt length and stop ids: `Sequence.draft_sampling`)."""
        return SamplingParams(
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
        )


@dataclass
class RequestOutput:
    """One request's share of a round: the tokens it gained, and whether it is done."""

    request_id: int
    new_token_ids: list[int]  # output tokens committed this round, in order (may be empty)
    finished: bool = False
    finish_reason: str | None = None  # "length" (max_tokens), "stop" (EOS or a stop string), "abort"
    stop_reason: str | int | None = None  # the matched stop string, or the EOS token id
    text: str | None = None  # the whole output so far, when the engine has a detokenizer
    logprobs: list[TokenLogprob] | None = None  # one per new_token_ids entry, if the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. , with the first output only


@dataclass
class Sequence:
    seq_id: int
    params: RequestParams
    tokens: list[int]  # prompt + output; the last one is the root once decoding
    num_prompt: int
    generator: torch.Generator | None  # per-request stream for verification's random numbers
    # The request's SamplingParams with a seed derived apart from the verifier's; the drafter is
    # told `draft_sampling`, which adds what the sequence knows (prompt length, stop ids).
    draft_params: SamplingParams
    blocks: list[int] | None = None  # the KV block table (`BlockManager.tables`); None until admitted
    max_slots: int = 0  # the most KV slots it may ever use (max_model_len or the whole cache)
    num_cached: int = 0  # tokens whose K/V is in the cache
    num_sent: int = 0  # tokens the drafter has been given
    # Rows of tokens[num_sent:]: [*, width] tensors, or per-layer views (`drafter_features`).
    unsent_features: list[torch.Tensor | tuple[torch.Tensor, ...]] = field(default_factory=list)
    budget: TreeBudget | None = None  # sent with the last update; the tree for `tree_round` must fit it
    tree_round: int = -1  # the round the drafter was asked to answer; -1 = none asked
    asked: bool = False  # a tree is awaited for its next verify (the policy gave it depth > 0)
    lane: int = 0  # which half of the batch it is verified with (`Engine` lanes)
    text: str = ""  # detokenized output, kept only when stop strings need it
    stop_ids: frozenset[int] = frozenset()  # EOS ids (unless ignore_eos) and stop_token_ids
    grammar: GrammarMatcherLike | None = None  # structured output: the matcher at the committed tokens
    prompt_logprobs: list[TokenLogprob] | None = None  # gathered while prefilling, sent with the first output
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def decoding(self) -> bool:
        """Past the first output token: each round verifies a tree rooted at tokens[-1]."""
        return len(self.tokens) > self.num_prompt

    @property
    def prefilling(self) -> bool:
        """Its root's context is not all cached yet: a new prompt, or a sequence preempted
        (its blocks taken back) and being recomputed. Prompt chunks until it reaches its root."""
        return not self.decoding or self.num_cached < len(self.tokens) - 1

    @property
    def draft_sampling(self) -> SamplingParams:
        """What the drafter is told: `draft_params`, and when the drafter can process q as p is
        (penalties, logit_bias, min_tokens), where the output starts and the stop ids."""
        if not self.draft_params.processes_logits and not self.params.min_tokens:
            return self.draft_params
        stop_ids = tuple(sorted(self.stop_ids)) if self.params.min_tokens else ()
        return replace(self.draft_params, num_prompt=self.num_prompt, stop_ids=stop_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tree_budget(self, limit: TreeBudget) -> TreeBudget:
        """This round's budget: no more nodes than it may have slots, no deeper than useful."""
        rows_left = self.max_slots - self.num_cached  # the root and every node take a slot
        useful_depth = self.params.max_tokens - len(self.output_ids) - 1  # the last output is recovered/bonus
        depth = max(0, min(limit.max_depth, useful_depth))
        nodes = min(limit.max_nodes, rows_left) if depth else 1
        return shared_budget(nodes, depth, limit.top_k, limit.q_width)

    def append(self, new_tokens: list[int], detokenize: Callable[[list[int]], str] | None) -> list[int]:
        """Appends verified tokens up to the first stop; returns those to stream (a stop id is not).

        The grammar matcher, if any, follows every committed token, the stop id included."""
        emitted = []
        for token in new_tokens:
            if self.grammar is not None:
                self.grammar.accept_token(token)
            if token in self.stop_ids or (self.grammar is not None and self.grammar.is_terminated()):
                self.finish_reason, self.stop_reason = "stop", token
                break
            self.tokens.append(token)
            emitted.append(token)
            if self.params.stop and self._hit_stop_string(detokenize):
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        return emitted

    def _hit_stop_string(self, detokenize: Callable[[list[int]], str] | None) -> bool:
        if detokenize is None:
            raise ValueError("stop strings need an engine built with a detokenizer")
        # The earlier text held no stop string, so a match must end in the new characters.
        previous, self.text = self.text, detokenize(self.output_ids)
        if len(self.output_ids) < self.params.min_tokens:  # vLLM: no stop before min_tokens
            return False
        hit = find_stop(self.text, self.params.stop, checked=len(previous))
        if hit is None:
            return False
        at, stop = hit
        self.text = self.text[:at]
        self.finish_reason, self.stop_reason = "stop", stop
        return True
