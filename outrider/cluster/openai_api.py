"""OpenAI's wire format: request models with their ranges, response builders, the error shape.

Ranges follow OpenAI's API reference (temperature in [0, 2], top_p in (0, 1], n >= 1,
penalties in [-2, 2], logit_bias in [-100, 100], top_logprobs <= 20) and vLLM's extensions
(top_k with 0 or -1 = off, min_p, repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, structured_outputs). Fields the server does not implement are refused unless null
or default (`openai_fields`). A request outside them is a 400 whose `param` names the field,
like OpenAI's own:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from outrider.cluster.openai_fields import check_extra_fields, grammar_from_fields
from outrider.target_worker.sequence import MAX_LOGPROBS, GrammarSpec, RequestParams

MAX_N = 16  # choices per request: each is a sequence in the batch, so bound the fan-out


class StreamOptions(BaseModel):
    """`stream_options`: OpenAI's `include_usage` (a last chunk with the usage) and vLLM's
    `continuous_usage_stats` (with `include_usage`, as vLLM: the usage so far in every chunk);
    any other option is refused."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Fields not modelled here are checked by `openai_fields.check_extra_fields`: accepted
    # only where they cannot change the output (no effect, or null / their default).
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extensions
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: [None, {id: {logprob, rank, decoded_token}}, ...] per completions choice, or at the
    # top of a chat response; raw logits, as vLLM's. Not with stream (vLLM refuses it too).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _checked(self) -> SamplingFields:
        check_extra_fields(self.model_extra or {})
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true (as vLLM)")
        for token, bias in (self.logit_bias or {}).items():
            if not token.lstrip("-").isdigit() or int(token) < 0:
                raise ValueError(f"logit_bias: keys must be token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100]")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise ValueError("stop_token_ids: token ids must be >= 0")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens: must be <= max_tokens")
        return self

    def grammar(self) -> GrammarSpec | None:
        """The structured-output constraint (ValueError naming the field if malformed)."""
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice}
        guided["grammar"] = self.guided_grammar
        return grammar_from_fields(self.response_format, self.structured_outputs, guided)

    def token_ids_used(self) -> list[tuple[str, int]]:
        """(field, token id) of every id the request names, for the ingress's vocabulary check."""
        used = [("logit_bias", int(t)) for t in self.logit_bias or {}]
        return used + [("stop_token_ids", t) for t in self.stop_token_ids or ()]

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token (0 = the token's own only), or None for no logprobs."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs the engine gathers per prompt token, or None for none."""
        return self.prompt_logprobs

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_in_every_chunk(self) -> bool:
        """vLLM's `continuous_usage_stats` (with `include_usage`): each chunk carries the usage so far."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def request_params(
        self, max_tokens: int, index: int, grammar: GrammarSpec | None = None
    ) -> RequestParams:
        """The engine's settings for choice `index`, with `max_tokens` already fitted to the context.

        Stop strings are not among them: the ingress matches them on the text it streams
        (`cluster.text.Detokenizer`) and cancels the choice, so the engine needs no tokenizer.
        """
        return RequestParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),  # -1 (vLLM's "off") is the engine's 0
            top_p=self.top_p,
            min_p=self.min_p or 0.0,
            # n choices with one seed must differ, and stay reproducible.
            seed=None if self.seed is None else self.seed + index,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=min(self.min_tokens, max_tokens),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=tuple((int(t), float(b)) for t, b in (self.logit_bias or {}).items()),
            grammar=grammar,
            logprobs=self.num_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top logprobs per token (OpenAI: <= 5)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Echo with logprobs and vLLM's prompt_logprobs share one gathering: the wider top."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(wanted) if wanted else None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        # A list of strings is a batch of prompts in OpenAI's API; one prompt per request here.
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request (send a batch as separate requests)")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("prompt is empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; content parts of type `text` are joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part of type {part.get('type')!r} is not supported; only 'text'")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's name for OpenAI's newer field; either sets the output budget.
    max_completion_tokens: int | None = Field(None, ge=1)
    # Tool calls are not implemented: refused, never silently ignored.
    tools: list[Any] | None = None
    tool_choice: Any = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.tools and self.tool_choice != "none":
            raise ValueError("tools: tool calling is not supported by this server (send tool_choice 'none')")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def output_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ApiError(Exception):
    """An error that becomes OpenAI's JSON error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or _KINDS.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped: a message quoting what the client sent can never fail to encode.
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json")


_KINDS = {
    400: "invalid_request_error",
    413: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """FastAPI's RequestValidationError list -> one 400 naming the first bad field."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    field, sep, rest = message.partition(": ")
    if not loc and sep and field.isidentifier():  # a model-level check that names its field
        return ApiError(400, message, param=field)
    param = ".".join(loc) or None
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The parsed JSON body, reading at most `max_bytes` of it: 413 past that, 400 if not JSON.

    A declared Content-Length over the limit is refused before any byte is read; a chunked
    body is counted as it arrives, so a refused body costs at most `max_bytes` of reading.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError as e:
        raise ApiError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from e


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413, f"request body is larger than this server's limit of {max_bytes} bytes", code="request_too_large"
    )


def check_unicode(body: Any) -> None:
    """400 naming the field if any string in the JSON body (keys too) is not valid Unicode.

    JSON may escape lone UTF-16 surrogates (`"\\udcff"`), which no tokenizer can encode and
    no response can echo. Iterative, so a deeply nested body cannot exhaust the stack.
    """
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                _check_text(key, path or "body", "a key of ")
                todo.append((where, item))
        elif isinstance(value, list):
            todo.extend((f"{path}.{i}", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path or "body")


def _check_text(text: str, field: str, what: str = "") -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        raise ApiError(
            400,
            f"{field}: {what}text holds a lone UTF-16 surrogate (U+{code:04X} at character {e.start}); "
            "send valid Unicode",
            field,
            "invalid_unicode",
        ) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, int] | None, chat: bool
) -> dict[str, Any]:
    """A whole response (`choices` hold `text` or `message`) or one stream chunk (`delta`)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": ("chat.completion" if chat else "text_completion"),
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chunk_body(request_id: str, model: str, choices: list[dict[str, Any]], chat: bool, usage_=None) -> dict:
    body = completion_body(request_id, model, choices, usage_, chat)
    if chat:
        body["object"] = "chat.completion.chunk"
    return body


def read_api_key(path: str | None) -> str | None:
    """The key in `path` (surrounding whitespace dropped); None without a path. An empty file is an error."""
    if path is None:
        return None
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"api_key_file {path!r} is empty")
    return key


def check_api_key(authorization: str | None, api_key: str | None) -> None:
    """Raise 401 unless the `Authorization` header is `Bearer <api_key>`; no key set, no check."""
    if api_key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    # compare_digest: the time taken must not tell how much of a guessed key was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(
            401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key"
        )
