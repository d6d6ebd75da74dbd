"""Choosing between one lane and two (`Engine` lanes) by measured throughput.

Two lanes hide the draft workers' time behind the other half's verify, at the price of two
smaller forwards per round instead of one. Which wins depends on how long drafting takes
next to verifying, and on how a forward's cost grows with its batch on this hardware:

    draft_model at batch 16 on two CPU cores   drafting ~ a half-batch verify: two lanes win
    ngram at batch 16                          drafting ~ 0: one lane wins (the round trip is
                                               cheaper than a second forward)

so the engine measures instead of guessing. `LaneTuner` runs each mode for a short trial,
then the faster one for a long stretch, then the other again for a trial (conditions
drift: batch size, context length, a busier draft worker), always keeping each mode's
latest tokens per second of engine time. Each trial that confirms the faster mode doubles
the stretch before the next one (up to `max_exploit_steps`), so a stable answer costs ever
fewer steps in the slower mode; a trial that overturns it starts again from
`exploit_steps`. Steps that say nothing about the choice (a prefill in the batch, fewer
than two decoding sequences, where both modes are the same; no sequence drafting, where
the engine verifies the whole batch in one forward whatever the mode) are not counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outrider.target_worker.sequence import Sequence


class LaneTuner:
    """Which lane count (1 or 2) the next step uses; fed each counted step's tokens and time."""

    def __init__(self, trial_steps: int = 8, exploit_steps: int = 64, max_exploit_steps: int = 1024):
        if trial_steps < 1 or exploit_steps < 1 or max_exploit_steps < exploit_steps:
            raise ValueError("need trial_steps >= 1 and 1 <= exploit_steps <= max_exploit_steps")
        self.trial_steps, self.exploit_steps = trial_steps, exploit_steps
        self.max_exploit_steps = max_exploit_steps
        self._stretch = exploit_steps  # the next long stretch
        self.mode = 2  # two lanes first: the mode built for a remote drafter
        self.rates: dict[int, float] = {}  # mode -> tokens/s of its latest finished segment
        self.switches = 0
        self.steps = {1: 0, 2: 0}  # counted steps run in each mode
        self._exploiting = False
        self._steps, self._tokens, self._seconds = 0, 0, 0.0

    def record(self, tokens: int, seconds: float) -> None:
        """One counted step: `tokens` emitted in `seconds` of engine time."""
        self.steps[self.mode] += 1
        self._steps += 1
        self._tokens += tokens
        self._seconds += seconds
        if self._steps < (self._stretch if self._exploiting else self.trial_steps):
            return
        self.rates[self.mode] = self._tokens / max(self._seconds, 1e-9)
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        if len(self.rates) < 2:  # the first trial of the other mode
            self._set(3 - self.mode)
        elif self._exploiting:  # a long stretch done: check the other mode again
            self._exploiting = False
            self._set(3 - self.mode)
        else:  # a trial done: run the faster mode for a long stretch
            self._exploiting = True
            best = max(self.rates, key=self.rates.__getitem__)
            if best == 3 - self.mode and self.switches > 1:  # the trial confirmed it: check later
                self._stretch = min(2 * self._stretch, self.max_exploit_steps)
            else:
                self._stretch = self.exploit_steps
            self._set(best)

    def _set(self, mode: int) -> None:
        self.switches += mode != self.mode
        self.mode = mode


def lane_to_verify(decoding: list[Sequence], turn: int) -> tuple[list[Sequence], int]:
    """With two lanes: the decoding sequences this step verifies (lane `turn`, or all of them
    when that lane is empty), and the lane whose turn is next. Lanes left uneven by finished
    sequences are evened out first."""
    lanes = [[s for s in decoding if s.lane == lane] for lane in (0, 1)]
    while abs(len(lanes[0]) - len(lanes[1])) > 1:  # sequences ended unevenly: even the lanes out
        big = int(len(lanes[1]) > len(lanes[0]))
        moved = lanes[big].pop()  # safe at any time: its tree is awaited by round, not by lane
        moved.lane = 1 - big
        lanes[1 - big].append(moved)
    chosen = lanes[turn]
    if not chosen:  # a single decoding sequence: it goes every step
        turn = 1 - turn
        chosen = decoding
    return chosen, 1 - turn
