"""Quiet rounds: rounds the speculation policy (`spec_policy.SpeculationPolicy`) knows are off
for every sequence with nothing to decide, so the engine sends no budgets and the policy only
measures the round (docs/algorithms.md section 2c).

A mixin of `SpeculationPolicy`, whose state it reads and sets: the schedule of solves and
probes (`_next_probe`, `_next_solve`, `_calm_until`), the goodput check, the cost fits.
"""

from __future__ import annotations


class Quiet:
    def quiet(self, num_seqs: int) -> bool:
        """Whether next round is off for every sequence with nothing to decide: speculation is
        off, no solve, probe or shadow is due, and no sequence could draft deeper than the last
        solve weighed. Then the engine sends no budgets and `observe_round` only measures the
        round (the full path cost ~2% of a round without drafts at batch 1). Counted as `budgets` would."""
        self._quiet = False
        if not (self.config.adaptive and num_seqs) or (self._shadow_pays and True in self._kinds):
            return False  # (shadow drafts to ask for: `policy_shadow`)
        if self.rounds < self._calm_until:  # nothing it depends on moves before then
            calm, vetoed = True, self.check.vetoed(self.rounds)  # (may start a veto: counted alike)
        else:
            vetoed = self._vetoed()
            calm = (
                self._off(vetoed)
                and self.rounds < self._next_probe
                and self._solved_cap >= self.ceiling.max_depth
            )
            if calm:  # off until the next probe or solve, or, if only vetoed, the veto's end
                until = min(self._next_probe, self._next_solve)
                self._calm_until = until if self._all_off() else min(until, self.check.veto_until)
        self._quiet = calm
        if calm:
            self.check.planned, self.check.off_probe = False, False
            self.stats.depth_counts[0] += num_seqs
            self.stats.rounds_off += 1
            self.stats.vetoed_rounds += vetoed
        return calm

    def observe_quiet(
        self,
        num_seqs: int,
        committed: int,
        forward_tokens: int,
        round_s: float,
        prefill_tokens: int,
        forward_s: float | None = None,
    ) -> None:
        """`observe` for a round `quiet` announced: no sequence was asked to draft."""
        self._measure(num_seqs, committed, round_s, prefill_tokens)
        self.verify_cost.add((forward_tokens, 0, 0), round_s, forward_s, prefill_tokens > 0)
        self._sent = 0
