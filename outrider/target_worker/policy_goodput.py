"""The speculation policy's model checked against measurement (`spec_policy`, docs/algorithms.md
section 2c): committed tokens per plain-equivalent token of the rounds the solver drafted in
and of rounds nobody drafted, per batch size (`BatchGoodput`), off probes that keep the second
current, and a veto on drafting at a batch size while it measures less there, or while the
drafter misses the round's deadline (`late`)."""

from __future__ import annotations

import numpy as np

from outrider.target_worker.policy_config import PolicyConfig, PolicyStats


class BatchGoodput:
    """The goodput check at one batch size (an octave of B): decayed [tokens, plain-equivalent
    tokens, rounds] of rounds the solver drafted in (True) and of rounds nobody drafted (False),
    the veto on drafting there (until, the next veto's length), and its off probes (the next,
    their spacing)."""

    __slots__ = ("kinds", "veto_until", "veto_interval", "next_off", "off_interval")

    def __init__(self, probe_every: int):
        self.kinds = {True: [0.0, 0.0, 0.0], False: [0.0, 0.0, 0.0]}
        self.veto_until, self.veto_interval = 0, probe_every
        self.next_off, self.off_interval = 0, probe_every


class GoodputCheck:
    """Kept per batch size: a round's plain-equivalent tokens are its seconds over the cost
    fits' verify(B), and a line's error moves with B, so rounds of two kinds measured at
    different batch sizes compare the fit's errors there, not drafting. Replay drafter (a =
    0.5, batch 16, continuous admission, in process): rounds without drafts were mostly a
    run's ramp-down (a few sequences left), drafting ones at B = 16, and one check read
    drafting 1.37 against 0.79 without, where K = 1 and plain decoding measured the same
    (1.88-1.92 against 1.91-1.97 tokens a ms): the policy drafted depth 1 throughout, 0.90x
    plain. Compared at the batch being decided, a fit's error is the same on both sides."""

    def __init__(self, config: PolicyConfig, stats: PolicyStats):
        self.config, self.stats = config, stats
        # B.bit_length() -> its `BatchGoodput`; `at`: the batch size last recorded or decided.
        self._sizes: dict[int, BatchGoodput] = {}
        self.at = self._size(1)
        self.planned: bool | None = None  # the planned round's kind (None: a probe or warm-up round)
        self.off_probe = False  # the planned round is an off probe (not to be probed either)
        # N.bit_length() (N: the forward's tokens) -> decayed [seconds measured, seconds the
        # cost fits predicted, rounds, the round of the last] of decode rounds (`scale`).
        self._timing: dict[int, list[float]] = {}
        # A.bit_length() (A: sequences asked to draft) -> [the round drafting at that many or
        # more is vetoed until, the next such veto's length] (`late`).
        self._late: dict[int, list[int]] = {}

    def _size(self, num_seqs: int) -> BatchGoodput:
        octave = int(num_seqs).bit_length()
        size = self._sizes.get(octave)
        if size is None:
            size = self._sizes[octave] = BatchGoodput(self.config.probe_every)
        return size

    def select(self, num_seqs: int) -> BatchGoodput:
        """The check at `num_seqs` sequences becomes the current one (`kinds`, `off`)."""
        self.at = self._size(num_seqs)
        return self.at

    @property
    def kinds(self) -> dict[bool, list[float]]:
        return self.at.kinds

    @kinds.setter
    def kinds(self, kinds: dict[bool, list[float]]) -> None:
        self.at.kinds = kinds

    @property
    def off(self) -> list[float]:
        return self.at.kinds[False]

    def record(self, committed: int, worth: float, prefill_tokens: int, num_seqs: int) -> None:
        """A round's committed tokens and its worth in plain-equivalent tokens (what plain
        decoding would have committed in its time), under the planned round's kind at its
        batch size (`num_seqs` sequences verified), which becomes the current one."""
        kept = self.select(num_seqs).kinds
        if self.planned is not None and not prefill_tokens:  # prompt chunks would blur the rate
            kept, decay = kept[self.planned], self.config.goodput_decay
            for i, value in enumerate((committed, worth, 1.0)):
                kept[i] = decay * kept[i] + value

    def record_rows(self, committed: np.ndarray, worth: np.ndarray, num_seqs: np.ndarray) -> None:
        """`record` of several rounds without prompt chunks, in order, at once."""
        if self.planned is None or not len(committed):
            return
        decay, octaves = self.config.goodput_decay, np.frexp(num_seqs)[1]  # (B.bit_length())
        for octave in dict.fromkeys(octaves.tolist()):  # (in order: the last is the current)
            at = octaves == octave
            kept = self.select(int(num_seqs[at][-1])).kinds[self.planned]
            weights = decay ** np.arange(int(at.sum()) - 1, -1, -1.0)  # the last round's is 1
            scale = decay ** len(weights)
            sums = (float(weights @ committed[at]), float(weights @ worth[at]), float(weights.sum()))
            for i, value in enumerate(sums):
                kept[i] = scale * kept[i] + value
        self.select(int(num_seqs[-1]))

    def timed(self, num_tokens: int, measured: float, predicted: float, rounds: int) -> None:
        """A decode round whose forward carried `num_tokens` (round `rounds`): its seconds, and
        what the cost fits predicted."""
        self._time(int(num_tokens).bit_length(), (measured, predicted, 1.0), rounds)

    def timed_rows(
        self, tokens: np.ndarray, measured: np.ndarray, predicted: np.ndarray, rounds: int
    ) -> None:
        """`timed` of several rounds, in order, the last one round `rounds`."""
        weights = self.config.goodput_decay ** np.arange(len(tokens) - 1, -1, -1.0)
        octaves = np.frexp(tokens)[1]  # (N.bit_length())
        for octave in set(octaves.tolist()):  # (not np.unique: ~0.2 ms a call here)
            w = np.where(octaves == octave, weights, 0.0)
            self._time(int(octave), (w @ measured, w @ predicted, w.sum()), rounds)

    def _time(self, octave: int, values: tuple[float, float, float], rounds: int) -> None:
        kept = self._timing.setdefault(octave, [0.0, 0.0, 0.0, rounds])
        decay = self.config.goodput_decay ** (rounds - kept[3])
        kept[:] = [decay * old + float(new) for old, new in zip(kept[:3], values, strict=True)] + [rounds]

    def scale(self, num_tokens: float, rounds: int, unknown: float = 1.0) -> float:
        """How much longer rounds whose forward carried about this many tokens (the same
        octave) measured than the cost fits predicted: `unknown` until `off_min_rounds` of them
        are measured (decayed by every round since: a size not measured lately falls back to
        it), within 0.5 .. 2. The fits are lines through every round they were fed, and a line
        misses where costs are not: a forward's cost is concave in its tokens on this CPU, and
        over HTTP at concurrency 16 (draft_model co-located, T = 0) the fits priced rounds
        without drafts (16 tokens) ~20% under their time and rounds drafting 2-4 tokens a
        sequence (48-80) up to ~10% over; the solver, weighing the two, stayed off 96% of the
        rounds where fixed K = 2 ran 1.10x off. Each option's rate is divided by the scale at
        the tokens its choice puts in the forward. By tokens, not by whether the round drafts:
        a drafting round with one sequence drafting costs what a round without drafts does.
        Only where the batch holds more than one sequence: at batch 1 the fits' lone step (j)
        already models the forward's shape over its 1-9 tokens, the scale there was noise, and
        a noisy turn off is sticky (nothing drafts to correct it before the next probe): in
        `outrider bench` (ngram, T = 0) it held speculation off ~130 rounds at a time, 0.90-0.94x
        fixed K = 4 where the policy without it ran 0.99x."""
        kept = self._timing.get(int(num_tokens).bit_length())
        if kept is None or kept[1] <= 0.0:
            return unknown
        if kept[2] * self.config.goodput_decay ** (rounds - kept[3]) < self.config.off_min_rounds:
            return unknown
        return min(max(kept[0] / kept[1], 0.5), 2.0)

    def scales(self, tokens: dict[int, float], rounds: int) -> dict[int, float]:
        """`scale` of each option's forward tokens (by deepest budget m; m = 0: no drafts). An
        option whose size was not measured lately is taken as far off the fits as rounds without
        drafts: the first rounds of a wave of 16 requests over HTTP, streaming their first tokens,
        ran ~1.6x the fits without drafts, and against unmeasured drafting sizes at 1 that scale
        turned drafting on at batch 16 where it ran 0.7x plain (draft_model co-located, T = 0)."""
        off = self.scale(tokens[0], rounds)
        return {m: self.scale(n, rounds, off) for m, n in tokens.items()}

    def late(self, asked: int, missed: bool, rounds: int) -> None:
        """A round asked `asked` sequences for drafts, and the drafter missed the round's
        deadline for every one (`missed`), or answered some in time. A remote drafter whose work
        grows with the batch (a draft model catching up on new prompts, then drafting every
        row) can miss it at every round from some batch size on: each such round waits the
        whole deadline and verifies root-only trees, the worst a round can do. Over HTTP at
        concurrency 16 (draft_model disaggregated, T = 0) every round of fixed K = 8 missed the
        50 ms deadline (0.39x off), and the adaptive policy, still drafting from the last solve
        as a wave of 16 requests arrived, waited it out 5 rounds in a row before its estimates
        and goodput check turned speculation off, then probed at that size every ~50-100
        rounds, each probe missing it too (0.80x off).

        So drafting for that many sequences or more is vetoed at once, `probe_every` rounds,
        doubling while each retry misses again (up to `max_probe_every`); trees answered in
        time for as many (a retry, or a probe) lift the veto at that size and below."""
        if not (missed or self._late):  # (every drafting round: nothing to do, the usual case)
            return
        octave = asked.bit_length()
        marks = [o for o in self._late if o <= octave]
        if not missed:
            for o in marks:
                del self._late[o]
            return
        interval = max((self._late[o][1] for o in marks), default=self.config.probe_every)
        self._late[octave] = [rounds + interval, min(2 * interval, self.config.max_probe_every)]

    def late_until(self, num_seqs: int) -> int:
        """The round drafting for `num_seqs` sequences is vetoed until by a drafter that missed
        its deadline at that many or fewer (`late`)."""
        octave = num_seqs.bit_length()
        return max((until for o, (until, _) in self._late.items() if o <= octave), default=0)

    def vetoed_until(self, num_seqs: int) -> int:
        """The round drafting for `num_seqs` sequences is vetoed until (measured goodput at
        that batch size, or `late_until`)."""
        return max(self._size(num_seqs).veto_until, self.late_until(num_seqs))

    def vetoed(self, rounds: int, num_seqs: int = 1) -> bool:
        """Whether drafting for `num_seqs` sequences is vetoed this round: the drafter missed
        its deadline at that many (`late`), or at that batch size (which becomes the current
        one) drafting rounds measured more than `goodput_margin` fewer committed tokens per
        plain-equivalent token than rounds without drafts. Called once a round."""
        at = self.select(num_seqs)
        if rounds < at.veto_until or (self._late and rounds < self.late_until(num_seqs)):
            return True
        on, off = at.kinds[True], at.kinds[False]
        if not self.measured():
            return False
        if on[0] * off[1] >= (1.0 - self.config.goodput_margin) * off[0] * on[1]:  # pays, or within noise
            at.veto_interval = self.config.probe_every
            return False
        at.veto_until = rounds + at.veto_interval
        at.veto_interval = min(2 * at.veto_interval, self.config.max_probe_every)
        at.kinds[True] = [0.0, 0.0, 0.0]  # the retry after it measures afresh
        return True

    def measured(self) -> bool:
        """Both kinds of round measured enough for the check at the current batch size."""
        config = self.config
        return (
            self.kinds[True][2] >= config.goodput_min_rounds and self.kinds[False][2] >= config.off_min_rounds
        )

    def checked(self, depths: list[int], vetoed: bool, rounds: int) -> list[int]:
        """The solver's depths, unless measurement says otherwise: all 0 on an off probe, or
        while vetoed. A size's off probes wait until its drafting rounds are measured (the check
        cannot compare before): a wave of 64 requests passes through every octave of B, and
        probed at each size's first round, off probes were 7.4% of the sequence-rounds over
        HTTP (ngram, T = 0, c = 64), 4.8% waiting."""
        self.select(len(depths))
        self.planned, self.off_probe = None, False
        if not any(depths):  # measures rounds without drafts as an off probe would (a
            self.planned = False  # request's last round at batch 1): the next probe waits
            self._next_off_probe(rounds)
            return depths
        if vetoed:
            self.stats.vetoed_rounds += 1
            self.planned = False
            return [0] * len(depths)
        if rounds >= self.at.next_off and self.kinds[True][2] >= self.config.goodput_min_rounds:
            self._next_off_probe(rounds)
            self.stats.off_probes += 1
            self.planned, self.off_probe = False, True
            return [0] * len(depths)
        self.planned = True
        return depths

    def _next_off_probe(self, rounds: int) -> None:
        """A round without drafts is measured now at the current batch size: the next off probe
        there is due an interval on, spaced ever wider once both kinds are measured (and
        drafting wins: not vetoed). Per batch size: with one schedule, spaced wide by what was
        measured at a few sequences, batch 16 saw one round without drafts in ~100 (replay, a =
        0.5, continuous admission), too few for the check there."""
        at = self.at
        if self.measured():
            at.off_interval = min(2 * at.off_interval, self.config.max_probe_every)
        at.next_off = rounds + at.off_interval
