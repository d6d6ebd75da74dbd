"""How much each sequence drafts next round: the speculation policy (docs/algorithms.md section 2c).

Speculation pays only when the tokens it adds are worth more than the time it costs, and both
change with the batch, the sequence and the hardware. Every round the engine asks the policy
for each decoding sequence's TreeBudget (depth k; k = 0 verifies the root only), chosen so the
batch's expected committed tokens per second is highest:

    tokens(k_s)  = 1 + sum_{i=1..k_s} prod_{d=1..i} delta_s,d alpha_s,d   survival along the draft
    seconds      = verify(N, B, A, D) + draft(max_s k_s, U, sum_s k_s)   N = sum_s nodes_s(k_s) + prefill
    maximise       sum_s tokens(k_s) / seconds

- alpha_s,d: the chance a draft reaching depth d - 1 also keeps depth d, and delta_s,d the
  chance the drafter drafts depth d at all when its budget allows, per sequence, shrunk
  toward the batch-wide estimates while the sequence is new; nodes_s(k) is the depth the
  drafter is expected to fill times the nodes per depth its trees carried (at most the
  budget's): a drafter that mostly proposes nothing, or narrower trees than allowed, costs
  what it drafts (`policy_estimates.expected_gains`);
- verify(N, B, A, D) = a + b N + u B + j J + r A + s D: a round's seconds outside `collect`
  against the tokens its forward carries (prefill chunks included), the B sequences it
  verifies (u: what each costs whatever it drafts, a served replica streaming its chunk
  meanwhile), whether a lone sequence's forward carries drafts (J: one row is a
  matrix-vector product, more a matrix product), the A sequences asked to draft and the D
  of them whose trees carry drafts, fitted online (non-negative least squares);
  draft(m, U, K) = c + e m + g U + h K: the time the engine waits in `collect` when the
  deepest budget is m, the drafter was sent U tokens to catch up on (a sequence drafting
  every round sends what it committed) and asked for K draft tokens in all (a batched draft
  model's step costs more with more rows), 0 when no sequence drafts;
- Dinkelbach's iteration finds the maximum; sequences not speculating are probed on shared
  rounds spaced by what a probe costs, as deep as pays for a sequence known only by the
  batch-wide counts (`_probed`, `_probe_depth`), and greedy ones, where it pays, shadowed:
  a short draft scored in hindsight, never verified (`policy_shadow`); the model is checked
  against measured goodput, and vetoed where drafting measures less than not (`_vetoed`).

`fixed` is vLLM's behaviour: every sequence drafts the ceiling each round.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from outrider.proto import CandidateTree, TreeBudget, shared_budget
from outrider.target_worker.policy_config import PolicyConfig, PolicyStats
from outrider.target_worker.policy_costs import CostFit, RoundCost
from outrider.target_worker.policy_estimates import (
    DraftCounts,
    Outcome,
    Row,
    RowSeconds,
    dinkelbach,
    expected_gains,
    forwarded,
    moved,
    spread_prior,
)
from outrider.target_worker.policy_goodput import GoodputCheck
from outrider.target_worker.policy_probes import ProbeFinds, Probing
from outrider.target_worker.policy_quiet import Quiet
from outrider.target_worker.policy_shadow import Shadowing
from outrider.target_worker.round_plan import RoundPlan, tree_depth

if TYPE_CHECKING:
    from outrider.kernels import VerifyOutput
    from outrider.target_worker.sequence import Sequence

NO_DRAFT = TreeBudget(max_nodes=1, max_depth=0, top_k=0)


class SpeculationPolicy(Probing, Shadowing, Quiet):
    def __init__(self, ceiling: TreeBudget, config: PolicyConfig | None = None):
        self.ceiling, self.config = ceiling, config or PolicyConfig()
        depth = max(ceiling.max_depth, 1)
        # Batch-wide counts per sampling class (greedy: True): what greedy sequences keep says
        # little about sampled ones, and a prior learnt at T = 0 must not carry to T = 1.
        self.glob = {True: DraftCounts.empty(depth), False: DraftCounts.empty(depth)}
        self.seqs: dict[int, DraftCounts] = {}
        self._keep_prior = dict.fromkeys((True, False), self.config.prior_strength)  # (`_gains`)
        self._greedy: dict[int, bool] = {}
        # Round seconds (collect aside) = a + b * tokens in the forward + r * sequences asked to
        # draft (their deltas, answers, bookkeeping) + s * sequences whose tree has drafts (its
        # packing, walk, ...); collect seconds = c + e * deepest budget + g * tokens the
        # drafter was sent (a probe after a long pause catches up on them all) + h * draft
        # tokens asked for (the budgets' depths summed).
        self.verify_cost = RoundCost(self.config.cost_decay)
        self.draft_cost = CostFit(3, self.config.cost_decay)
        self._sent = 0  # tokens sent with the requests the next collect answers
        # The round of the draft-cost fit's last row; A.bit_length() of its rows, A sequences asked.
        self._drafted_round, self._draft_octaves = 0, set[int]()  # (`_draft_cost_at`)
        self.deepest_seen = 0  # the drafter may draft less than the ceiling: never plan past it + 1
        # Decayed: draft nodes the trees carried, and their depths. Their ratio is the drafter's
        # width (a lookup's tree is as wide as its matches, not its budget): a tree's expected
        # nodes are its expected depth times it. Starts as one tree of the ceiling's width.
        self._tree_nodes, self._tree_depths = (ceiling.max_nodes - 1) / depth, 1.0
        self.rounds = 0
        self._solved: tuple[int, float] | None = None  # (deepest budget, ratio) of the last full solve
        self._solve_interval, self._next_solve = self.config.resolve_every, 0
        self._solved_cap, self._arrival_solve = 0, -(1 << 30)  # (the last, by an arrival: `quiet`)
        self._lam = 0.0  # the last choice's rate (committed tokens a second)
        self._probe_interval, self._next_probe = self.config.probe_every, 0
        self._last_probe, self._jitter = 0, 1.0  # the round of the last probe, its spacing's jitter
        self._rng, self._chain = random.Random(0), 0  # _chain: kept probes in a row since last on
        # Probe rounds while off: whether the planned round is one, and what a probe round
        # costs beyond a round without drafts (plain-equivalent tokens, as `check`; catching
        # the drafter up included: probes spaced wider catch up on more, so a drafter whose
        # catching up alone costs more than `probe_share` is probed at the widest spacing;
        # `_empty_extra`: the same for probes the drafter had nothing for, its catching up aside).
        self._probing, self._probe_extra, self._empty_extra = False, None, None  # None: not measured yet
        self._empty_gap = self.config.probe_every  # the next probe's spacing after an empty one
        # What probes found, per sampling class, for their spacing (`_value_gap`); the prior
        # find of a greedy probe is half a find, of a sampled one none.
        self._finds = {True: ProbeFinds(prior=0.5), False: ProbeFinds(prior=0.0)}
        self._kinds: set[bool] = set()  # the sampling classes of the last `budgets` batch
        # What a probe's depth is weighed against (`_probe_depths`): the cost terms of the last
        # full solve (None: none yet, depth 1), and the depths worked out from them (None: not yet).
        self._probe_terms: tuple[float, float, float, float] | None = None
        self._probe_at: dict[bool, int] | None = None
        self._gain_rows: dict[int, tuple[int, Row]] = {}  # seq_id -> (round, its `_gains` rows)
        self._gains_version = 0  # bumped whenever a row of `_gain_rows` is recomputed
        self._choice: tuple[tuple, list[int]] = ((), [])  # (what it was chosen from, the depths)
        self._seconds = RowSeconds()  # each row's `sequence_seconds`, kept while it is
        self._next_fit = 0  # the round from which a solve refits the cost fits
        self._veto_asked = (-1, False)  # (the round, `quiet`'s `_vetoed` answer)
        self.stats = PolicyStats(depth_counts=[0] * (depth + 1))
        self.check = GoodputCheck(self.config, self.stats)  # measured goodput (`policy_goodput`)
        self._predicted: dict[int, float] = {}
        # The next round was announced `quiet`; `quiet` holds before `_calm_until` without deciding again.
        self._quiet, self._calm_until = False, 0
        self._quiet_log: list[tuple[float, float, float, float]] = []  # (`policy_quiet`)
        width = (ceiling.max_nodes - 1) / depth if ceiling.max_depth else 0.0
        self._nodes = [1 + min(ceiling.max_nodes - 1, k * width) for k in range(depth + 1)]
        self._node_counts = [int(round(n)) for n in self._nodes]  # a depth's budget nodes
        self._init_shadows()  # (`policy_shadow`)

    # ---- what the engine asks ------------------------------------------------------------

    def budgets(
        self,
        seq_ids: Seq[int],
        limits: Seq[TreeBudget],
        prefill_tokens: int,
        greedy: Seq[bool] | None = None,
    ) -> list[TreeBudget]:
        """Next round's budget per sequence; `limits` are each one's own ceiling (rows, max_tokens);
        `greedy`, whether each decodes greedily (its batch-wide prior; None: all greedy)."""
        self._fold_quiet()
        self._quiet, self._calm_until = False, 0
        if not seq_ids:
            return []
        if greedy is not None:
            self._greedy.update(zip(seq_ids, greedy, strict=True))
        self._kinds = {self._greedy.get(s, True) for s in seq_ids}
        ceiling = [max(0, min(self.ceiling.max_depth, limit.max_depth)) for limit in limits]
        if self._solved is not None and max(ceiling) > self._solved_cap:
            # The last solve saw only sequences near their end, capped by the tokens they had
            # left: not this batch's answer (it held each next request off; docs 2c).
            self._next_solve = min(self._next_solve, self.rounds)
        vetoed = self._vetoed(len(seq_ids))
        if not self.config.adaptive:  # fixed K: nothing to decide, nor to predict
            depths, predicted = ceiling, [None] * len(seq_ids)
        elif self._off(vetoed):  # speculation does not pay: no solve
            self.check.planned, self.check.off_probe = False, False
            self.stats.vetoed_rounds += vetoed
            depths = self._probed(seq_ids, [0] * len(seq_ids), ceiling, vetoed)
            predicted = [
                1.0 if k == 0 else self._gain([s])[0][0][k] for s, k in zip(seq_ids, depths, strict=True)
            ]
        else:
            rows = self._gain(seq_ids)
            # Between solves the choice moves only with the estimates or the batch.
            key = (tuple(seq_ids), tuple(ceiling), prefill_tokens, self._gains_version, self._solved)
            if self._due() or self._warming_up() or key != self._choice[0]:
                choice = self._depths(rows, ceiling, prefill_tokens)
                key = (*key[:4], self._solved)  # a solve just now moved it
                self._choice = (key, choice)
            depths = self._probed(seq_ids, self._checked(list(self._choice[1]), vetoed), ceiling, vetoed)
            predicted = [row[0][k] for row, k in zip(rows, depths, strict=True)]
        self._shadow(seq_ids, depths, ceiling, len(seq_ids))
        out = []
        for seq_id, limit, k, tokens in zip(seq_ids, limits, depths, predicted, strict=True):
            self.stats.depth_counts[k] += 1
            if tokens is not None:
                self._predicted[seq_id] = tokens
            if k == 0 and seq_id not in self.shadowed:
                out.append(NO_DRAFT)
            else:  # (k = 0: a shadow draft, verified root-only and scored in hindsight)
                k = k or min(self.config.shadow_depth, len(self._node_counts) - 1)
                nodes = min(limit.max_nodes, self._node_counts[k])
                out.append(shared_budget(nodes, k, limit.top_k, limit.q_width))
        if not any(depths):
            self.stats.rounds_off += 1
        return out

    def observe(
        self,
        outcomes: Seq[Outcome],  # (seq_id, budget depth, tree depth, accepted, committed)
        forward_tokens: int,
        round_s: float,
        deepest_budget: int,
        draft_wait_s: float,
        prefill_tokens: int = 0,
        draft_nodes: Seq[int] | None = None,
        forward_s: float | None = None,
        missing: int = 0,
    ) -> None:
        """One round's evidence: each verified sequence's draft outcome, and what it cost;
        `draft_nodes`, each tree's nodes below the root (None: chains, as deep as many);
        `forward_s`, the part of `round_s` the forward and verification took (`RoundCost`);
        `missing`, the trees asked for that did not come by the round's deadline."""
        self._fold_quiet()
        config = self.config
        committed = sum(o[4] for o in outcomes)
        shadows = sum(o[0] in self.shadowed for o in outcomes)  # asked as well (`policy_shadow`)
        shadow_only = shadows and not deepest_budget  # (budgets' depths count shadows as 0)
        if shadow_only:  # the drafter's answer was waited for: no round without drafts (docs 2c)
            self.check.planned = None
        worth, plain_s = self._measure(len(outcomes), committed, round_s + draft_wait_s, prefill_tokens)
        off = self.check.off
        # Whether this round (a probe, while speculation is off) measured at least the goodput
        # of rounds without drafts (true until those are measured), but for the drafter's
        # catching up on every token since the last probe: the pause's cost, not drafting's.
        worth -= self.draft_cost.coefficients()[2] * self._sent * len(outcomes) / (plain_s or 1.0)
        probe_paid = off[2] < config.off_min_rounds or committed * off[1] >= off[0] * max(worth, 0.0)
        late = missing > 0 and missing >= sum(o[1] > 0 for o in outcomes) + shadows  # every tree asked missed
        if self._solved is not None and self._solved[0] == 0 and any(o[1] for o in outcomes):
            self._note_probes(outcomes, committed, worth, prefill_tokens, late)  # a probe while off
        asked = drafted = 0
        batch_wide: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # (`glob`)
        self._tree_nodes *= config.global_decay
        self._tree_depths *= config.global_decay
        for i, (seq_id, budget_depth, depth, accepted, committed) in enumerate(outcomes):
            predicted = self._predicted.pop(seq_id, None)
            if predicted is not None:
                self.stats.predicted_tokens += predicted
                self.stats.measured_tokens += committed
            if budget_depth == 0:
                continue
            asked += 1
            drafted += depth > 0
            if self._solved is not None and self._solved[0] == 0:
                # A probe while speculation is off. Kept, and as fast as rounds without drafts:
                # solve again next round with what it showed, and probe again, up to `probe_chain`
                # times in a row. Kept but slower (drafting costs more than it earns here:
                # chaining would be depth-1 speculation for good) or lost: the chain ends.
                if accepted and self._chain < config.probe_chain and probe_paid:
                    self._chain += 1
                    self._next_probe = min(self._next_probe, self.rounds + 1)
                    self._next_solve, self._solve_interval = self.rounds, config.resolve_every
                else:
                    self._chain = 0
                    if accepted:  # evidence all the same: weighed at a solve as it was before
                        self._next_solve = min(self._next_solve, self.rounds + config.max_resolve_every)
            # A tree shorter than its budget (a lookup that matched little, or nothing: depth 0)
            # counts in `drafted`, not as tokens lost: asking cost less than the budget's nodes.
            self.deepest_seen = max(self.deepest_seen, depth)
            if depth:
                self._tree_nodes += depth if draft_nodes is None else draft_nodes[i]
                self._tree_depths += depth
            own = self.seqs.get(seq_id)
            if own is None:  # (not `setdefault`: an empty one built every round cost ~5 us)
                own = self.seqs[seq_id] = DraftCounts.empty(len(self._nodes) - 1)
            own.add(budget_depth, depth, accepted, config.sequence_decay)
            batch_wide[self._greedy.get(seq_id, True)].append((budget_depth, depth, accepted))
        for kind, drafts in batch_wide.items():
            self.glob[kind].add_round(drafts, config.global_decay)
        if asked + shadows:
            self.check.late(asked + shadows, late, self.rounds)
        features = (forward_tokens, asked + shadows, drafted, len(outcomes))
        drafts = (deepest_budget, self._sent, sum(o[1] for o in outcomes))
        if not (prefill_tokens or shadow_only):  # (against the fits' prediction: `GoodputCheck.scale`)
            self._timed(deepest_budget, round_s + draft_wait_s, features, drafts)
        self.verify_cost.add(features, round_s, forward_s, prefill_tokens > 0)
        if deepest_budget > 0:  # with no budget anywhere the engine does not collect at all
            since, self._drafted_round = self.rounds - self._drafted_round, self.rounds
            self.draft_cost.add(drafts, draft_wait_s, since)  # (decayed by the rounds since)
            self._draft_octaves.add(asked.bit_length())
        self._sent = 0

    def sent(self, tokens: int) -> None:
        """The tokens the drafter was just sent with its requests (what it must catch up on
        before drafting), for the draft-cost fit."""
        self._sent = tokens

    def observe_round(
        self,
        verified: Seq[Sequence],  # the decoding sequences verified this round, in tree order
        trees: Seq[CandidateTree],  # their trees, as verified
        result: VerifyOutput,
        plan: RoundPlan,
        draft_wait_s: float,
        round_s: float,
        forward_s: float | None = None,
        missing: int = 0,
    ) -> None:
        """`observe`, from the engine's round: what each sequence's draft earned, what it cost."""
        if self._quiet:  # nobody was asked to draft (`quiet`); shadows asked before still settle
            self._score_shadows(verified)
            self.observe_quiet(len(trees), plan.num_prefill_tokens, round_s, forward_s)
            return
        budgets = self._shadow_round(  # (a shadow draft is no draft)
            verified, draft_wait_s, round_s, plan.num_prefill_tokens > 0
        )
        output = result.num_output_tokens.tolist()[: len(trees)]  # (after them: prompts that finished)
        nodes = [tree.parents.shape[0] - 1 for tree in trees]  # below the root
        outcomes = [
            (seq.seq_id, budget, tree_depth(tree) if n else 0, out - 1, out)
            for seq, tree, budget, n, out in zip(verified, trees, budgets, nodes, output, strict=True)
        ]
        tokens = sum(nodes) + len(nodes) + plan.num_prefill_tokens  # the forward's (Python ints)
        deepest = max(budgets, default=0)
        prefill = plan.num_prefill_tokens
        self.observe(
            outcomes, tokens, round_s, deepest, draft_wait_s, prefill, nodes, forward_s, missing=missing
        )

    def forget(self, seq_id: int, tokens: int | None = None, greedy: bool = True) -> None:
        """A sequence finished (`tokens`: what it decoded; `greedy`: its sampling class, which
        `budgets` never learnt where every round was `quiet`) or was aborted (None)."""
        if tokens is not None:
            self._note_life(greedy, tokens)
        self.seqs.pop(seq_id, None)
        self._forget_shadow(seq_id)
        self._greedy.pop(seq_id, None)
        self._gain_rows.pop(seq_id, None)
        self._predicted.pop(seq_id, None)

    # ---- the choice ----------------------------------------------------------------------

    def _gain(self, seq_ids: Seq[int]) -> list[Row]:
        """`_gains` by sequence, kept `gain_refresh` rounds (a round's outcome moves them
        little, and recomputing them every round cost more than the choice they inform) or
        until the next full solve."""
        if self._due():
            self._gain_rows.clear()
        cached, now = self._gain_rows, self.rounds
        missing = [s for s in seq_ids if s not in cached or now - cached[s][0] >= self.config.gain_refresh]
        if missing:
            # The batch's choice is made again only when some estimate moved (a new sequence,
            # or an expected token or node count by over 1% of the deepest expected tokens): a
            # sequence that keeps what it drafts, round after round, leaves the choice as it
            # was. An unmoved row stays as it was, so small moves cannot add up unseen.
            for s, row in zip(missing, self._gains(missing), strict=True):
                old = cached.get(s)
                if old is None or moved(row, old[1]):
                    self._gains_version += 1
                    old = (now, row)
                cached[s] = (now, old[1])
        return [cached[s][1] for s in seq_ids]

    def _gains(self, seq_ids: Seq[int]) -> list[Row]:
        """`policy_estimates.expected_gains` of these sequences, each shrunk toward its sampling
        class's batch-wide counts as far as the class's live sequences differ (`spread_prior`)."""
        width, prior = self._tree_nodes / self._tree_depths, self.config.prior_strength
        greedy = [self._greedy.get(s, True) for s in seq_ids]
        out: list = [None] * len(seq_ids)
        for kind in set(greedy):
            at, keep = [i for i, g in enumerate(greedy) if g == kind], self._keep_prior[kind]
            own = [self.seqs.get(seq_ids[i]) for i in at]
            live = [c for s, c in self.seqs.items() if self._greedy.get(s, True) == kind]
            keep = self._keep_prior[kind] = spread_prior(live, self.glob[kind], prior, 16 * prior) or keep
            gains = expected_gains(own, self.glob[kind], prior, self.deepest_seen, width, self._nodes, keep)
            for i, row in zip(at, gains, strict=True):
                out[i] = row
        return out

    def _warming_up(self) -> bool:
        return self.rounds < (self.ceiling.max_depth + 1) * self.config.warmup_cycles

    def _due(self) -> bool:
        return self._solved is None or self.rounds >= self._next_solve

    def _off(self, vetoed: bool) -> bool:
        """Whether this round is off without a solve: vetoed with none due, or all off."""
        return (vetoed and not self._due()) or self._all_off()

    def _all_off(self) -> bool:
        """The last solve gave every sequence depth 0, and the next is not due yet."""
        adaptive = self.config.adaptive and not self._warming_up()
        return adaptive and not self._due() and self._solved[0] == 0

    def _depths(self, rows: list[Row], ceiling: list[int], prefill_tokens: int) -> list[int]:
        if not self.config.adaptive:
            return ceiling
        if self._warming_up():
            # Warm-up: every depth in turn, so both cost fits see the spread they need.
            return [min(cap, self.rounds % (self.ceiling.max_depth + 1)) for cap in ceiling]
        due = self._due()
        if due and (self._solved is None or self.rounds >= self._next_fit):
            # The cost fits move slowly (decayed over ~100 rounds): refitted every `fit_every`
            # rounds at most, not at every solve (at batch 1 refitting cost ~0.3 ms, a solve
            # ~15 rounds apart: ~1% of a round).
            self.verify_cost.solve()
            self.draft_cost.solve()
            self._next_fit = self.rounds + self.config.fit_every
        a, b, ask, overhead, u, j = self.verify_cost.coefficients()
        c, e, g, h = self.draft_cost.coefficients()
        if len(rows) == 1 and not prefill_tokens:  # a lone tree with drafts steps up (`RoundCost`)
            overhead += j
        seconds = self._seconds(rows, (b, ask, overhead, g, h))
        # Prompt chunks cost b x their tokens whatever the depths: out of the rate, which
        # they lowered till drafts that lose to plain decoding looked worth it (docs 2c).
        fixed_s = a + u * len(rows)  # (u: every sequence's, whatever its depth)

        def best(m: int) -> tuple[float, list[int]]:
            return dinkelbach(rows, seconds, ceiling, m, fixed_s + (c + e * m if m else 0.0), self._lam)

        # A full solve weighs every deepest budget m (it sets the drafter's wait); between solves
        # (every `resolve_every` rounds, or wider) only the last m and none: each sequence re-picks
        # its depth as its estimates or ceiling move (a request's last tokens: at the old rate
        # alone, a 2-token tree that beats plain was "off"), and the drafter's wait is weighed
        # against not drafting (else a sequence whose drafts stopped being kept at batch 1
        # drafted the full m until the next solve, up to `max_resolve_every` rounds).
        ms = range(len(rows[0][0])) if due else sorted({0, min(self._solved[0], max(ceiling))})
        options = {m: best(m) for m in ms}
        # Each option's rate as measured rounds forwarding its tokens correct it, at B > 1.
        tokens = {m: prefill_tokens + forwarded(rows, d) for m, (_, d) in options.items()}
        scale = self.check.scales(tokens, self.rounds) if len(rows) > 1 else dict.fromkeys(tokens, 1.0)
        pick = max(ms, key=lambda m: options[m][0] / scale[m])  # the first of equals
        self._lam, choice = options[pick]
        if due:
            self._probe_terms, self._probe_at = (fixed_s, b, ask, overhead), None  # (`_probe_depths`)
            # Solves that keep their answer (the deepest budget; off included) are spaced ever
            # wider: between them each sequence still re-picks its depth, and a kept probe asks
            # for the next solve at once; a new answer is checked `resolve_every` rounds on. (At
            # batch 1 a solve cost ~3% of an 8 ms round: every 8 rounds, most of the policy's cost.)
            if pick and self._solved is not None and self._solved[0] == 0:
                for kind in self._kinds:
                    self._note_find(kind)
            # While off, a solve learns little but the cost fits' drift: what could turn drafting
            # on is a kept probe, or a sequence allowed deeper than the last solve weighed, and
            # either asks for a solve at once. Spaced as wide as probes (eagle3 at T = 1, batch 1:
            # a solve and the fold of the quiet rounds before it took ~0.5 ms every 64 rounds).
            widest = self.config.max_resolve_every if pick else 4 * self.config.max_probe_every
            same = self._solved is not None and pick == self._solved[0]
            self._solve_interval = (
                min(2 * self._solve_interval, widest) if same else self.config.resolve_every
            )
            self._solved, self._next_solve = (pick, self._lam), self.rounds + self._solve_interval
            self._solved_cap = max(ceiling, default=0)
        return choice
