"""The engine's step loop on a thread, and per-request asyncio queues for the async handlers.

    handler (event loop)                      step thread (owns the engine)
    submit(prompt, params) ── inbox ──────>   admit while batch slots are free
      <─ asyncio.Queue of deltas ─────────    outputs = engine.step()
    abort(id)  ── inbox ──────────────────>   engine.abort(id)   (client gone, stop string)

The engine is not thread-safe and `step()` blocks for a whole forward, so exactly one
thread touches it; handlers only put commands in the inbox and read their queue, which the
thread feeds with `call_soon_threadsafe`. Memory is bounded twice: at most `max_num_seqs`
sequences are in the engine, at most `max_queued` wait for a slot, and `submit` refuses the
next one with `EngineOverloaded` (the API's 429) instead of queueing it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outrider.target_worker.sequence import RequestParams

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """Every batch slot and queue place is taken; retry later (HTTP 429)."""


@dataclass
class _Pending:
    request_id: int
    prompt_ids: list[int]
    params: RequestParams | None  # None: the engine's defaults
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    output_ids: list[int] = field(default_factory=list)  # already emitted (a resumed choice)
    engine_id: int = -1  # the engine's own request id, once added


@dataclass
class LoopStats:
    steps: int = 0
    batch_seq_sum: int = 0  # sequences in the batch, summed over steps (mean occupancy)
    finished: int = 0
    aborted: int = 0
    step_s: float = 0.0


class EngineLoop:
    def __init__(self, engine: Any, max_num_seqs: int, max_queued: int, name: str = "engine"):
        self.engine, self.max_num_seqs, self.max_queued = engine, max_num_seqs, max_queued
        self.stats = LoopStats()
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._aborts: list[int] = []
        self._live: dict[int, _Pending] = {}  # engine id -> request, for those in the engine
        self._next_id = 0
        self._stopping = False
        self.error: BaseException | None = None  # the step loop died of this
        self._thread = threading.Thread(target=self._run, name=f"{name}-step-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ handler side

    def submit(
        self, prompt_ids: list[int], params: RequestParams | None, output_ids: list[int] | None = None
    ) -> tuple[int, asyncio.Queue]:
        """Queue a request; its queue gets `RequestOutput`s, or an exception, until finished."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error!r}")
            if len(self._live) + len(self._waiting) >= self.max_num_seqs + self.max_queued:
                raise EngineOverloaded(
                    f"{len(self._live)} sequences running and {len(self._waiting)} queued (limit {self.max_queued})"
                )
            self._next_id += 1
            pending = _Pending(self._next_id, prompt_ids, params, loop, asyncio.Queue(), output_ids or [])
            self._waiting.append(pending)
            self._cond.notify()
            return pending.request_id, pending.queue

    def abort(self, request_id: int) -> None:
        with self._cond:
            for pending in self._waiting:
                if pending.request_id == request_id:
                    self._waiting.remove(pending)
                    return
            for engine_id, pending in self._live.items():
                if pending.request_id == request_id:
                    self._aborts.append(engine_id)
                    self._cond.notify()
                    return

    @property
    def num_running(self) -> int:
        return len(self._live)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ step thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self._aborts or self._live):
                        self._cond.wait()
                    if self._stopping:
                        break
                    aborts, self._aborts = self._aborts, []
                    admit = []
                    while self._waiting and len(self._live) + len(admit) < self.max_num_seqs:
                        admit.append(self._waiting.popleft())
                for engine_id in aborts:
                    self._abort(engine_id)
                for pending in admit:
                    self._admit(pending)
                if self._live:
                    self._step()
        except BaseException as e:  # the engine is broken: fail every request, never hang them
            log.exception("engine step loop stopped")
            with self._cond:
                self.error = e
                everyone = list(self._live.values()) + list(self._waiting)
                self._live.clear()
                self._waiting.clear()
            for pending in everyone:
                pending.loop.call_soon_threadsafe(pending.queue.put_nowait, e)

    def _admit(self, pending: _Pending) -> None:
        try:
            pending.engine_id = self.engine.add_request(
                pending.prompt_ids, pending.params, pending.output_ids
            )
        except (ValueError, RuntimeError) as e:  # refused (does not fit the cache, bad params)
            pending.loop.call_soon_threadsafe(pending.queue.put_nowait, e)
            return
        with self._cond:
            self._live[pending.engine_id] = pending

    def _abort(self, engine_id: int) -> None:
        with self._cond:
            pending = self._live.pop(engine_id, None)
        if pending is not None:
            self.engine.abort_request(engine_id)
            self.stats.aborted += 1

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        self.stats.step_s += time.perf_counter() - start
        self.stats.steps += 1
        self.stats.batch_seq_sum += len(self._live)
        for output in outputs:
            with self._cond:
                pending = self._live.get(output.request_id)
                if pending is not None and output.finished:
                    del self._live[output.request_id]
                    self.stats.finished += 1
            if pending is not None:
                pending.loop.call_soon_threadsafe(pending.queue.put_nowait, output)
