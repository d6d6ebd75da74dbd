"""The speculation cache: pre-draft round r+1 while the target verifies round r.

After round r's tree for a sequence is sent, the drafter is idle until the target's next
delta arrives. That delta is always `accepted path + one token` (the recovered or bonus
token at the end of the accepted path), so the drafter can guess it from its own tree:

    tree r:   root -> a -> b -> c           outcomes, scored by learned acceptance and q:
                                             accept a b c, bonus x   P(reach c) * q(x | abc)
                                             accept a, bonus y       P(reach a) (1 - acc(2)) q(y | a) / (1 - q(b | a))
    for the top `max_outcomes`: fork the sequence's state, extend it with the delta, draft
    -> cache[seq] = {delta: (tree r+1, extended state)}

P(reach node) multiplies, per depth, the acceptance rate the cache has seen at that depth
(learned from the real deltas, which show how far each tree was accepted; 0.7 before any)
and the node's share of its siblings' q. The draft's own q is a poor acceptance model (a
small draft is often right with q = 0.1), but it ranks tokens well.

A bonus token must differ from every child the tree already holds at the end node (a drafted
child that matched would have been accepted), so it comes from the end node's q row minus
its children; at a leaf, from the root q row of a tree drafted from the state extended by the
path alone. When the real delta arrives and equals a cached one (same budget and sampling, no
features, no reset), the cached tree answers at once, re-labelled with the update's round,
and the extended fork becomes the sequence's real state: it is exactly the state `propose`
would have built, so the tree is exactly the one `propose` would have drafted.

Speculation runs on the drafting thread only when no real update is pending, one sequence
at a time, and the server starts a job only when it expects it to end before the next real
round (`DraftBatcher._idle_work`); a real round that arrives anyway interrupts the guess at
its next draft step (`Proposer.interrupted`). While fewer than `min_hit_rate` of the rounds
speculated for hit, only one round in `probe_every` is: with no idle time to finish guesses,
or with the target's lanes already hiding the round trip, guessing only delays real rounds. The server also pushes each job's trees to the target
(`SpeculativeTree`), so a hit costs no round trip: the target holds the tree before it asks. A
proposer that cannot fork (`can_fork` False) or that needs target features (eagle3,
medusa, mtp: the delta's features exist only once the target has verified it) is never
speculated for. Every fork the cache discards (a miss, the other outcomes of a hit, a
forgotten sequence, the outcome probes) goes back through `Proposer.release_state`, so a
proposer whose forks hold memory frees it. When a batch retires a sequence and the proposer
keeps cross-sequence state in `retire` (suffix's shared trie; `retire_shares_state`), every
cached entry is dropped: its tree was drafted before that state changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from draft_worker.proposer import Proposer, SpeculationInterrupted
from proto import CandidateTree, SequenceUpdate


@dataclass(frozen=True)
class SpecCacheConfig:
    max_outcomes: int = 4  # pre-drafted outcomes per sequence and round
    bonus_per_node: int = 2  # bonus-token guesses per end node before the top-M cut
    # Below this hit rate (of the rounds speculated for), only one round in `probe_every` is
    # speculated for: guesses that rarely come true (no idle time to finish them, the target's
    # lanes already hide the round trip, an unpredictable drafter) only delay real rounds.
    min_hit_rate: float = 0.25
    probe_every: int = 8


@dataclass
class SpecStats:
    hits: int = 0
    misses: int = 0  # eligible updates (not reset/finished, no features) that found no entry
    saved_s: float = 0.0  # drafting the hits did not do: each hit's share of its speculate() call
    drafting_s: float = 0.0  # all time spent speculating (outcome probes included), hits or not
    interrupted: int = 0  # guesses abandoned mid-draft because a real round was waiting
    gated: int = 0  # rounds not speculated for while the hit rate was below min_hit_rate


@dataclass
class _Entry:
    update: SequenceUpdate  # the hypothetical update that was drafted
    tree: CandidateTree
    state: Any
    cost_s: float


@dataclass(frozen=True)
class Outcome:
    score: float
    path: tuple[int, ...]  # accepted draft tokens (tree nodes below the root)
    bonus: int

    @property
    def delta(self) -> tuple[int, ...]:
        return (*self.path, self.bonus)


_HIT_RATE_EMA = 0.1  # weight of the newest tried round in the hit rate
_MIN_TRIED = 20  # tried rounds before the hit rate can gate speculation


def supports_speculation(proposer: Any) -> bool:
    """Whether the proposer has the fork API (test doubles and wrappers may not)."""
    return isinstance(proposer, Proposer) and proposer.can_fork and not proposer.feature_spec.needs_features


class AcceptanceModel:
    """How often the target accepts a draft at each depth, counted from real deltas."""

    PRIOR, PRIOR_WEIGHT = 0.7, 2.0

    def __init__(self) -> None:
        self.reached: list[int] = []  # [depth - 1] rounds whose accepted path reached the parent depth
        self.accepted: list[int] = []  # [depth - 1] ... and accepted a node at this depth

    def rate(self, depth: int) -> float:
        """P(a node at `depth` >= 1 is accepted | its parent was)."""
        i = depth - 1
        seen, kept = (self.reached[i], self.accepted[i]) if i < len(self.reached) else (0, 0)
        return (kept + self.PRIOR * self.PRIOR_WEIGHT) / (seen + self.PRIOR_WEIGHT)

    def observe(self, tree: CandidateTree, delta: list[int]) -> None:
        """The real delta after `tree`: its accepted path (all but the last token) walks the tree."""
        children = _children(tree)
        tokens = tree.tokens.tolist()
        node, depth = 0, 0
        for token in [*delta[:-1], None]:
            kids = children.get(node, [])
            if not kids:
                return  # a leaf: nothing was rejected below it
            while len(self.reached) <= depth:
                self.reached.append(0)
                self.accepted.append(0)
            self.reached[depth] += 1
            match = next((k for k in kids if tokens[k] == token), None)
            if match is None:
                return
            self.accepted[depth] += 1
            node, depth = match, depth + 1


def _children(tree: CandidateTree) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(parent, []).append(node)
    return children


def q_rows(tree: CandidateTree) -> dict[int, dict[int, float]]:
    """Each expanded node's q as {token: probability}, padding dropped."""
    rows: dict[int, dict[int, float]] = {}
    ids, probs = tree.q_token_ids.tolist(), tree.q_probs.tolist()
    for row, node in enumerate(tree.q_nodes.tolist()):
        rows[node] = {t: p for t, p in zip(ids[row], probs[row], strict=True) if t >= 0 and p > 0}
    return rows


def _top(row: dict[int, float], exclude: set[int], count: int) -> list[tuple[int, float]]:
    ranked = sorted(((p, -t) for t, p in row.items() if t not in exclude), reverse=True)
    return [(-t, p) for p, t in ranked[:count]]


class SpecCache:
    """Per-sequence pre-drafted trees for the next round; drafting-thread only."""

    def __init__(self, proposer: Proposer, config: SpecCacheConfig):
        self.proposer, self.config = proposer, config
        proposer.outcome_rows = True
        self.stats = SpecStats()
        self._entries: dict[int, dict[tuple[int, ...], _Entry]] = {}  # seq_id -> delta -> entry
        self._jobs: dict[int, tuple[SequenceUpdate, CandidateTree]] = {}  # seq_id -> round r's pair
        self._sent: dict[int, CandidateTree] = {}  # seq_id -> the tree its next delta answers
        self.acceptance = AcceptanceModel()
        self.outcome_cost_s: float | None = None  # running average of one outcome's drafting
        # Hit rate of the rounds speculation was tried for (EMA; `_tried` = their seq_ids): a
        # round never tried says nothing about whether trying pays.
        self.hit_rate, self._tried_count = 1.0, 0
        self._tried: set[int] = set()
        self._since_probe = 0
        shares = proposer.retire_shares_state
        self._retire_shares = type(proposer).retire is not Proposer.retire if shares is None else shares

    # ---- the real rounds -------------------------------------------------------------------

    def lookup(self, update: SequenceUpdate) -> CandidateTree | None:
        """The cached tree for this real update (its state adopted), or None; counts hit or miss."""
        self._jobs.pop(update.seq_id, None)
        sent = self._sent.pop(update.seq_id, None)
        if sent is not None and not (update.finished or update.reset):
            self.acceptance.observe(sent, update.new_tokens.tolist())
        entries = self._entries.pop(update.seq_id, {})
        entry = None
        if not (update.finished or update.reset or update.features is not None):
            entry = entries.get(tuple(update.new_tokens.tolist()))
            if entry is not None and (
                entry.update.budget != update.budget or entry.update.sampling != update.sampling
            ):
                entry = None
            if entry is None:
                self.stats.misses += 1
            if update.seq_id in self._tried:
                self._tried_count += 1
                self.hit_rate += _HIT_RATE_EMA * (float(entry is not None) - self.hit_rate)
        self._tried.discard(update.seq_id)
        self._release(e for e in entries.values() if e is not entry)
        if entry is None:
            return None
        self.proposer.adopt(update.seq_id, entry.state)
        self.stats.hits += 1
        self.stats.saved_s += entry.cost_s
        return replace(entry.tree, round=update.round)

    def schedule(self, update: SequenceUpdate, tree: CandidateTree) -> None:
        """Round `update.round` was answered with `tree`: pre-draft the next round when idle."""
        if not update.finished and update.features is None and tree.num_nodes > 1:
            self._sent[update.seq_id] = tree
            if self.gated():
                self._since_probe += 1
                if self._since_probe < self.config.probe_every:
                    self.stats.gated += 1
                    return
                self._since_probe = 0
            self._jobs[update.seq_id] = (update, tree)

    def gated(self) -> bool:
        """Whether guesses have been coming true too rarely to be worth drafting (config)."""
        return self._tried_count >= _MIN_TRIED and self.hit_rate < self.config.min_hit_rate

    def forget(self, seq_id: int) -> None:
        self._jobs.pop(seq_id, None)
        self._sent.pop(seq_id, None)
        self._tried.discard(seq_id)
        self._release(self._entries.pop(seq_id, {}).values())

    def retired(self) -> None:
        """A sequence was retired: entries drafted before a shared-state change are stale."""
        if self._retire_shares:
            for entries in self._entries.values():
                self._release(entries.values())
            self._entries.clear()

    def _release(self, entries: Iterable[_Entry]) -> None:
        """Entries that will never be adopted give back what their states hold."""
        for entry in entries:
            self.proposer.release_state(entry.state)

    # ---- idle time -------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._jobs)

    def job_skipped(self) -> None:
        """A real round came before a waiting job was tried (it did not seem to fit): shrink the
        cost estimate, so one slow job (a warm-up) cannot stop speculation for good."""
        if self.outcome_cost_s is not None:
            self.outcome_cost_s *= 0.8

    def run_one(
        self,
        max_outcomes: int | None = None,
        keep_going: Callable[[], bool] = lambda: True,
        push: Callable[[int, SequenceUpdate, CandidateTree], None] | None = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> int:
        """Speculate for one scheduled sequence; returns its seq_id.

        Outcomes are drafted one at a time, best first (at most `max_outcomes`, default the
        config's), each tree handed to `push` as soon as it exists, and the job stops when
        `keep_going()` turns False (the next outcome would not fit, or a real round arrived).
        `interrupted()` True (a real round is waiting) abandons the outcome being drafted at
        the proposer's next draft step (`Proposer.interrupted`), so a real round waits for
        one draft step, not a whole guess; the likeliest guesses are out first.
        """
        seq_id = next(iter(self._jobs))
        update, tree = self._jobs.pop(seq_id)
        self._tried.add(seq_id)
        started = time.perf_counter()
        outcomes = self.outcomes(update, tree)[:max_outcomes]
        self._release(self._entries.pop(seq_id, {}).values())
        entries = self._entries[seq_id] = {}
        self.proposer.interrupted = interrupted
        try:
            for i, outcome in enumerate(outcomes):
                if i and not keep_going():
                    break
                if not self._draft_outcome(seq_id, update, outcome, entries, push):
                    break
        finally:
            self.proposer.interrupted = None
        self.stats.drafting_s += time.perf_counter() - started
        return seq_id

    def _draft_outcome(
        self,
        seq_id: int,
        update: SequenceUpdate,
        outcome: Outcome,
        entries: dict[tuple[int, ...], _Entry],
        push: Callable[[int, SequenceUpdate, CandidateTree], None] | None,
    ) -> bool:
        """Draft one outcome into `entries` and push it; False when nothing was drafted
        (the sequence cannot be forked, or a real round interrupted the drafting)."""
        guess = replace(update, round=update.round + 1, new_tokens=_tensor(outcome.delta, update))
        drafting = time.perf_counter()
        try:
            drafted = self.proposer.speculate(seq_id, [guess])  # fork + extend + draft
        except SpeculationInterrupted:
            self.stats.interrupted += 1
            return False
        cost = time.perf_counter() - drafting
        if not drafted:
            return False
        ((guessed_tree, state),) = drafted
        entries[outcome.delta] = _Entry(guess, guessed_tree, state, cost)
        ema = self.outcome_cost_s
        self.outcome_cost_s = cost if ema is None else ema + 0.3 * (cost - ema)
        if push is not None:
            push(seq_id, guess, guessed_tree)
        return True

    def outcomes(self, update: SequenceUpdate, tree: CandidateTree) -> list[Outcome]:
        """The `max_outcomes` most likely (accepted path, bonus token) pairs, best first."""
        rows, per_node = q_rows(tree), self.config.bonus_per_node
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        children = _children(tree)
        depth, reach, paths = [0], [1.0], [()]  # per node: depth, P(accepted path reaches it), path
        for node in range(1, len(tokens)):
            parent = parents[node]
            siblings = children[parent]
            row = rows.get(parent, {})
            mass = sum(row.get(tokens[s], 0.0) for s in siblings)
            share = row.get(tokens[node], 0.0) / mass if mass > 0 else 1 / len(siblings)
            depth.append(depth[parent] + 1)
            reach.append(reach[parent] * self.acceptance.rate(depth[node]) * share)
            paths.append((*paths[parent], tokens[node]))
        candidates: list[Outcome] = []
        leaves: list[tuple[float, tuple[int, ...]]] = []
        for node in range(len(tokens)):
            kids = {tokens[k] for k in children.get(node, [])}
            # The accepted path ends here: no child accepted (or none to accept).
            end = reach[node] * ((1 - self.acceptance.rate(depth[node] + 1)) if kids else 1.0)
            if end <= 0:
                continue
            if node in rows:
                rest = 1 - sum(q for t, q in rows[node].items() if t in kids)  # q mass left to the bonus
                for token, q in _top(rows[node], kids, per_node):
                    candidates.append(Outcome(end * q / max(rest, q), paths[node], token))
            elif not kids:
                leaves.append((end, paths[node]))
        # Leaves carry no q row: ask the drafter what follows each likely full path.
        leaves = sorted(leaves, reverse=True)[: self.config.max_outcomes]
        probes = [replace(update, round=update.round + 1, new_tokens=_tensor(p, update)) for _, p in leaves]
        drafted = self.proposer.speculate(update.seq_id, probes) if probes else None
        for (prob, path), (probe_tree, probe_state) in zip(leaves, drafted or [], strict=False):
            self.proposer.release_state(probe_state)  # only its root q row is wanted
            root_row = q_rows(probe_tree).get(0, {})
            for token, q in _top(root_row, set(), per_node):
                candidates.append(Outcome(prob * q, path, token))
        candidates.sort(key=lambda o: (-o.score, len(o.path), o.delta))
        return candidates[: self.config.max_outcomes]


def _tensor(tokens: tuple[int, ...], like: SequenceUpdate) -> torch.Tensor:
    return torch.tensor(tokens, dtype=like.new_tokens.dtype)
