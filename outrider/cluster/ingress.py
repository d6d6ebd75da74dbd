"""The OpenAI-compatible HTTP ingress: text in, token ids to the target, text (or SSE) out.

Its four jobs, and nothing else (docs/architecture.md, "How the code reads"):

1. check each request (OpenAI's ranges, the served model's name, the context length) and
   answer errors in OpenAI's JSON shape with the right status;
2. turn prompts and chat messages into token ids (the tokenizer's chat template);
3. fan `n` choices out to the target deployment as streams of token ids, and turn those
   back into text, cutting at stop strings (a choice whose replica dies goes on on another
   from the tokens already sent: `cluster.resume`);
4. serve `/v1/models`, `/health` and `/metrics`.

With `api_key_file` set, every /v1 route first checks `Authorization: Bearer <key>` and
answers 401 in OpenAI's shape without it; `/health` and `/metrics` stay open for probes
and scrapers.

Work before a refusal is bounded by what the limits allow, not by what a client sends
(`RequestLimitsArgs`): the body is read up to `max_body_bytes` (413 past it), strings that
are not valid Unicode are refused by field, and a prompt is measured in characters before it
is tokenized: past the context times the tokenizer's longest token in characters it cannot
fit, whatever its tokens, so a 10 MB prompt is refused without tokenizing it. No client
mistake produces a 5xx: anything unexpected is logged with its traceback and answered in
OpenAI's shape.

Overload is answered, never queued without bound: the target refuses a request when its own
queue is full (`EngineOverloaded`) and Serve refuses one past `max_queued_requests`
(`BackPressureError`); both become 429 before any byte of the response is sent, because every
target stream opens with an admitted `StreamChunk` that the ingress awaits first.
"""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError

from outrider.cluster.config import RequestLimitsArgs
from outrider.cluster.draft_registry import draft_announcements
from outrider.cluster.engine_loop import EngineOverloaded
from outrider.cluster.messages import GenerateRequest
from outrider.cluster.metrics import Metrics
from outrider.cluster.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    check_api_key,
    check_unicode,
    chunk_body,
    completion_body,
    new_id,
    read_api_key,
    read_json_body,
    usage,
    validation_error,
)
from outrider.cluster.openai_fields import chat_logprobs, completion_logprobs, echoed, vllm_prompt_logprobs
from outrider.cluster.resume import ResumableStream
from outrider.cluster.served_model import ServedModel
from outrider.cluster.text import Detokenizer, apply_chat_template, load_tokenizer, longest_token_chars
from outrider.target_worker.sequence import GrammarSpec, RequestParams

log = logging.getLogger(__name__)
app = FastAPI(title="Outrider", description="OpenAI-compatible speculative decoding")


# Above the class: Serve pickles the deployment class when it is decorated.
def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _as_api_error(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, (EngineOverloaded, BackPressureError)):
        return ApiError(429, "the server is at capacity; retry later", code="overloaded")
    log.error("request failed: %s: %s", type(error).__name__, error, exc_info=error)
    return ApiError(500, f"internal error: {type(error).__name__}")


def target_handle(target, transport: str):
    """The target deployment's handle on `transport` (`TargetDeploymentArgs.transport`):
    "grpc", Serve's gRPC transport to the replicas (one gRPC stream per request); "ray", a Ray
    object per streamed chunk. Every call on the handle takes it."""
    return target.options(_by_reference=transport == "ray")


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(
        self,
        target,
        model: ServedModel,
        default_max_tokens: int,
        chat_template: str | None = None,
        api_key_file: str | None = None,
        limits: RequestLimitsArgs | None = None,
        transport: str = "grpc",
    ):
        self.target = target_handle(target, transport)
        self.model, self.default_max_tokens = model, default_max_tokens
        self.api_key = read_api_key(api_key_file)
        self.tokenizer = load_tokenizer(model.tokenizer_dir, chat_template)
        self.metrics = Metrics(model.name)
        self.limits = limits or RequestLimitsArgs()
        # More characters than this cannot fit the context as tokens, whatever they are.
        self.max_prompt_chars = self.limits.max_prompt_chars or (
            model.max_model_len * longest_token_chars(self.tokenizer)
        )

    # ------------------------------------------------------------------ routes

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            check_api_key(request.headers.get("authorization"), self.api_key)
        except ApiError as e:
            return self._refuse(e)
        card = {
            "id": self.model.name,
            "object": "model",
            "created": 0,
            "owned_by": "outrider",
            "max_model_len": self.model.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.target.ping.remote(), timeout=10)
        except Exception as e:  # any failure to reach a target replica means unhealthy
            return JSONResponse(ApiError(503, f"target unavailable: {e}").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        try:  # one replica's fresh snapshot; the others' latest arrived with their requests
            self.metrics.snapshot(await asyncio.wait_for(self.target.stats.remote(), timeout=5))
        except Exception as e:  # a scrape must still answer with what is known
            log.warning("metrics: no fresh target snapshot (%s)", e)
        try:  # draft replicas announce their counters with their address (cluster.draft_registry)
            app_name = serve.get_replica_context().app_name
            self.metrics.draft_snapshots(await asyncio.to_thread(draft_announcements, app_name))
        except Exception as e:
            log.warning("metrics: draft replicas' counters unreadable (%s)", e)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, chat=True)

    # ------------------------------------------------------------------ one request

    async def _serve(self, request: Request, schema: type[SamplingFields], chat: bool) -> Response:
        try:
            check_api_key(request.headers.get("authorization"), self.api_key)
        except ApiError as e:
            return self._refuse(e)
        try:
            body = await read_json_body(request, self.limits.max_body_bytes)
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object", code="invalid_json")
            check_unicode(body)
            try:
                req = schema.model_validate(body)
            except ValidationError as e:
                raise validation_error(e.errors()) from e
            except RecursionError as e:
                raise ApiError(400, "request body is nested too deeply", code="invalid_json") from e
            if req.model != self.model.name:
                raise ApiError(
                    400,
                    f"model {req.model!r} is not served here; use {self.model.name!r}",
                    "model",
                    "model_not_found",
                )
            grammar = await asyncio.to_thread(self._check_sampling, req, chat)  # a schema may take a while
            prompt_ids = self._prompt_ids(req, chat)
            max_tokens = self._max_tokens(req, len(prompt_ids), chat)
            streams = [
                self._open(prompt_ids, req.request_params(max_tokens, i, grammar)) for i in range(req.n)
            ]
            opened = await asyncio.gather(*streams, return_exceptions=True)
            failure = next((o for o in opened if isinstance(o, BaseException)), None)
            if failure is not None:
                for o in opened:
                    if not isinstance(o, BaseException):
                        o.cancel()
                raise _as_api_error(failure)
        except Exception as e:  # an ApiError, or a bug: logged with its traceback, answered as JSON
            error = _as_api_error(e)
            self.metrics.error(error.status)
            return error.response()
        request_id = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            events = self._stream(request_id, req, opened, len(prompt_ids), chat)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._whole(request_id, req, opened, len(prompt_ids), chat)

    def _refuse(self, error: ApiError) -> Response:
        self.metrics.error(error.status)
        response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    def _check_sampling(self, req: SamplingFields, chat: bool) -> GrammarSpec | None:
        """What the models cannot check alone: token ids against the vocabulary, the grammar."""
        for field, token in req.token_ids_used():
            if token >= self.model.vocab_size:
                raise ApiError(400, f"{field}: token id {token} is outside the vocabulary", field)
        try:
            return req.grammar()
        except ValueError as e:
            field = str(e).split(":", 1)[0]
            raise ApiError(400, str(e), field if field.isidentifier() else None) from e

    def _prompt_ids(self, req: SamplingFields, chat: bool) -> list[int]:
        if chat:
            try:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            except ValueError as e:
                raise ApiError(400, f"messages: {e}", "messages") from e
            self._check_chars(sum(len(m["content"]) for m in messages), "messages")
            try:
                ids, field = apply_chat_template(self.tokenizer, messages), "messages"
            except TemplateError as e:  # a template may refuse a conversation (roles out of order)
                raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from e
        elif isinstance(req.prompt, str):
            self._check_chars(len(req.prompt), "prompt")
            ids, field = self.tokenizer.encode(req.prompt, add_special_tokens=False), "prompt"
        else:
            ids, field = req.prompt, "prompt"
            self._check_length(len(ids), field)
            bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary", "prompt")
        if not ids:
            raise ApiError(400, f"{field}: the prompt is empty", field)
        self._check_length(len(ids), field)
        return ids

    def _check_chars(self, chars: int, field: str) -> None:
        """Before tokenizing: more characters than `max_prompt_chars` cannot fit the context."""
        if chars > self.max_prompt_chars:
            raise ApiError(
                400,
                f"{field}: the prompt is {chars} characters; this model's context of "
                f"{self.model.max_model_len} tokens holds at most {self.max_prompt_chars}",
                field,
                "context_length_exceeded",
            )

    def _check_length(self, tokens: int, field: str) -> None:
        if tokens >= self.model.max_model_len:
            raise ApiError(
                400,
                f"{field}: the prompt is {tokens} tokens; this model's context is {self.model.max_model_len} "
                "tokens, including at least one output token",
                field,
                "context_length_exceeded",
            )

    def _max_tokens(self, req: SamplingFields, prompt_len: int, chat: bool) -> int:
        room = self.model.max_model_len - prompt_len
        asked = req.output_budget if chat else req.max_tokens
        if asked is None:
            return min(self.default_max_tokens, room)
        if asked > room:
            field = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
            raise ApiError(
                400,
                f"{field}: {prompt_len} prompt tokens + {asked} output tokens exceed this model's context of "
                f"{self.model.max_model_len} tokens",
                field,
                "context_length_exceeded",
            )
        return asked

    async def _open(self, prompt_ids: list[int], params: RequestParams):
        """Start one choice on the target; returns once the target admitted it. The stream
        resumes on another replica if its replica dies (`cluster.resume`)."""
        request = GenerateRequest(tuple(prompt_ids), params)
        return await ResumableStream.open(request, self._start, on_resume=self.metrics.resumed)

    async def _start(self, request: GenerateRequest):
        stream = self.target.options(stream=True).generate.remote(request)
        first = await stream.__anext__()  # the admitted chunk, or the overload error
        assert first.admitted, "the target's stream must open with an admitted chunk"
        return stream

    async def _choice(self, stream, req: SamplingFields) -> AsyncIterator[tuple[str, int, str | None, tuple]]:
        """(text delta, tokens in it, finish reason or None, their logprobs, prompt logprobs)
        until the choice ends."""
        detok, echo = Detokenizer(self.tokenizer, list(req.stop)), getattr(req, "echo", False)
        reason = None
        async for chunk in stream:
            text = detok.add(chunk.token_ids)
            reason = chunk.finish_reason
            prompt = chunk.prompt_logprobs or ()  # with the first tokens only; echo shows them first
            logprobs = (echoed(prompt, req.num_logprobs) if echo else ()) + (chunk.logprobs or ())
            if chunk.snapshot is not None:
                self.metrics.snapshot(chunk.snapshot)
            if detok.stopped:
                stream.cancel()  # frees the sequence's batch slot now
                yield text, len(chunk.token_ids), "stop", logprobs, prompt
                return
            yield (text + detok.flush() if reason else text), len(chunk.token_ids), reason, logprobs, prompt
            if reason:
                return

    def _logprobs(
        self, req: SamplingFields, entries: list, chat: bool, offset: int, echo: bool = False
    ) -> dict[str, Any] | None:
        """The choice's `logprobs` object in the endpoint's shape, or None if not asked for.
        `echo`: the entries start with the prompt's (its first token has no logprob: null)."""
        if req.num_logprobs is None:
            return None
        decode = self._token_text
        if chat:
            return chat_logprobs(entries, decode)
        return completion_logprobs(entries, decode, offset, self._first_prompt_token(req) if echo else None)

    def _first_prompt_token(self, req: CompletionRequest) -> int:
        if isinstance(req.prompt, list):
            return req.prompt[0]
        return self.tokenizer.encode(req.prompt, add_special_tokens=False)[0]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def _whole(self, request_id: str, req, streams: list, prompt_len: int, chat: bool) -> Response:
        start = time.monotonic()

        async def collect(index: int, stream) -> tuple[dict[str, Any], int, list[float]]:
            parts, times, reason, entries, prompt = [], [], "length", [], []
            async for text, n, finished, logprobs, prompt_logprobs in self._choice(stream, req):
                parts.append(text)
                times.extend([time.monotonic()] * n)
                reason = finished or reason
                entries.extend(logprobs)
                prompt.extend(prompt_logprobs)
            text = "".join(parts)
            choice = {
                "index": index,
                "finish_reason": reason,
                "logprobs": self._logprobs(req, entries, chat, 0, echo=not chat and req.echo),
            }
            if req.prompt_logprobs is not None:  # chat: moved to the response's top below
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    prompt, self._token_text, req.prompt_logprobs
                )
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = (self._echo(req) + text) if req.echo else text
            return choice, len(times), times

        try:
            results = await asyncio.gather(*(collect(i, s) for i, s in enumerate(streams)))
        except Exception as e:  # a replica died mid-request: OpenAI's shape, not a traceback
            error = _as_api_error(e)
            self.metrics.error(error.status)
            return error.response()
        for choice, _, times in results:
            self.metrics.request_done(prompt_len, times, start, choice["finish_reason"])
        completion_tokens = sum(n for _, n, _ in results)
        body = completion_body(
            request_id,
            self.model.name,
            [c for c, _, _ in results],
            usage(prompt_len, completion_tokens),
            chat,
        )
        if chat and req.prompt_logprobs is not None:  # vLLM's place for them in a chat response
            body["prompt_logprobs"] = [c.pop("prompt_logprobs") for c in body["choices"]][0]
        return JSONResponse(body)

    async def _stream(self, request_id: str, req, streams: list, prompt_len: int, chat: bool):
        start = time.monotonic()
        merged: asyncio.Queue = asyncio.Queue()
        counts = [0] * len(streams)
        emitted = [0] * len(streams)  # each choice's tokens in the chunks sent (`usage_in_every_chunk`)

        async def pump(index: int, stream) -> None:
            times: list[float] = []
            reason, chars, echo = "abort", 0, not chat and req.echo
            try:
                if chat:
                    await merged.put((index, {"role": "assistant", "content": ""}, None, None, 0))
                elif req.echo:
                    await merged.put((index, self._echo(req), None, None, 0))
                async for text, n, finished, logprobs, _ in self._choice(stream, req):
                    times.extend([time.monotonic()] * n)
                    counts[index] += n
                    reason = finished or reason
                    if text or finished or logprobs:
                        scores = self._logprobs(req, list(logprobs), chat, chars, echo)
                        chars += sum(len(t) for t in (scores or {}).get("tokens", ()))
                        echo = False  # the prompt's logprobs come with the first tokens only
                        payload = {"content": text} if chat else text
                        await merged.put((index, payload, finished, scores, counts[index]))
            except Exception as e:  # reported in-band: the 200 status is already sent
                await merged.put((index, _as_api_error(e), None, None, counts[index]))
            finally:
                self.metrics.request_done(prompt_len, times, start, reason)
                await merged.put(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            open_streams = len(streams)
            while open_streams:
                item = await merged.get()
                if item is None:
                    open_streams -= 1
                    continue
                index, payload, finished, scores, emitted[index] = item
                if isinstance(payload, ApiError):
                    yield _sse(payload.body())
                    continue
                key = "delta" if chat else "text"
                choice = {"index": index, key: payload, "finish_reason": finished, "logprobs": scores}
                so_far = usage(prompt_len, sum(emitted)) if req.usage_in_every_chunk else None
                yield _sse(chunk_body(request_id, self.model.name, [choice], chat, so_far))
            if req.include_usage_in_stream:
                yield _sse(chunk_body(request_id, self.model.name, [], chat, usage(prompt_len, sum(counts))))
            yield "data: [DONE]\n\n"
        finally:
            for task, stream in zip(tasks, streams, strict=True):
                task.cancel()  # the client went away: stop generating
                stream.cancel()

    def _echo(self, req: CompletionRequest) -> str:
        return req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(req.prompt)
