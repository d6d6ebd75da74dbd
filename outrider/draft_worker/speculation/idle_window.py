"""The idle window: how long the drafter usually waits between real rounds, and what fits in it.

    real batch r drafted ──┐ idle_since                    ┌── round r+1 arrives
                           ├──── guess ── guess ── gue|ss  │   (the guess in flight is
                           │<────────── window_s ─────────>│    interrupted at a draft step)

Speculation only fills idle time: a real round that arrives while a guess is being drafted
waits for it (for one draft step: `DraftHints.interrupted`). `window_s` is a running average
of the windows seen, timed from the end of the last real batch; a batch after which rounds
were already waiting counts as a window of 0.
"""

from __future__ import annotations

import math
import time

_WINDOW_EMA = 0.3  # weight of the newest idle window in its running average


class IdleWindow:
    """Guarded by the draft batcher's lock (reader threads close it, the drafting thread opens it)."""

    def __init__(self) -> None:
        self.idle_since: float | None = None  # the end of the last real batch; None = not idle
        self.window_s: float | None = None  # the usual idle time between real rounds (EMA)

    def round_arrived(self) -> None:
        """A real round came in: the time idle since the last batch joins the average."""
        if self.idle_since is not None:
            self._observe(time.perf_counter() - self.idle_since)

    def batch_done(self, rounds_waiting: bool) -> None:
        """A real batch was drafted; rounds already waiting mean no idle time at all."""
        if rounds_waiting:
            self._observe(0.0)
        else:
            self.idle_since = time.perf_counter()

    def outcomes_that_fit(self, most: int, cost_s: float | None) -> int:
        """Outcomes to pre-draft now, at `cost_s` each: as many as should be done before the
        next real round, at most `most`."""
        window = self.window_s
        if cost_s is None or window is None or self.idle_since is None:
            return most  # nothing measured yet: try
        left = window - (time.perf_counter() - self.idle_since)
        # Rounded up: a guess still drafting when the real round comes is interrupted at its
        # next draft step (DraftHints.interrupted), which costs less than the hits a cautious
        # cut gives up (draft_model at batch 1: 1.0-1.07x co-located this way, 0.88-0.93x
        # when only outcomes that fit 75% of the window were started).
        return min(most, math.ceil(left / cost_s)) if cost_s > 0 else most

    def _observe(self, seconds: float) -> None:
        self.idle_since = None
        ema = self.window_s
        self.window_s = seconds if ema is None else ema + _WINDOW_EMA * (seconds - ema)
