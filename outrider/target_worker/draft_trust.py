"""Whose draft distribution q the verifier may use (docs/algorithms.md section 2b).

Speculative sampling with q (`u * q(x) < p(x)`) is lossless only if each child really was
drawn from the q sent with it, with randomness the verifier's does not depend on. A drafter
that claims a tiny q(x) for a token of its choosing gets that token accepted almost always.
So q is used only where the operator trusts the drafter, and trust is watched:

    trusted source (in-process, the application's own draft deployment, or configured):
        trees verified as sent (q-based acceptance), every sampled tree audited
    untrusted source (external endpoints by default), or a trusted one the audit revoked:
        trees demoted to DETERMINISTIC: accept x with probability r(x) / S, on rejection
        r(x) = 0 -- lossless for any proposal the drafter cannot base on the verifier's
        uniforms; repeated siblings are pruned (the first copy stays); q is kept as advice

The audit is a sequential test of the importance-weight identity: a child x drawn from q has
E_q[p(x) / q(x)] = sum over q's support of p <= 1, whatever q is. With X = p(x)/q(x) for the
first child of every expanded node of a sampled tree (later siblings are drawn from
conditionals), the product of (1 + bet * (X - 1)) is a nonnegative supermartingale for an
honest drafter, so by Ville's inequality it reaches 1 / alpha with probability at most alpha,
ever. The test bets on a mixture of start rounds (weight 1 / (r (r + 1)) for round r), so a
drafter honest for a long time and lying from then on is caught as fast as a new liar, up to
a log factor. Crossing 1 / alpha revokes trust for good: logged, counted, on /metrics.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import secrets
from dataclasses import dataclass, replace

import torch

from outrider.kernels.packing import PackedTrees
from outrider.proto import CandidateTree, DraftSampling

log = logging.getLogger(__name__)

AUDIT_ALPHA = 1e-6  # an honest drafter is ever revoked with probability at most this
AUDIT_BET = 0.5  # the fraction of wealth bet on X > 1 each observation: factor in [0.5, inf)
# Engines built without a key share this one: seeded requests reproduce within the process
# (a deployment passes one key to all its replicas: `engine.seed_key_file`, or `build_app`'s).
PROCESS_SEED_KEY = secrets.token_bytes(32)


class VerificationMode(str, enum.Enum):
    """How a draft source's trees are verified; the label on /metrics and in the logs."""

    DRAFT_Q = "draft_q"  # trusted: q-based acceptance for sampled trees
    DETERMINISTIC = "deterministic"  # untrusted by configuration
    REVOKED = "deterministic_after_audit"  # was trusted; the audit caught q that lies


def demote(tree: CandidateTree) -> CandidateTree:
    """The tree as a deterministic proposal: same nodes, minus repeated siblings (and what
    hangs under them), q rows kept for the nodes that remain."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    keep, new_index, seen = [0], {0: 0}, set()
    for i in range(1, len(tokens)):
        key = (parents[i], tokens[i])
        if parents[i] in new_index and key not in seen:
            seen.add(key)
            new_index[i] = len(keep)
            keep.append(i)
    if len(keep) == len(tokens):
        return replace(tree, sampling=DraftSampling.DETERMINISTIC)
    rows = [(r, new_index[u]) for r, u in enumerate(tree.q_nodes.tolist()) if u in new_index]
    return replace(
        tree,
        tokens=tree.tokens[torch.tensor(keep, dtype=torch.int64)],
        parents=torch.tensor([-1] + [new_index[parents[i]] for i in keep[1:]], dtype=torch.int64),
        q_nodes=torch.tensor([u for _, u in rows], dtype=torch.int64),
        q_token_ids=tree.q_token_ids[[r for r, _ in rows]],
        q_probs=tree.q_probs[[r for r, _ in rows]],
        sampling=DraftSampling.DETERMINISTIC,
    )


def importance_ratios(trees: PackedTrees, target_probs: torch.Tensor, audited: torch.Tensor) -> torch.Tensor:
    """X = p(x) / q(x) for the first child x of every expanded node of the `audited` trees.

    trees: the round's packed trees (validated: a sampled tree's children are in their
    parent's q support); target_probs [total_nodes, vocab]: processed p after each node;
    audited [batch] bool: sampled sequences whose trees keep a sampled mode. Returns [m]
    float64 (m = 0 when nothing qualifies).
    """
    device, total = target_probs.device, trees.token_ids.numel()
    cu = trees.cu_num_draft_tokens
    owner = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu[1:] - cu[:-1])
    child = (trees.parents >= 0) & audited[owner]
    if not bool(child.any()):
        return torch.empty(0, dtype=torch.float64, device=device)
    node = torch.arange(total, device=device)
    parent = torch.where(child, cu[:-1][owner] + trees.parents, 0)  # global parent of each child
    first = torch.full((total,), total, dtype=torch.int64, device=device)
    first.scatter_reduce_(0, parent[child], node[child], reduce="amin")
    kids = first[first < total]  # the first child of each expanded node
    parent, token = parent[kids], trees.token_ids[kids]
    row = trees.q_index[parent]
    kids, parent, token, row = kids[row >= 0], parent[row >= 0], token[row >= 0], row[row >= 0]
    q_ids, q_w = trees.q_token_ids[row], trees.q_probs[row].double()
    q_x = (q_w * (q_ids == token[:, None])).sum(-1) / q_w.sum(-1)
    p_x = target_probs[parent, token].double()
    return p_x / q_x


@dataclass
class DraftTrust:
    """One draft source's standing: the operator's decision and the audit's running test."""

    trusted: bool  # the operator's decision (never the drafter's claim)
    source: str = "drafts"  # how logs name the source
    alpha: float = AUDIT_ALPHA
    bet: float = AUDIT_BET
    auditing: bool = True  # False only to show what an unaudited trusted liar does (tests, benchmarks)
    revoked: bool = False
    log_wealth: float = -math.inf  # log of the mixture e-process; revoked at log(1 / alpha)
    audited_rounds: int = 0
    audited_children: int = 0
    ratio_sum: float = 0.0  # sum of X: the mean is <= 1 for an honest drafter
    demoted_trees: int = 0
    pruned_repeats: int = 0

    @property
    def uses_q(self) -> bool:
        return self.trusted and not self.revoked

    @property
    def mode(self) -> VerificationMode:
        if self.revoked:
            return VerificationMode.REVOKED
        return VerificationMode.DRAFT_Q if self.trusted else VerificationMode.DETERMINISTIC

    @property
    def mean_ratio(self) -> float:
        return self.ratio_sum / self.audited_children if self.audited_children else 0.0

    def prepare(self, trees: list[CandidateTree]) -> list[CandidateTree]:
        """The trees as they will be verified: demoted unless this source's q is trusted."""
        if self.uses_q:
            return trees
        out = []
        for tree in trees:
            if tree.num_nodes > 1 and tree.sampling != DraftSampling.DETERMINISTIC:
                self.demoted_trees += 1
            demoted = demote(tree) if tree.num_nodes > 1 else tree
            self.pruned_repeats += tree.num_nodes - demoted.num_nodes
            out.append(demoted)
        return out

    def audit(self, trees: PackedTrees, target_probs: torch.Tensor, is_greedy: torch.Tensor) -> None:
        """One round's evidence; revokes trust when the e-process reaches 1 / alpha."""
        if not self.uses_q or trees.max_num_nodes == 1:  # nothing drafted: nothing to audit
            return
        audited = ~is_greedy & (trees.sampling != int(DraftSampling.DETERMINISTIC))
        if not bool(audited.any()):
            return
        ratios = importance_ratios(trees, target_probs, audited)
        if ratios.numel() == 0:
            return
        self.audited_rounds += 1
        self.audited_children += ratios.numel()
        self.ratio_sum += float(ratios.sum())
        r = self.audited_rounds
        # M_r = (M_{r-1} + w_r) * F_r: a new bet starting this round joins, then all pay F_r.
        self.log_wealth = _log_add(self.log_wealth, -math.log(r * (r + 1)))
        self.log_wealth += float(torch.log1p(self.bet * (ratios - 1)).sum())
        if self.auditing and self.log_wealth >= math.log(1 / self.alpha):
            self.revoked = True
            log.warning(
                "%s: the draft distribution q failed its audit after %d rounds (mean p/q = %.3g over %d "
                "children, e-value %.3g >= 1/alpha = %.3g): its trees are verified as deterministic "
                "proposals from now on",
                self.source,
                r,
                self.mean_ratio,
                self.audited_children,
                math.exp(min(self.log_wealth, 700.0)),
                1 / self.alpha,
            )


def _log_add(a: float, b: float) -> float:
    """log(exp(a) + exp(b)), with a = -inf allowed."""
    high, low = max(a, b), min(a, b)
    return high if low == -math.inf else high + math.log1p(math.exp(low - high))


def derive_seed(key: bytes, seed: int, purpose: str) -> int:
    """A 63-bit seed for `purpose` ("verify" or "draft") from a request's seed, keyed by a
    secret the target keeps: knowing `seed` and one derived seed reveals nothing of another."""
    digest = hashlib.blake2b(
        seed.to_bytes(16, "little", signed=True), key=key[:64], person=purpose.encode()[:16], digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1
