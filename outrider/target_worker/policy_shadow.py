"""Shadow drafts: what a greedy sequence the policy turned off would have kept, scored in
hindsight (docs/algorithms.md section 2c).

At T = 0 whether a draft is kept is known without verifying it: a chain keeps the longest
prefix that matches what the target then commits. So a greedy sequence that is off can still
be asked for a short draft (`config.shadow_depth` tokens) whose tree is dropped before the
forward (verified root-only: the round costs what a round without drafts costs, plus the
drafter's answer), and scored against the tokens the sequence commits over the next rounds.
The outcome feeds the sequence's own counts as a draft would, and a kept shadow asks for a
solve at once. Probes (`policy_probes`) find the stretches where drafting pays (a sequence
that starts to loop) only as often as they are spaced; a shadow finds them within
`shadow_depth` rounds. With the small demo's ngram drafter at batch 1 over HTTP, fixed K = 8
beat the policy by 4-9% at T = 0 because probes spaced ~10 rounds apart found loop onsets late.

Shadowing is used only while it pays: its measured cost in plain-equivalent tokens per round
must be below what probing alone loses per round at its spacing (`Probing._probe_loss`). The
cost is measured whole, in rounds that asked only shadows: the drafter's answer waited for
plus the round's time beyond verify(B) (asking, the answer's checks, the trees set aside), per
shadowed sequence. Until `SHADOW_TRIAL` such rounds are measured shadows are tried wherever
probing loses something, for at most 4 x `SHADOW_TRIAL` rounds that ask any. (Priced before
through the verify fit's per-sequence `ask` term, which moves with the per-drafted one, every
asked sequence drafting: the fit split them 0.58 / 0.30 ms in one run and 0.05 / 0.69 in the
next, and shadows whose answer was waited for 50-60 us never ran.) A drafter on another machine, or a draft model, costs more than it
could find there; a lookup in the target's process next to nothing.

A mixin of `SpeculationPolicy`, whose state it reads (`config`, `seqs`, `glob`, the cost fits).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from outrider.proto import CandidateTree
from outrider.target_worker.policy_estimates import DraftCounts
from outrider.target_worker.round_plan import root_only_tree

if TYPE_CHECKING:
    from outrider.target_worker.sequence import Sequence


SHADOW_TRIAL = 4  # shadow-only rounds measured before their cost decides (`_shadow_worth`)


class Shadowing:
    def _init_shadows(self) -> None:
        self.shadowed: set[int] = set()  # sequences asked for a shadow draft this round
        self._shadows: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (position, draft tokens)
        # Measured seconds per shadowed sequence of rounds that asked only shadows (their wait
        # and their time beyond verify(B)), averaged; and how many such rounds measured it.
        self._shadow_s = 0.0
        self._shadow_rounds = 0
        self._shadow_tries = 0  # rounds that asked any shadow
        self._shadow_pays = False  # whether shadowing paid when `budgets` last asked

    def _shadow(self, seq_ids: Seq[int], depths: list[int], ceiling: list[int], num_seqs: int) -> None:
        """Which off greedy sequences get a shadow draft next round (`shadowed`)."""
        off = [
            s
            for s, k, cap in zip(seq_ids, depths, ceiling, strict=True)
            if k == 0 and cap > 0 and self._greedy.get(s, True)
        ]  # (weighed only where some greedy sequence is off: `budgets` runs every round)
        self._shadow_pays = bool(off) and self.config.adaptive and not self._warming_up()
        self._shadow_pays = self._shadow_pays and self._shadow_worth(num_seqs)
        # (not on an off probe: it measures rounds without drafts, and a shadow's answer is waited for)
        shadowing = self._shadow_pays and not self.check.off_probe
        self.shadowed = {s for s in off if s not in self._shadows} if shadowing else set()

    def _shadow_worth(self, num_seqs: int) -> bool:
        """Shadowing's cost in plain-equivalent tokens a round is below what probing loses
        (until `SHADOW_TRIAL` shadow-only rounds measured it: tried wherever probing loses)."""
        loss = self._probe_loss(True)
        if loss is None:
            return False
        plain_s = self.verify_cost.plain_seconds(num_seqs)
        if plain_s <= 0:
            return False
        if self._shadow_rounds < SHADOW_TRIAL:
            # Tried, but not for good where rounds seldom ask shadows alone (a batch with
            # drafts or prompt chunks beside them): unmeasured, they could cost anything.
            return self._shadow_tries < 4 * SHADOW_TRIAL
        return max(self._shadow_s, 0.0) * num_seqs * num_seqs / plain_s < loss

    def shadow_trees(
        self, ready: Seq[Sequence], trees: list[CandidateTree], round: int
    ) -> list[CandidateTree]:
        """The shadowed sequences' trees kept aside (their draft chains, for scoring) and
        replaced with root-only ones: nothing of them is verified."""
        if not self.shadowed:
            return trees
        out = list(trees)
        for i, seq in enumerate(ready):
            if seq.seq_id in self.shadowed:
                chain = _chain(out[i])
                if chain:
                    self._shadows[seq.seq_id] = (len(seq.tokens), chain)
                out[i] = root_only_tree(seq, round)
        return out

    def _shadow_round(
        self, verified: Seq[Sequence], draft_wait_s: float, round_s: float, prefill: bool
    ) -> list[int]:
        """A round's verified sequences' budget depths, shadows' as 0 (asked, not verified); the
        shadows it settles are scored, and if it asked only shadows (and ran no prompt chunk),
        what it cost beyond verify(B) is theirs."""
        self._score_shadows(verified)
        shadowed = self.shadowed
        budgets = [0 if s.budget is None or s.seq_id in shadowed else s.budget.max_depth for s in verified]
        self._shadow_tries += bool(shadowed)
        if shadowed and not any(budgets) and not prefill and self.verify_cost.knows(len(verified)):
            extra = draft_wait_s + round_s - self.verify_cost.plain_seconds(len(verified))
            per_seq = extra / max(1, sum(s.seq_id in shadowed for s in verified))
            self._shadow_rounds += 1
            weight = max(0.1, 1.0 / self._shadow_rounds)  # the mean of the first ten, then decayed
            self._shadow_s += weight * (per_seq - self._shadow_s)
        return budgets

    def _score_shadows(self, verified: Seq[Sequence]) -> None:
        """Each pending shadow whose outcome the committed tokens now settle (a token that
        differs, or the whole chain matched) goes into its sequence's counts as a draft would;
        a kept one asks for a solve next round."""
        if not self._shadows:
            return
        config, kept_any = self.config, False
        for seq in verified:
            pending = self._shadows.get(seq.seq_id)
            if pending is None:
                continue
            position, chain = pending
            committed = seq.tokens[position : position + len(chain)]
            kept = 0
            while kept < len(committed) and committed[kept] == chain[kept]:
                kept += 1
            if kept == len(committed) and len(committed) < len(chain):
                continue  # not settled yet: every token so far matched
            del self._shadows[seq.seq_id]
            glob = self.glob[True]
            own = self.seqs.setdefault(seq.seq_id, DraftCounts.empty(glob.depth))
            own.add(len(chain), len(chain), kept, config.sequence_decay)
            glob.add(len(chain), len(chain), kept, config.global_decay)
            self.stats.shadow_drafts += 1
            self.stats.shadow_kept += kept
            kept_any |= kept > 0
        if kept_any:
            self._next_solve = min(self._next_solve, self.rounds)

    def _forget_shadow(self, seq_id: int) -> None:
        self._shadows.pop(seq_id, None)
        self.shadowed.discard(seq_id)


def _chain(tree: CandidateTree) -> list[int]:
    """The draft tokens along the tree's first root-to-leaf path (a chain: all of them)."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    chain, at = [], 0
    for i in range(1, len(parents)):
        if parents[i] == at:
            chain.append(tokens[i])
            at = i
    return chain
