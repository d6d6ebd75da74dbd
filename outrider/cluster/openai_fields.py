"""OpenAI and vLLM request fields beyond the sampling models: which are refused, structured output, logprobs.

No field is silently ignored. Every field `openai_api` does not model is looked up here:

- fields that do not change the output (`user`, `metadata`, ...) are accepted with any value;
- fields this server does not implement are accepted only with their default value (or
  null), so clients that always send them keep working, and refused with a 400 naming the
  field otherwise (`DEFAULT_ONLY`);
- any other field is refused with a 400 naming it (a typo must not silently do nothing).

Structured output arrives as OpenAI's `response_format`, vLLM's `structured_outputs`, or
vLLM's older `guided_*` fields; each becomes one `GrammarSpec` for the engine (xgrammar).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from outrider.target_worker.sequence import GrammarSpec, TokenLogprob

# Accepted with any value: they label or route a request, never change what it generates.
NO_EFFECT = frozenset(
    {
        "user",
        "metadata",
        "request_id",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "cache_salt",
        "parallel_tool_calls",  # only means something with tools, which are refused
    }
)

# Not implemented: accepted only as null or as this default value.
DEFAULT_ONLY: dict[str, Any] = {
    "best_of": 1,
    "echo": False,  # chat (vLLM): completions implement echo
    "suffix": "",
    "audio": None,
    "modalities": ["text"],
    "prediction": None,
    "reasoning_effort": None,
    "verbosity": None,
    "web_search_options": None,
    "functions": None,
    "function_call": "none",
    "store": False,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": None,
    "chat_template_kwargs": None,
    "documents": None,
    "mm_processor_kwargs": None,
    "truncate_prompt_tokens": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "logits_processors": None,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "add_special_tokens": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "priority": 0,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
}


def check_extra_fields(extra: dict[str, Any]) -> None:
    """ValueError naming the first field that is unknown, or not at its default, in `extra`."""
    for name, value in extra.items():
        if name in NO_EFFECT or value is None:
            continue
        if name not in DEFAULT_ONLY:
            raise ValueError(f"{name}: unknown field; this server does not implement it (see the API docs)")
        if value != DEFAULT_ONLY[name]:
            raise ValueError(
                f"{name}: this server does not implement it; send null or {json.dumps(DEFAULT_ONLY[name])}"
            )


def grammar_from_fields(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> GrammarSpec | None:
    """The one structured-output constraint a request asks for, or None. ValueError (naming the
    field) for a malformed one or for two at once."""
    specs: list[tuple[str, GrammarSpec]] = []
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            specs.append(("response_format", GrammarSpec("json_object", "")))
        elif kind == "json_schema":
            wrapper = response_format.get("json_schema")
            schema = wrapper.get("schema", wrapper.get("json_schema")) if isinstance(wrapper, dict) else None
            if not isinstance(schema, dict):
                raise ValueError(
                    "response_format: json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"
                )
            specs.append(("response_format", _json_schema(schema)))
        elif kind != "text":
            raise ValueError("response_format: type must be 'text', 'json_object' or 'json_schema'")
    for field, options in (("structured_outputs", structured_outputs), ("guided", guided)):
        if not options:
            continue
        asked = {k: v for k, v in options.items() if v is not None and v is not False}
        for key, value in asked.items():
            name = f"guided_{key}" if field == "guided" else f"structured_outputs.{key}"
            specs.append((name, _vllm_spec(name, key, value)))
    if len(specs) > 1:
        first, second = specs[0][0], specs[1][0]
        raise ValueError(
            f"{second.split('.')[0]}: one structured output constraint per request ({first}, {second})"
        )
    if not specs:
        return None
    name, spec = specs[0]
    from outrider.target_worker.grammar import check_grammar

    try:
        check_grammar(spec)
    except ValueError as e:
        raise ValueError(f"{name.split('.')[0]}: the {spec.kind} does not compile: {e}") from e
    return spec


def _vllm_spec(name: str, key: str, value: Any) -> GrammarSpec:
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name.split('.')[0]}: json is not a JSON schema: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"{name.split('.')[0]}: json must be a JSON schema (an object)")
        return _json_schema(value)
    if key == "json_object" and value is True:
        return GrammarSpec("json_object", "")
    if key == "regex" and isinstance(value, str):
        return GrammarSpec("regex", value)
    if key == "choice" and isinstance(value, list) and value and all(isinstance(c, str) and c for c in value):
        return GrammarSpec("choice", json.dumps(value))
    if key == "grammar" and isinstance(value, str):
        return GrammarSpec("grammar", value)
    raise ValueError(
        f"{name.split('.')[0]}: {key} is not supported here, or has the wrong type "
        "(json: a schema, regex: a string, choice: non-empty strings, grammar: EBNF, json_object: true)"
    )


def _json_schema(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))  # key order kept: properties come out in it


# ------------------------------------------------------------------------------ logprobs out


def completion_logprobs(
    entries: list[TokenLogprob], decode, offset: int, first_token: int | None = None
) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, top_logprobs as {token text: logprob}.
    `first_token`: echo's first prompt token, which has no logprob (null, as OpenAI's)."""
    tokens = ([] if first_token is None else [decode(first_token)]) + [decode(e.token_id) for e in entries]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    head: list[Any] = [] if first_token is None else [None]
    return {
        "tokens": tokens,
        "token_logprobs": head + [e.logprob for e in entries],
        "top_logprobs": head + [{decode(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], decode) -> dict[str, Any]:
    """The chat shape: `content`, one object per token with its bytes and top_logprobs."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ],
        "refusal": None,
    }


def vllm_prompt_logprobs(entries: list[TokenLogprob], decode, top: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` (of a completions choice, or a chat response): None for the first
    prompt token (nothing predicts it), then per token {token id: {logprob, rank, decoded_token}}
    for the token itself and the `top` likeliest (`entries` may hold a wider top: echo's)."""

    def item(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": decode(token_id)}

    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        scores = {str(t): item(lp, r, t) for r, (t, lp) in enumerate(e.top[:top], start=1)}
        scores.setdefault(str(e.token_id), item(e.logprob, e.rank, e.token_id))
        out.append(scores)
    return out


def echoed(prompt: tuple[TokenLogprob, ...], top: int | None) -> tuple[TokenLogprob, ...]:
    """The prompt entries a completions echo shows: none without `logprobs`, else each one's top
    cut to `top` (the engine gathers the wider of echo's and prompt_logprobs' at once)."""
    return () if top is None else tuple(replace(e, top=e.top[:top]) for e in prompt)
