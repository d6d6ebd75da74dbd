"""How much each sequence drafts next round: the speculation policy (docs/algorithms.md section 2c).

Speculation pays only when the tokens it adds are worth more than the time it costs, and both
change with the batch, the sequence and the hardware. Every round the engine asks the policy
for each decoding sequence's TreeBudget (depth k; k = 0 verifies the root only), chosen so the
batch's expected committed tokens per second is highest:

    tokens(k_s)  = 1 + sum_{i=1..k_s} prod_{d=1..i} alpha_s,d     survival along the draft
    seconds      = verify(N) + draft(max_s k_s)                    N = sum_s nodes(k_s) + prefill
    maximise       sum_s tokens(k_s) / seconds

- alpha_s,d: the chance a draft reaching depth d - 1 also keeps depth d, per sequence,
  from decayed counts shrunk toward the batch-wide estimate while the sequence is new;
- verify(N) = a + b N: the target forward's seconds against the tokens it carries (prefill
  chunks included), fitted online; draft(m) = c + e m: the time the engine waits in
  `collect` when the deepest budget is m (in-process drafting runs there; a remote drafter
  costs only what the engine waits for), fitted online;
- the maximum is found by Dinkelbach's iteration for each deepest budget m: for a ratio
  lambda, each sequence independently takes the k <= m maximising tokens(k) - lambda b
  nodes(k); lambda <- the resulting ratio, until it settles;
- a sequence whose budget is 0 is probed with depth 1 every `probe_every` rounds, so its
  estimates stay current when its text turns predictable again;
- the first rounds cycle the depth 0 .. ceiling, so the cost fits see a spread of tokens and
  depths; a fit keeps its last slope while later rounds stop varying.

`fixed` is vLLM's behaviour: every sequence drafts the ceiling each round.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from outrider.proto import TreeBudget

NO_DRAFT = TreeBudget(max_nodes=1, max_depth=0, top_k=0)


@dataclass(frozen=True)
class PolicyConfig:
    adaptive: bool = True  # False: every sequence drafts the ceiling (vLLM's fixed K)
    probe_every: int = 16  # rounds between depth-1 probes of a sequence not speculating
    prior_strength: float = 4.0  # pseudo-observations of the batch-wide estimate per depth
    sequence_decay: float = 0.9  # per-observation decay of a sequence's counts (recent text matters)
    global_decay: float = 0.995
    cost_decay: float = 0.98  # per-round decay of the cost fits' sums (conditions drift)
    warmup_cycles: int = 2  # rounds 0 .. (ceiling + 1) * cycles - 1 cycle the depth 0 .. ceiling


class _Line:
    """y = a + b x by decayed least squares; a, b >= 0."""

    def __init__(self, decay: float):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.slope = 0.0  # the last slope the data could tell: kept while x stops varying

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def coefficients(self) -> tuple[float, float]:
        if self.n == 0:
            return 0.0, 0.0
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        if var > 1e-3 * (1 + mean_x**2):
            self.slope = max((self.sxy / self.n - mean_x * mean_y) / var, 0.0)
        return max(mean_y - self.slope * mean_x, 0.0), self.slope


@dataclass
class _Acceptance:
    """Decayed per-depth counts: tries[d] drafts reached depth d, kept[d] of them kept it."""

    tries: np.ndarray
    kept: np.ndarray

    @classmethod
    def empty(cls, depth: int) -> _Acceptance:
        return cls(np.zeros(depth), np.zeros(depth))

    def add(self, tree_depth: int, accepted: int, decay: float) -> None:
        reached = min(accepted + 1, tree_depth)  # depths tried: all kept ones and the first lost
        self.tries *= decay
        self.kept *= decay
        self.tries[:reached] += 1
        self.kept[:accepted] += 1


@dataclass
class PolicyStats:
    """For /metrics: chosen depths, and predicted vs measured committed tokens."""

    depth_counts: list[int] = field(default_factory=list)  # [d] = sequence-rounds given depth d
    predicted_tokens: float = 0.0  # sum over verified sequence-rounds of tokens(k) predicted
    measured_tokens: int = 0  # and of the tokens they committed
    rounds_off: int = 0  # rounds in which no sequence drafted


class SpeculationPolicy:
    def __init__(self, ceiling: TreeBudget, config: PolicyConfig | None = None):
        self.ceiling, self.config = ceiling, config or PolicyConfig()
        depth = max(ceiling.max_depth, 1)
        self.glob = _Acceptance.empty(depth)
        self.seqs: dict[int, _Acceptance] = {}
        self.verify_cost = _Line(self.config.cost_decay)  # seconds vs tokens in the forward
        self.draft_cost = _Line(self.config.cost_decay)  # seconds waited in collect vs deepest budget
        self.deepest_seen = 0  # the drafter may draft less than the ceiling: never plan past it + 1
        self.rounds = 0
        self.stats = PolicyStats(depth_counts=[0] * (depth + 1))
        self._predicted: dict[int, float] = {}
        width = (ceiling.max_nodes - 1) / depth if ceiling.max_depth else 0.0
        self._nodes = np.array([1 + min(ceiling.max_nodes - 1, k * width) for k in range(depth + 1)])

    # ---- what the engine asks ------------------------------------------------------------

    def budgets(self, seq_ids: Seq[int], limits: Seq[TreeBudget], prefill_tokens: int) -> list[TreeBudget]:
        """Next round's budget per sequence; `limits` are each one's own ceiling (rows, max_tokens)."""
        depths = self._depths(seq_ids, [limit.max_depth for limit in limits], prefill_tokens)
        out = []
        for seq_id, limit, k in zip(seq_ids, limits, depths, strict=True):
            self.stats.depth_counts[k] += 1
            self._predicted[seq_id] = float(self._tokens(seq_id)[k])
            if k == 0:
                out.append(NO_DRAFT)
            else:
                nodes = min(limit.max_nodes, int(round(self._nodes[k])))
                out.append(TreeBudget(max_nodes=nodes, max_depth=k, top_k=limit.top_k, q_width=limit.q_width))
        if out and not any(b.max_depth for b in out):
            self.stats.rounds_off += 1
        return out

    def observe(
        self,
        outcomes: Seq[tuple[int, int, int, int]],  # (seq_id, tree depth, accepted, tokens committed)
        forward_tokens: int,
        forward_s: float,
        deepest_budget: int,
        draft_wait_s: float,
    ) -> None:
        """One round's evidence: each verified sequence's draft outcome, and what it cost."""
        self.rounds += 1
        config = self.config
        for seq_id, tree_depth, accepted, committed in outcomes:
            predicted = self._predicted.pop(seq_id, None)
            if predicted is not None:
                self.stats.predicted_tokens += predicted
                self.stats.measured_tokens += committed
            if tree_depth == 0:
                continue
            self.deepest_seen = max(self.deepest_seen, tree_depth)
            own = self.seqs.setdefault(seq_id, _Acceptance.empty(len(self.glob.tries)))
            own.add(tree_depth, accepted, config.sequence_decay)
            self.glob.add(tree_depth, accepted, config.global_decay)
        self.verify_cost.add(forward_tokens, forward_s)
        self.draft_cost.add(deepest_budget, draft_wait_s)

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self._predicted.pop(seq_id, None)

    # ---- the choice ----------------------------------------------------------------------

    def _tokens(self, seq_id: int) -> np.ndarray:
        """Expected committed tokens for each depth 0 .. ceiling: 1 + sum of survival products."""
        g, prior = self.glob, self.config.prior_strength
        global_rate = (g.kept + 0.5) / (g.tries + 1.0)  # a weak optimistic start: 0.5
        own = self.seqs.get(seq_id)
        rate = global_rate if own is None else (own.kept + prior * global_rate) / (own.tries + prior)
        reach = max(self.deepest_seen + 1, 1)
        rate = np.where(np.arange(len(rate)) < reach, rate, 0.0)  # never counted past what was drafted
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(rate))])

    def _depths(self, seq_ids: Seq[int], limits: Seq[int], prefill_tokens: int) -> list[int]:
        ceiling = [max(0, min(self.ceiling.max_depth, limit)) for limit in limits]
        if not self.config.adaptive or not seq_ids:
            return ceiling
        if self.rounds < (self.ceiling.max_depth + 1) * self.config.warmup_cycles:
            # Warm-up: every depth in turn, so both cost fits see the spread they need.
            return [min(cap, self.rounds % (self.ceiling.max_depth + 1)) for cap in ceiling]
        a, b = self.verify_cost.coefficients()
        c, e = self.draft_cost.coefficients()
        gain = np.stack([self._tokens(s) for s in seq_ids])  # [B, K + 1]
        depth_cap = np.array(ceiling)[:, None]  # [B, 1]
        ks = np.arange(gain.shape[1])
        best, best_rate = np.zeros(len(seq_ids), dtype=np.int64), -1.0
        for m in range(gain.shape[1]):  # the deepest budget allowed this round
            allowed = (ks[None, :] <= np.minimum(depth_cap, m)) & (ks[None, :] <= m)
            draft_s = c + e * m  # at m = 0 too: a drafter catching up still costs its wait
            lam = 0.0
            for _ in range(6):  # Dinkelbach: each sequence maximises tokens - lam * b * nodes
                score = np.where(allowed, gain - lam * b * self._nodes[None, :], -np.inf)
                choice = score.argmax(1)
                tokens = gain[np.arange(len(seq_ids)), choice].sum()
                seconds = a + b * (self._nodes[choice].sum() + prefill_tokens) + draft_s
                new = tokens / max(seconds, 1e-9)
                if abs(new - lam) <= 1e-6 * max(new, 1.0):
                    break
                lam = new
            if new > best_rate * (1 + 1e-9):
                best, best_rate = choice, new
        return self._probed(seq_ids, best.tolist(), ceiling)

    def _probed(self, seq_ids: Seq[int], depths: list[int], ceiling: list[int]) -> list[int]:
        """Sequences not speculating try depth 1 now and then (staggered by id) to stay measured."""
        every = self.config.probe_every
        return [
            1 if k == 0 and cap > 0 and (self.rounds + s) % every == 0 else k
            for s, k, cap in zip(seq_ids, depths, ceiling, strict=True)
        ]
