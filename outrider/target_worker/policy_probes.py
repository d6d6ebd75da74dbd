"""Probing the sequences the speculation policy turned off (`spec_policy.SpeculationPolicy`):
which rounds are probe rounds, and how deep a probe drafts (docs/algorithms.md section 2c).

A mixin of `SpeculationPolicy`, whose state it reads and sets: the probe schedule
(`_next_probe`, `_probe_interval`, `_chain`, `_probing`, `_probe_extra`), the batch-wide
counts and the cost fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from outrider.target_worker.policy_estimates import Outcome, expected_gains, sequence_seconds


class Probing:
    def _probed(self, seq_ids: Seq[int], depths: list[int], ceiling: list[int], vetoed: bool) -> list[int]:
        """On probe rounds every sequence not speculating drafts (`_probe_depth` deep, within
        its ceiling), so its estimates stay current. Probe rounds are shared (the drafter's
        fixed cost per call is paid once for all of them). While speculation is off
        everywhere they are spaced by what they cost: as often as keeps them within
        `probe_share` of the time (every `min_probe_every` rounds for a lookup that costs
        next to nothing, hundreds apart for a draft model that must first catch up on a long
        sequence); until a probe has measured that, from `probe_every` rounds, doubling up to
        `max_probe_every`. Spaced by what they find as well (`_value_gap`): where probes
        often land in a stretch that pays (a sequence that starts to loop, at T = 0), missing
        it costs more than probing for it."""
        if not self.config.adaptive or self._warming_up():
            return depths
        if any(depths):
            self._probe_interval, self._chain = self.config.probe_every, 0
        # (Not while the drafter is late for as many or fewer, `GoodputCheck.late`: such a probe
        # misses the deadline too. Over HTTP, draft_model disaggregated at c = 16, T = 0, a wave
        # growing from 1 to 16 requests was probed at 6, 15 and 16, ~50 ms each, two of them late.)
        fresh = not any(depths) and not self._draft_cost_at(len(seq_ids))
        fresh = fresh and self.rounds >= self.check.late_until(len(seq_ids))
        if (self.rounds < self._next_probe and not fresh) or self.check.off_probe:
            return depths
        self._draft_octaves.add(len(seq_ids).bit_length())
        # (Depth 1 while the measured check vetoes drafting: it distrusts the model's gains.)
        probe_at = self._probe_depths()
        at = [1 if vetoed else probe_at[self._greedy.get(s, True)] for s in seq_ids]
        probed = [min(d, cap) if k == 0 else k for k, cap, d in zip(depths, ceiling, at, strict=True)]
        if probed != depths:  # a probe round is evidence of neither kind
            self.check.planned = None
        gap, config = self._probe_interval, self.config
        if not any(depths):
            self._probe_interval = min(2 * self._probe_interval, config.max_probe_every)
            # The first probe of a chain measures what probing costs (later ones find the
            # drafter caught up).
            self._probing = self._chain == 0
            off = self.check.off
            if self._probe_extra is not None and off[2] > 0 and off[1] > 0:
                share = self._probe_extra / (config.probe_share * off[1] / off[2])
                gap = min(max(int(share), config.min_probe_every), 4 * config.max_probe_every)
            found = min(
                (
                    g
                    for g in map(self._value_gap, {self._greedy.get(s, True) for s in seq_ids})
                    if g is not None
                ),
                default=None,
            )
            if found is not None:
                gap = max(config.min_probe_every, min(gap, int(found)))
        # Spacing wider than `probe_every` is jittered (x0.5 to x1.5, the same draw for
        # `_respace_probes`): about as long as a request, probes at a fixed spacing landed at
        # the same point of each one, never in the stretches that pay later in it (remote
        # ngram, batch 1, T = 0).
        self._jitter = 0.5 + self._rng.random() if gap > config.probe_every else 1.0
        gap = max(gap if gap <= config.probe_every else config.probe_every, int(gap * self._jitter))
        self._next_probe, self._last_probe = self.rounds + gap, self.rounds
        return probed

    def _draft_cost_at(self, num_seqs: int) -> bool:
        """Whether the draft-cost fit has rows where about this many sequences were asked to
        draft (the same octave). Off everywhere, a batch of a new size is probed at once: at
        batch 1 the cost of a draft step and of a draft token are one term (A = 1 in every
        row, K = m), and the fit priced every draft token as a whole step. A server whose
        first requests came one at a time priced 16 sequences' drafts at 16 steps (~12 ms
        for a step and a half, measured), stayed off at concurrency 16 for ~200 rounds with
        its next probe ~550 rounds away (spaced by what probes cost at batch 1), and ran
        0.91x fixed K = 2 (draft_model over HTTP, T = 0)."""
        return num_seqs.bit_length() in self._draft_octaves

    def _probe_depths(self) -> dict[bool, int]:
        """Each sampling class's probe depth (`_probe_depth`, greedy at least `_greedy_floor`),
        weighed against the last full solve's costs: worked out at the first probe after it
        (most solves are followed by none; at batch 1 this was ~4% of the policy's time)."""
        if self._probe_at is None:
            terms = self._probe_terms
            at = (
                {True: 1, False: 1}
                if terms is None
                else {g: self._probe_depth(g, *terms) for g in (True, False)}
            )
            self._probe_at = at
        return {True: max(self._probe_at[True], self._greedy_floor()), False: self._probe_at[False]}

    def _probe_depth(self, greedy: bool, base_s: float, b: float, ask: float, overhead: float) -> int:
        """The depth (>= 1) with the most committed tokens a second for a sequence known only
        by its class's batch-wide counts, drafting alone. A probe drafts that deep: on this
        CPU a tree with drafts costs ~3 ms beyond a ~2.7 ms round whatever its depth (+0.1 ms
        a token), so a depth-1 probe of a sequence that had started to loop (ngram at T = 0)
        kept 1 token where 4 were there, could not pay for its round, and the ramp back to
        drafting waited on solves with nothing learnt past depth 1. Where the batch-wide
        counts say drafting seldom pays (T = 1) this is depth 1, as before.

        Greedy sequences probe at least `_greedy_floor` deep (`greedy_probe_depth`, 2): their batch-wide counts
        mix the stretches that pay with those that do not, and where those said depth 1, probes
        that landed in a loop kept 2 tokens, could not show that it paid, and the policy stayed
        off through whole looping requests (in-process ngram, batch 1, T = 0, 24 requests of 64
        tokens after 4 of warm-up: off in 888 and 1,586 of ~1,100-1,600 rounds in two runs,
        0.88x and 0.76x fixed K = 8; probing greedy sequences at depth 2, off in 39-54 of ~760
        rounds in three runs, 0.967-0.969x; at the ceiling, 0.96-0.97x, but a lost deep probe
        costs more and probes are spaced by their cost)."""
        (row,) = expected_gains(
            [None],
            self.glob[greedy],
            self.config.prior_strength,
            self.deepest_seen,
            self._tree_nodes / self._tree_depths,
            self._nodes,
        )
        c, e, g, h = self.draft_cost.coefficients()
        seconds = sequence_seconds([row], b, ask, overhead, g, h)[0]
        rates = [row[0][k] / max(base_s + seconds[k] + c + e * k, 1e-9) for k in range(1, len(seconds))]
        best = 1 + max(range(len(rates)), key=rates.__getitem__) if rates else 1
        return best

    def _greedy_floor(self) -> int:
        """The least depth of a greedy probe: `greedy_probe_depth`, unless probes that deep
        kept their drafts and still lost (`ProbeFinds.deep_kept`): a head whose drafts do not
        pay even where the text loops (eagle3, mtp and draft_model chains, suffix decoding in
        `outrider bench`, T = 0) then probes at the depth its counts say, as sampled
        sequences do (with the floor everywhere those cells' drafter time share went from
        0-1.6% to 1.8-2.8%, 0.97-0.99x plain to 0.95-0.97x). That evidence decays with every
        probe, so the floor comes back to look again."""
        f, floor = self._finds[True], min(self.config.greedy_probe_depth, self.ceiling.max_depth)
        if f.deep_kept >= self.config.deep_probe_evidence and f.deep_gain <= 0.0:
            return 1
        return floor

    def _value_gap(self, greedy: bool) -> float | None:
        """The probe spacing that loses least, counting what probes find: a share h of them
        find a stretch where drafting pays (their chain turned speculation on: `_note_find`),
        each of its rounds gaining `gain` plain-equivalent tokens over a round without drafts,
        lasting up to what is left of its sequence (on average half a sequence's life, L); the
        others cost `_probe_extra`. With probes every g rounds such a stretch waits ~g/2 rounds
        to be found, so a round loses h gain g / (2 L) + (1 - h) extra / g, least at
        g = sqrt(2 L (1 - h) extra / (h gain)).

        h counts a pseudo-probe whose find is a prior: for greedy sequences half a find
        (greedy text repeats itself once its context does: 80% of the small demo's greedy
        answers loop, most only after a while, so a few probes near a request's start that
        found nothing do not rule out a stretch that pays later); for sampled ones none
        (sampling breaks loops: there is no stretch to expect before one is found, and the
        cost-based spacing rules until then; with the chance a probe keeps every draft as
        the prior, medusa at T = 1, whose single drafts are often kept but never pay, was
        probed ~100 rounds apart instead of ~250: 2.2% of the time). The pseudo-probe is evidence like the
        others: its weight decays by `probe_find_decay` per probe, so where probes never find
        one, h falls toward 0 and the cost-based spacing takes over (an EAGLE head at T = 0
        on the small demo: its drafts did not pay even in loops, and probes spaced by the
        prior's hope, ~100 rounds apart with a catch-up of the head on each, cost ~5% of the
        time).

        `gain` is the finds' mean (the best probe round of each find's chain), or before any,
        the probes' mean upside (what they would have gained had every draft been kept); then
        capped twice by measurements:
        - what probes that kept at least half their drafts gained, where there are such: a
          stretch that keeps the drafts gains what they did (a draft model at T = 0, batch 16,
          in one process, kept ~80% of its probes' drafts and still lost ~12 plain tokens a
          probe round; spaced by the upside its probes, each catching 16 sequences up, came
          ~20-110 rounds apart and took 20% of the time, adaptive 0.90x plain; an MTP head at
          T = 0 kept every draft of its probes in loops and lost ~1 plain token a probe, its
          catch-up aside, while one early find's best round, +0.8, spaced them ~150 apart);
        - what the rounds the solver drafted in measured per round over rounds without drafts,
          once there are `goodput_min_rounds` of them: a find is worth what the drafting it
          turns on gains, not its best probe (a draft model at T = 0, batch 1: kept probes in
          loops spaced probes ~8 rounds apart, each with the model's catch-up, while the
          drafting they turned on barely paid). (Not after fewer: those may be rounds whose
          drafts were lost before the text looped, which say nothing of a loop's worth; probes
          that kept their drafts do.)
        None until a probe's cost and a sequence's life are measured: the cost-based spacing
        alone. Per sampling class (greedy: True): what greedy probes find says nothing of
        sampled ones."""
        terms = self._find_terms(greedy)
        return None if terms is None else self._gap(*terms)

    def _gap(self, h: float, gain: float, life: float) -> float:
        if h >= 1.0:  # every probe finds one: as often as probes may come
            return 0.0
        return math.sqrt(2.0 * 0.5 * life * (1.0 - h) * self._probe_extra / (h * gain))

    def _find_terms(self, greedy: bool) -> tuple[float, float, float] | None:
        """`_value_gap`'s h, gain and L; None where they are not measured, or nothing is found."""
        f = self._finds[greedy]
        if self._probe_extra is None or f.life is None or f.probes <= 0.0:
            return None
        # (h > 1 where solves turned on without probes)
        h = (f.finds + f.prior * f.prior_weight) / (f.probes + f.prior_weight)
        gain = f.gain / f.finds if f.finds > 0.0 else f.upside / f.probes
        if (
            f.kept_probes >= 1.0
        ):  # what probes that kept their drafts measured: a stretch keeping them gains that
            gain = min(gain, f.kept_gain / f.kept_probes)
        on = self.check.kinds[True]  # what rounds the solver drafted in gained, measured
        if on[2] >= self.config.goodput_min_rounds:
            gain = min(gain, (on[0] - on[1]) / on[2])
        if h <= 0.0 or gain <= 0.0:  # nothing found, or not even a kept probe would pay for its round
            return None
        return h, gain, f.life

    def _probe_loss(self, greedy: bool) -> float | None:
        """What probing alone loses a round (plain-equivalent tokens) at the spacing
        `_value_gap` sets: stretches that pay found late, and probes that find nothing.
        None where it is not measured."""
        terms = self._find_terms(greedy)
        if terms is None:
            return None
        h, gain, life = terms
        gap = max(float(self.config.min_probe_every), self._gap(h, gain, life))
        return min(h, 1.0) * gain * gap / (2.0 * 0.5 * life) + max(1.0 - h, 0.0) * self._probe_extra / gap

    def _respace_probes(self, greedy: bool) -> None:
        """What a class's probes found moved: the next probe is due its `_value_gap` after the
        last one, if that is sooner than planned (a gap set before a measurement was a guess)."""
        found = self._value_gap(greedy)
        if found is not None:
            at = self._last_probe + max(self.config.min_probe_every, int(found * self._jitter))
            if at < self._next_probe:
                self._next_probe, self._calm_until = at, min(self._calm_until, at)

    def _note_probes(
        self, outcomes: Seq[Outcome], committed: int, worth: float, prefill_tokens: int, late: bool = False
    ) -> None:
        """A probe round while off (`committed` tokens, `worth` plain-equivalent ones):
        `_note_probe` for each sampling class it asked, once rounds without drafts are measured.

        A probe whose drafter had nothing for anyone (a lookup that matched nothing: every tree
        root-only) says nothing of what drafts are worth, and is not noted. Noted, its upside
        (nothing drafted) read as drafts not paying, and probes were spaced by cost alone:
        in-process ngram at batch 1, T = 0, the first requests' probes found no match (prose),
        the next probe was set ~500 rounds on, and the policy stayed off through the loops of
        the following requests in about half the runs (0.80-0.85x fixed K = 8).

        The next probe comes `_empty_gap` rounds on at most (from `probe_every`, doubling while
        probes come back empty or lose every draft, up to 4x that), or as far as keeps empty
        probes within `empty_probe_share` (2%) of the time at what they measured to cost
        (`_empty_extra`, in rounds; until one is measured, what any probe cost). Their
        drafter's catching up is left out: it is owed whenever the sequence next drafts,
        however probes are spaced. A remote lookup's empty probe costs its round trip (~2
        plain rounds): probes every 16-64 rounds took the disaggregated ngram at T = 1 from
        0.97-1.01x off to 0.95-0.97x (prose: most probes empty). An in-process one's costs a
        fraction of a round; spaced by what any probe cost (drafted ones verify their drafts
        too), co-located ngram over HTTP at c = 1, T = 0 was off in 18.9% of sequence-rounds
        (4.9% with empty probes every 16-64 rounds) and caught loops late.

        A probe whose drafter missed the round's deadline for all of them (`late`) is not
        empty but lost: it cost the deadline and found nothing, and is noted as such (spaced
        by what it cost, `_probed`)."""
        config, off = self.config, self.check.off
        tried = sum(o[2] for o in outcomes)
        if not (tried or late):
            # No closer than keeps empty probes within `empty_probe_share` of the time by what
            # they measured to cost (their drafter's round trip included), in rounds.
            per_round = off[1] / off[2] if off[2] > 0 and off[1] > 0 else float(len(outcomes))
            if off[2] >= config.off_min_rounds and not prefill_tokens:
                extra = max(0.0, worth - per_round)
                known = self._empty_extra
                self._empty_extra = extra if known is None else 0.5 * (known + extra)
            extra = self._probe_extra if self._empty_extra is None else self._empty_extra
            rounds = 0.0 if extra is None else extra / per_round
            gap = max(self._empty_gap, int(rounds / config.empty_probe_share))
            self._next_probe = min(self._next_probe, self.rounds + gap)
            self._empty_gap = min(2 * self._empty_gap, 4 * config.probe_every)
            return
        kept = sum(o[3] for o in outcomes) / tried if tried else 0.0
        if kept > 0.0:  # (a probe whose drafts were all lost leaves the empty ones' spacing)
            self._empty_gap = config.probe_every
        if off[2] < config.off_min_rounds or off[1] <= 0 or prefill_tokens:
            return
        plain = max(worth, 0.0) * off[0] / off[1]  # what an off round commits in its time
        gain, upside = committed - plain, sum(o[2] + 1 for o in outcomes) - plain
        shallowest: dict[bool, int] = {}  # each class's shallowest ask
        for o in outcomes:
            if o[1]:
                kind = self._greedy.get(o[0], True)
                shallowest[kind] = min(o[1], shallowest.get(kind, o[1]))
        for kind, least in shallowest.items():
            self._note_probe(kind, gain, upside, kept, least >= config.greedy_probe_depth)

    def _note_probe(
        self, greedy: bool, gain: float, upside: float, kept: float = 0.0, deep: bool = False
    ) -> None:
        """A probe round of the class's sequences while speculation was off gained `gain`
        plain-equivalent tokens over a round without drafts (its drafter's catching up aside),
        and would have gained `upside` had every draft been kept; `kept`: the share of its
        drafted tokens that were (a probe keeping at least half is a measured `kept_gain`);
        `deep`: every sequence of the class it asked drafted at least `greedy_probe_depth`."""
        f, d = self._finds[greedy], self.config.probe_find_decay
        held = kept >= 0.5
        f.deep_kept, f.deep_gain = d * f.deep_kept, d * f.deep_gain
        if held and deep:
            f.deep_kept, f.deep_gain = f.deep_kept + 1.0, f.deep_gain + gain
        f.probes, f.finds, f.gain, f.upside, f.prior_weight, f.kept_probes, f.kept_gain = (
            d * f.probes + 1.0,
            d * f.finds,
            d * f.gain,
            d * f.upside + upside,
            d * f.prior_weight,
            d * f.kept_probes + held,
            d * f.kept_gain + (gain if held else 0.0),
        )
        f.chain_gain = max(gain, f.chain_gain if self._chain else gain)  # a chain's best round
        self._respace_probes(greedy)

    def _note_find(self, greedy: bool) -> None:
        """A solve turned speculation on after it was off, for a batch with the class's
        sequences: what their probes found."""
        f = self._finds[greedy]
        f.finds += 1.0
        f.gain += f.chain_gain if f.chain_gain > 0.0 else f.upside / max(f.probes, 1.0)
        f.chain_gain = 0.0
        self._respace_probes(greedy)

    def _note_life(self, greedy: bool, tokens: int) -> None:
        """A finished sequence of the class decoded `tokens` (rounds, where it was off): its
        life, for L."""
        f = self._finds[greedy]
        f.life = float(tokens) if f.life is None else 0.9 * f.life + 0.1 * tokens
        # The first life measured lets finds space probes: a probe set far off by cost alone
        # (before any sequence finished) is brought in (in-process ngram, batch 1, T = 0: the
        # first request, prose, set the next probe ~500-1000 rounds on, and the policy stayed
        # off through the loops of the next ~15 requests in about half the runs).
        self._respace_probes(greedy)


@dataclass
class ProbeFinds:
    """What probes found (`Probing._value_gap`), decayed per probe: probe rounds while off,
    the finds among them, the finds' gain and the probes' upside; the mean life of finished
    sequences in tokens (None: none yet); the best gain of a probe round in the current chain;
    the prior chance of a find, and the weight of that pseudo-probe (decayed with the others)."""

    probes: float = 0.0
    finds: float = 0.0
    gain: float = 0.0
    upside: float = 0.0
    life: float | None = None
    chain_gain: float = 0.0
    prior: float = 0.5  # a pseudo-probe's find (`_value_gap`): greedy 0.5, sampled 0
    prior_weight: float = 1.0
    kept_probes: float = 0.0  # probes that kept at least half their drafted tokens
    kept_gain: float = 0.0  # and what they gained
    deep_kept: float = 0.0  # of those, probes at least `greedy_probe_depth` deep (`_greedy_floor`)
    deep_gain: float = 0.0  # and what they gained
