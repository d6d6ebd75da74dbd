"""Quiet rounds: rounds the speculation policy (`spec_policy.SpeculationPolicy`) knows are off
for every sequence with nothing to decide, so the engine sends no budgets and the policy only
measures the round (docs/algorithms.md section 2c).

A mixin of `SpeculationPolicy`, whose state it reads and sets: the schedule of solves and
probes (`_next_probe`, `_next_solve`, `_calm_until`), the goodput check, the cost fits.

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


class Quiet:
    def quiet(self, num_seqs: int) -> bool:
        """Whether next round is off for every sequence with nothing to decide: speculation is
        off, no solve, probe or shadow is due, and no sequence could draft deeper than the last
        solve weighed. Then the engine sends no budgets and `observe_round` only measures the
        round (the full path cost ~2% of a round without drafts at batch 1). Counted as `budgets` would."""
        stats = self.stats
        if self._quiet and num_seqs and self.rounds < self._calm_until:  # (nothing it reads has moved)
            stats.depth_counts[0] += num_seqs
            stats.rounds_off += 1
            stats.vetoed_rounds += self.rounds < self.check.veto_until
            return True
        self._fold_quiet()
        self._quiet = False
        if not (self.config.adaptive and num_seqs) or (self._shadow_pays and True in self._kinds):
            return False  # (shadow drafts to ask for: `policy_shadow`)
        vetoed = self._vetoed()
        calm = (
            self._off(vetoed)
            and self.rounds < self._next_probe
            and self._solved_cap >= self.ceiling.max_depth
        )
        if calm:  # off until the next probe or solve, or, if only vetoed, the veto's end
            until = min(self._next_probe, self._next_solve)
            self._calm_until = until if self._all_off() else min(until, self.check.veto_until)
            self._quiet = True
            self.check.planned, self.check.off_probe = False, False
            stats.depth_counts[0] += num_seqs
            stats.rounds_off += 1
            stats.vetoed_rounds += vetoed
        return calm

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

    def _fold_quiet(self) -> None:
        """The logged quiet rounds' measurements, as `_measure` and `observe` would have taken
        them one by one: their worth (at the cost fit's verify(B), unchanged while quiet: the
        fits are solved only in `budgets`) into the goodput check, their times into the fits."""
        if not self._quiet_log:
            return
        rounds = np.array(self._quiet_log)
        self._quiet_log.clear()
        n, prefill, seconds, forward = rounds.T
        plain_s = self.verify_cost.plain_seconds(n)
        worth = seconds * n / np.where(plain_s > 0, plain_s, 1.0)
        decode = prefill == 0
        self.check.record_rows(n[decode], worth[decode])  # (prompt chunks would blur the rate)
        self.verify_cost.add_rows(n + prefill, n, seconds, forward, decode)
        self._probing = False
