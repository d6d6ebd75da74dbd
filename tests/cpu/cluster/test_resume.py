"""`cluster.resume` on fake replicas: a choice whose replica dies goes on elsewhere from the
tokens already sent, with no gap, no token twice and the right remaining budget.

The fake target decodes "greedily": the next token is a function of the whole context, so an
uninterrupted run and a resumed one must agree token for token.
"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError

from outrider.cluster.messages import GenerateRequest, StreamChunk
from outrider.cluster.resume import ResumableStream, ResumePolicy, resumed_request
from outrider.target_worker.sequence import RequestParams


def next_token(context: tuple[int, ...]) -> int:
    return (sum(context) * 31 + len(context)) % 97


class FakeReplica:
    """Streams up to `max_tokens` output tokens (counting those the request says it already
    emitted) in chunks of `chunk`; dies after `die_after` tokens if set."""

    def __init__(self, die_after: int | None = None, chunk: int = 2):
        self.die_after, self.chunk = die_after, chunk
        self.requests: list[GenerateRequest] = []

    async def stream(self, request: GenerateRequest):
        self.requests.append(request)
        context = [*request.prompt_token_ids, *request.output_token_ids]
        produced = len(request.output_token_ids)
        while produced < request.params.max_tokens:
            delta = []
            for _ in range(min(self.chunk, request.params.max_tokens - produced)):
                if self.die_after is not None and produced == self.die_after:
                    raise RayActorError()
                delta.append(next_token(tuple(context)))
                context.append(delta[-1])
                produced += 1
            done = produced == request.params.max_tokens
            yield StreamChunk(token_ids=tuple(delta), finish_reason="length" if done else None)


class Pool:
    """Replicas in turn: each open goes to the next one (the dead one is never chosen again)."""

    def __init__(self, *replicas: FakeReplica):
        self.replicas, self.opens = list(replicas), 0

    async def open(self, request: GenerateRequest):
        replica = self.replicas[min(self.opens, len(self.replicas) - 1)]
        self.opens += 1
        return Cancellable(replica.stream(request))


class Cancellable:
    def __init__(self, generator):
        self.generator, self.cancelled = generator, False

    async def __anext__(self):
        return await self.generator.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


def run(
    pool: Pool, request: GenerateRequest, **kwargs
) -> tuple[list[int], list[str | None], ResumableStream]:
    async def go():
        stream = await ResumableStream.open(request, pool.open, **kwargs)
        tokens, reasons = [], []
        async for chunk in stream:
            tokens.extend(chunk.token_ids)
            reasons.append(chunk.finish_reason)
        return tokens, reasons, stream

    return asyncio.run(go())


REQUEST = GenerateRequest((5, 7, 11), RequestParams(max_tokens=12))


def test_resumed_request_carries_the_emitted_tokens_as_its_output():
    resumed = resumed_request(REQUEST, [1, 2, 3])
    assert resumed.prompt_token_ids == (5, 7, 11) and resumed.output_token_ids == (1, 2, 3)
    assert resumed.params == REQUEST.params  # max_tokens counts the emitted tokens, as penalties do


@pytest.mark.parametrize("die_after", [0, 1, 5, 11])
def test_a_dead_replica_costs_no_token(die_after):
    plain, _, _ = run(Pool(FakeReplica()), REQUEST)
    survivor = FakeReplica()
    seen = []
    tokens, reasons, stream = run(
        Pool(FakeReplica(die_after=die_after), survivor), REQUEST, on_resume=seen.append
    )
    assert tokens == plain and len(tokens) == 12
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert stream.resumes == 1 and len(seen) == 1 and isinstance(seen[0], RayActorError)
    assert len(survivor.requests[0].output_token_ids) == die_after - die_after % 2


def test_two_deaths_in_a_row_and_the_resume_limit():
    plain, _, _ = run(Pool(FakeReplica()), REQUEST)
    tokens, _, stream = run(Pool(FakeReplica(die_after=3), FakeReplica(die_after=4), FakeReplica()), REQUEST)
    assert tokens == plain and stream.resumes == 2
    with pytest.raises(RayActorError):
        run(
            Pool(FakeReplica(die_after=3), FakeReplica(die_after=4), FakeReplica()),
            REQUEST,
            policy=ResumePolicy(max_resumes=1),
        )


def test_a_replica_lost_before_admitting_is_retried():
    class DeadThenAlive(Pool):
        async def open(self, request):
            self.opens += 1
            if self.opens == 1:
                raise RayActorError()
            return Cancellable(self.replicas[0].stream(request))

    plain, _, _ = run(Pool(FakeReplica()), REQUEST)
    tokens, _, stream = run(DeadThenAlive(FakeReplica()), REQUEST, policy=ResumePolicy(retry_s=0.0))
    assert tokens == plain and stream.resumes == 0


def test_other_errors_are_not_resumed():
    class Broken(FakeReplica):
        async def stream(self, request):
            yield StreamChunk(token_ids=(1,))
            raise ValueError("engine bug")

    with pytest.raises(ValueError):
        run(Pool(Broken(), FakeReplica()), REQUEST)
