"""A target stream that outlives its replica: the ingress resumes a choice elsewhere.

Ray Serve restarts a dead replica, but a request in flight on it is lost: its stream raises
`ActorDiedError` (or `ActorUnavailableError` while the node is unreachable). Every token a
choice has emitted is known at the ingress, so the choice can go on anywhere:

    replica A:  prompt ──> t1 t2 t3 ✗ (A dies)
    replica B:  prompt + t1 t2 t3 ──> t4 t5 ... (max_tokens - 3 more)
    client:     t1 t2 t3 t4 t5 ...            no gap, no token twice

The resumed request is the same `GenerateRequest` carrying the emitted tokens as the choice's
output so far (`output_token_ids`): the engine continues after them as after its own output,
so penalties count them, a grammar has consumed them, and max_tokens and min_tokens include
them. At T = 0 the continuation is token for token what A would have produced (greedy
decoding is a function of the context alone, and speculation is lossless). A sampled choice
continues with fresh randomness from the resume point: its distribution is still the
target's, but a seeded request is not reproducible across a resume.

The wrapper sits under the ingress's detokenizer (`OpenAIIngress._choice` iterates it like
the Serve stream it wraps), so streamed and whole responses resume the same way, and the
detokenizer's state (partial UTF-8, stop strings) carries across the seam.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from ray.exceptions import ActorUnavailableError, RayActorError

from outrider.cluster.messages import GenerateRequest, StreamChunk

log = logging.getLogger(__name__)

# A replica's death as the ingress sees it: the actor died (killed, its node removed) or is
# unreachable. Anything else (an engine error, overload) is the request's own failure.
REPLICA_LOST = (RayActorError, ActorUnavailableError)


class ResumePolicy:
    """How hard to try: `max_resumes` per choice, new replicas tried for `deadline_s` each time."""

    def __init__(self, max_resumes: int = 3, deadline_s: float = 60.0, retry_s: float = 0.5):
        self.max_resumes, self.deadline_s, self.retry_s = max_resumes, deadline_s, retry_s


def resumed_request(request: GenerateRequest, emitted: list[int]) -> GenerateRequest:
    """The same choice, continued after the `emitted` output tokens (all of them, across resumes)."""
    return replace(request, output_token_ids=tuple(emitted))


class ResumableStream:
    """Iterates a choice's `StreamChunk`s (token deltas) across replica deaths.

    `open_stream(request)` starts `request` on some replica and returns its Serve stream once
    the admitted chunk arrived (the ingress's `_open`). `on_resume(replica_error)` is told each
    time a choice moved (the ingress counts it for /metrics).
    """

    def __init__(
        self,
        request: GenerateRequest,
        stream,
        open_stream: Callable[[GenerateRequest], Awaitable],
        policy: ResumePolicy | None = None,
        on_resume: Callable[[BaseException], None] | None = None,
    ):
        self.request, self._stream, self._open = request, stream, open_stream
        self.policy = policy or ResumePolicy()
        self._on_resume = on_resume
        self.emitted: list[int] = []  # output tokens delivered so far, across replicas
        self.resumes = 0
        self._done = False

    @classmethod
    async def open(
        cls,
        request: GenerateRequest,
        open_stream: Callable[[GenerateRequest], Awaitable],
        policy: ResumePolicy | None = None,
        on_resume: Callable[[BaseException], None] | None = None,
    ) -> ResumableStream:
        """Start `request`; a replica that died before admitting it is retried like a resume."""
        policy = policy or ResumePolicy()
        deadline = time.monotonic() + policy.deadline_s
        while True:
            try:
                return cls(request, await open_stream(request), open_stream, policy, on_resume)
            except REPLICA_LOST:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(policy.retry_s)

    def __aiter__(self) -> ResumableStream:
        return self

    async def __anext__(self) -> StreamChunk:
        while True:
            if self._done:
                raise StopAsyncIteration
            try:
                chunk = await self._stream.__anext__()
            except StopAsyncIteration:
                self._done = True
                raise
            except REPLICA_LOST as error:
                await self._resume(error)
                continue
            self.emitted.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                self._done = True
            return chunk

    async def _resume(self, error: BaseException) -> None:
        """Reopen the choice on a live replica from where it stopped; re-raise `error` if we cannot."""
        if self.resumes >= self.policy.max_resumes:
            raise error
        left = self.request.params.max_tokens - len(self.emitted)
        if left <= 0:  # every token arrived; only the finish was lost
            self._stream = _finished(StreamChunk(finish_reason="length"))
            return
        self.resumes += 1
        request = resumed_request(self.request, self.emitted)
        log.warning(
            "target replica lost mid-request (%s); resuming after %d tokens (%d left)",
            type(error).__name__,
            len(self.emitted),
            left,
        )
        if self._on_resume is not None:
            self._on_resume(error)
        deadline = time.monotonic() + self.policy.deadline_s
        while True:
            try:
                self._stream = await self._open(request)
                return
            except REPLICA_LOST as again:  # routed to a replica that is dead too: Serve learns soon
                if time.monotonic() > deadline:
                    raise again from error
                await asyncio.sleep(self.policy.retry_s)

    def cancel(self) -> None:
        self._done = True
        self._stream.cancel()


class _finished:
    """A stream of one last chunk (a choice whose tokens all arrived before its replica died)."""

    def __init__(self, chunk: StreamChunk):
        self._chunk: StreamChunk | None = chunk

    async def __anext__(self) -> StreamChunk:
        if self._chunk is None:
            raise StopAsyncIteration
        chunk, self._chunk = self._chunk, None
        return chunk

    def cancel(self) -> None:
        self._chunk = None
