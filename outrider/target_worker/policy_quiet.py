"""Quiet rounds: rounds the speculation policy (`spec_policy.SpeculationPolicy`) knows are off
for every sequence with nothing to decide, so the engine sends no budgets and the policy only
measures the round (docs/algorithms.md section 2c).

A mixin of `SpeculationPolicy`, whose state it reads and sets: the schedule of solves and
probes (`_next_probe`, `_next_solve`, `_calm_until`), the goodput check, the cost fits. It
measures the rounds that are not quiet as well (`_measure`, `_timed`), and asks the goodput
check's veto once a round for both (`_vetoed`, `_checked`).

Inside a calm stretch (quiet until `_calm_until`) a round costs the policy a comparison in
`quiet` and an append in `observe_quiet`: its measurements are logged and folded into the
goodput check and the cost fits in one vectorised pass (`_fold_quiet`) before anything reads
them (the next `budgets`, `quiet` past the stretch, `observe`). Folded
in order, they leave the same sums as round by round. Measured at batch 1 on the small demo
(suffix, T = 1, speculation off), the per-round path it replaces cost ~30 us of a ~1.45 ms
round, ~2% beside plain decoding.
"""

from __future__ import annotations

import numpy as np

# Logs of at most this many quiet rounds are folded row by row (`_fold_quiet_rows`): at
# batch 1 ~5 us a row that way, ~8 us a row for 50 rows at once with numpy (its fixed cost per
# call, ~0.4 ms a fold).
SCALAR_FOLD = 128


class Quiet:
    def quiet(self, num_seqs: int, arrived: bool = False) -> bool:
        """Whether next round is off for every sequence with nothing to decide: speculation is
        off, no solve, probe or shadow is due, and no sequence could draft deeper than the last
        solve weighed. Then the engine sends no budgets and `observe_round` only measures the
        round (the full path cost ~2% of a round without drafts at batch 1). Counted as `budgets` would.

        `arrived`: a sequence among them decodes for the first time. While off everywhere it
        is decided for at once (a solve, at most every `resolve_every` rounds): it is known by
        its class's batch-wide counts alone, which may say its drafts pay where the sequences
        the last solve weighed did not (unseen in a calm stretch, a new request at batch 1
        waited for the next probe, up to ~64 rounds: most of a 64-token request)."""
        stats = self.stats
        if arrived and self._solved is not None and self._solved[0] == 0:
            soonest = self._arrival_solve + self.config.resolve_every
            if self.rounds >= soonest and self._next_solve > self.rounds:
                self._next_solve, self._arrival_solve = self.rounds, self.rounds
                self._calm_until = min(self._calm_until, self.rounds)
        calm = self.rounds < self._calm_until and self._draft_cost_at(num_seqs)  # (nothing it reads moved)
        if self._quiet and num_seqs and calm:
            stats.depth_counts[0] += num_seqs
            stats.rounds_off += 1
            stats.vetoed_rounds += self.rounds < self.check.vetoed_until(num_seqs)
            return True
        self._fold_quiet()
        self._quiet = False
        if not (self.config.adaptive and num_seqs) or (self._shadow_pays and True in self._kinds):
            return False  # (shadow drafts to ask for: `policy_shadow`)
        vetoed = self._vetoed(num_seqs, keep=True)
        calm = (
            self._off(vetoed)
            and self.rounds < self._next_probe
            and self._solved_cap >= self.ceiling.max_depth
            and self._draft_cost_at(num_seqs)
        )
        if calm:  # off until the next probe or solve, or, if only vetoed, the veto's end
            until = min(self._next_probe, self._next_solve)
            self._calm_until = until if self._all_off() else min(until, self.check.vetoed_until(num_seqs))
            self._quiet = True
            self.check.planned, self.check.off_probe = False, False
            stats.depth_counts[0] += num_seqs
            stats.rounds_off += 1
            stats.vetoed_rounds += vetoed
        return calm

    def _vetoed(self, num_seqs: int, keep: bool = False) -> bool:
        """The goodput check's veto this round for `num_seqs` sequences; asked by `quiet` (`keep`), then by
        `budgets`, which takes that answer (nothing it reads moves between them) instead of asking again."""
        asked, self._veto_asked = self._veto_asked, (-1, False)
        if asked[0] == self.rounds:
            vetoed = asked[1]
        else:
            adaptive = self.config.adaptive and not self._warming_up()
            vetoed = adaptive and self.check.vetoed(self.rounds, num_seqs)
        if keep:
            self._veto_asked = (self.rounds, vetoed)
        return vetoed

    def _checked(self, depths: list[int], vetoed: bool) -> list[int]:
        if not self.config.adaptive or self._warming_up():
            self.check.planned, self.check.off_probe = None, False
            return depths
        return self.check.checked(depths, vetoed, self.rounds)

    def observe_quiet(
        self, num_seqs: int, prefill_tokens: int, round_s: float, forward_s: float | None = None
    ) -> None:
        """`observe` for a round `quiet` announced: nobody was asked to draft, so each sequence
        committed its root's token. Logged, for `_fold_quiet`."""
        self.rounds += 1
        self._quiet_log.append(
            (num_seqs, prefill_tokens, round_s, np.nan if forward_s is None else forward_s)
        )
        self._sent = 0
        if len(self._quiet_log) >= 1024:  # (bounds the fold's weights: `CostFit.add_rows`)
            self._fold_quiet()

    def _measure(
        self, num_seqs: int, committed: int, seconds: float, prefill_tokens: int
    ) -> tuple[float, float]:
        """A round's goodput evidence (`_vetoed`): its worth in plain-equivalent tokens (what plain
        decoding would have committed in its time: B tokens per verify(B)), and verify(B)."""
        self.rounds += 1
        plain_s = self.verify_cost.plain_seconds(num_seqs)
        worth = seconds * num_seqs / (plain_s if plain_s > 0 else 1.0)
        if self.verify_cost.knows(num_seqs):  # (else verify(B) is extrapolated: no evidence)
            self.check.record(committed, worth, prefill_tokens, num_seqs)
        off = self.check.off
        if self._probing and not prefill_tokens and off[2] > 0:
            extra = max(0.0, worth - off[1] / off[2])
            self._probe_extra = extra if self._probe_extra is None else 0.5 * (self._probe_extra + extra)
        self._probing = False
        return worth, plain_s

    def _timed(self, deepest_budget: int, seconds: float, features: tuple, drafts: tuple) -> None:
        """A decode round's seconds against what the cost fits predicted for it (`RoundCost`'s
        and the draft-cost fit's features), for `GoodputCheck.scale`, as `_fold_quiet` times
        quiet rounds. Not before the first solve (until then the fits predict nothing), nor at
        batch 1, where the scale is not used (no work on that hot path, and its rounds do not
        blur the scale of small forwards at B > 1)."""
        if self._solved is None or features[3] < 2:  # (the scale is for B > 1 only)
            return
        predicted = self.verify_cost.predict(features)
        if deepest_budget > 0:
            predicted += self.draft_cost.predict(drafts)
        self.check.timed(features[0], seconds, predicted, self.rounds)

    def _fold_quiet(self) -> None:
        """The logged quiet rounds' measurements, as `_measure` and `observe` would have taken
        them one by one: their worth (at the cost fit's verify(B), unchanged while quiet: the
        fits are solved only in `budgets`) into the goodput check, their times into the fits."""
        if not self._quiet_log:
            return
        if len(self._quiet_log) <= SCALAR_FOLD:
            return self._fold_quiet_rows()
        rounds = np.array(self._quiet_log)
        self._quiet_log.clear()
        n, prefill, seconds, forward = rounds.T
        decode = prefill == 0
        # Fitted first: a batch size the fit had not seen is refitted before it is priced.
        self.verify_cost.add_rows(n + prefill, n, seconds, forward, decode)
        plain_s = self.verify_cost.plain_seconds(n)
        worth = seconds * n / np.where(plain_s > 0, plain_s, 1.0)
        self.check.record_rows(n[decode], worth[decode], n[decode])  # (prompt chunks would blur the rate)
        timed = decode & (n > 1)  # (`_timed`)
        if self._solved is not None and timed.any():
            self.check.timed_rows(n[timed], seconds[timed], plain_s[timed], self.rounds)
        self._probing = False

    def _fold_quiet_rows(self) -> None:
        """`_fold_quiet` of a short log, row by row: the same sums, without numpy's fixed cost
        per call (in-process ngram at batch 1, T = 1, speculation off: folds of 2-63 rounds,
        ~15 us a round of the policy's ~22 that way)."""
        log, fits, check = list(self._quiet_log), self.verify_cost, self.check
        self._quiet_log.clear()
        for n, prefill, seconds, forward in log:
            fits.add((n + prefill, 0, 0, n), seconds, None if forward != forward else forward, prefill > 0)
        first = self.rounds - len(log) + 1
        for i, (n, prefill, seconds, _) in enumerate(log):
            if prefill:  # (prompt chunks would blur the rate)
                continue
            plain_s = fits.plain_seconds(n)
            check.record(n, seconds * n / (plain_s if plain_s > 0 else 1.0), 0, n)
            if self._solved is not None and n > 1:  # (`_timed`)
                check.timed(n, seconds, plain_s, first + i)
        self._probing = False
