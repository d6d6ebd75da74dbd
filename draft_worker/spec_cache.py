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
speculated for were answered by a pushed guess in time (the target says so:
`SequenceUpdate.answered`), only one round in `probe_every` (and fewer, the longer it lasts)
is: with no idle time to finish guesses, or with the target's lanes already hiding the
round trip, guessing only delays real rounds. The server also pushes each job's trees to the target
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

from outrider.draft_worker.proposer import Proposer, SpeculationInterrupted
from outrider.proto import CandidateTree, SequenceUpdate


@dataclass(frozen=True)
class SpecCacheConfig:
    max_outcomes: int = 4  # pre-drafted outcomes per sequence and round
    bonus_per_node: int = 2  # bonus-token guesses per end node before the top-M cut
    # Below this rate of guesses that came true *in time* (the target answered the round from
    # the pushed tree: `SequenceUpdate.answered`) among the rounds speculated for, only one
    # round in `probe_every` is speculated for, doubling up to `max_probe_every` while it
    # stays low: guesses that come late (no idle time to finish them, the target's lanes
    # already hide the round trip) or come true rarely only delay real rounds.
    min_hit_rate: float = 0.25
    probe_every: int = 8
    max_probe_every: int = 128


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


@dataclass
class _Job:
    update: SequenceUpdate  # round r's update and the tree that answered it
    tree: CandidateTree
    outcomes: list[Outcome] | None = None  # ranked once, then drafted best first; None = not yet


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
    """How often the target accepts a draft at each depth, counted from real deltas: over all
    sequences, and per sequence, whose own counts pull away from the global rate as they grow
    (one prompt the drafter predicts perfectly and one it never does share a drafter)."""

    PRIOR, PRIOR_WEIGHT = 0.7, 2.0
    GLOBAL_WEIGHT = 4.0  # a sequence's own rounds that weigh as much as the global rate

    def __init__(self) -> None:
        self.reached: list[int] = []  # [depth - 1] rounds whose accepted path reached the parent depth
        self.accepted: list[int] = []  # [depth - 1] ... and accepted a node at this depth
        self._per_seq: dict[int, tuple[list[int], list[int]]] = {}  # seq_id -> (reached, accepted)

    def rate(self, depth: int, seq_id: int | None = None) -> float:
        """P(a node at `depth` >= 1 is accepted | its parent was), for `seq_id` if given."""
        i = depth - 1
        seen, kept = _counts(self.reached, self.accepted, i)
        overall = (kept + self.PRIOR * self.PRIOR_WEIGHT) / (seen + self.PRIOR_WEIGHT)
        if seq_id is None or seq_id not in self._per_seq:
            return overall
        seen, kept = _counts(*self._per_seq[seq_id], i)
        return (kept + overall * self.GLOBAL_WEIGHT) / (seen + self.GLOBAL_WEIGHT)

    def observe(self, tree: CandidateTree, delta: list[int], seq_id: int | None = None) -> None:
        """The real delta after `tree`: its accepted path (all but the last token) walks the tree."""
        counts = [(self.reached, self.accepted)]
        if seq_id is not None:
            counts.append(self._per_seq.setdefault(seq_id, ([], [])))
        children = _children(tree)
        tokens = tree.tokens.tolist()
        node, depth = 0, 0
        for token in [*delta[:-1], None]:
            kids = children.get(node, [])
            if not kids:
                return  # a leaf: nothing was rejected below it
            match = next((k for k in kids if tokens[k] == token), None)
            for reached, accepted in counts:
                while len(reached) <= depth:
                    reached.append(0)
                    accepted.append(0)
                reached[depth] += 1
                accepted[depth] += match is not None
            if match is None:
                return
            node, depth = match, depth + 1

    def forget(self, seq_id: int) -> None:
        self._per_seq.pop(seq_id, None)


def _counts(reached: list[int], accepted: list[int], i: int) -> tuple[int, int]:
    return (reached[i], accepted[i]) if i < len(reached) else (0, 0)


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
        proposer.outcome_rows = True  # off while gated: nobody ranks the outcomes of most rounds
        self.stats = SpecStats()
        self._entries: dict[int, dict[tuple[int, ...], _Entry]] = {}  # seq_id -> delta -> entry
        self._jobs: dict[int, _Job] = {}  # seq_id -> round r's pair, in the order they are run
        self._sent: dict[int, CandidateTree] = {}  # seq_id -> the tree its next delta answers
        self.acceptance = AcceptanceModel()
        self.outcome_cost_s: float | None = None  # running average of one outcome's drafting
        # Hit rate of the rounds speculation was tried for (EMA; `_tried` = their seq_ids): a
        # round never tried says nothing about whether trying pays.
        self.hit_rate, self._tried_count = 1.0, 0
        self._tried: set[int] = set()
        self._since_probe, self._probe_every = 0, config.probe_every
        shares = proposer.retire_shares_state
        self._retire_shares = type(proposer).retire is not Proposer.retire if shares is None else shares

    # ---- the real rounds -------------------------------------------------------------------

    def lookup(self, update: SequenceUpdate) -> CandidateTree | None:
        """The cached tree for this real update (its state adopted), or None; counts hit or miss."""
        self._jobs.pop(update.seq_id, None)
        sent = self._sent.pop(update.seq_id, None)
        if sent is not None and not (update.finished or update.reset):
            self.acceptance.observe(sent, update.new_tokens.tolist(), update.seq_id)
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
                in_time = entry is not None and update.answered
                self.hit_rate += _HIT_RATE_EMA * (float(in_time) - self.hit_rate)
        self._tried.discard(update.seq_id)
        # While gated, most rounds are never guessed for: their extra draft step for outcome
        # rows would only slow real drafting (a probe round ranks its outcomes by drafting).
        self.proposer.outcome_rows = not self.gated()
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
            if not self.gated():
                self._probe_every = self.config.probe_every
            else:
                self._since_probe += 1
                if self._since_probe < self._probe_every:
                    self.stats.gated += 1
                    return
                self._since_probe = 0
                self._probe_every = min(2 * self._probe_every, self.config.max_probe_every)
            self._jobs[update.seq_id] = _Job(update, tree)

    def gated(self) -> bool:
        """Whether guesses have been coming true too rarely to be worth drafting (config)."""
        return self._tried_count >= _MIN_TRIED and self.hit_rate < self.config.min_hit_rate

    def forget(self, seq_id: int) -> None:
        self._jobs.pop(seq_id, None)
        self._sent.pop(seq_id, None)
        self._tried.discard(seq_id)
        self.acceptance.forget(seq_id)
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

    def run_one(
        self,
        max_outcomes: int | None = None,
        keep_going: Callable[[], bool] = lambda: True,
        push: Callable[[int, SequenceUpdate, CandidateTree], None] | None = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> int:
        """Speculate for the first scheduled sequence; returns its seq_id.

        Its outcomes are ranked once and drafted one at a time, best first, each tree handed
        to `push` as soon as it exists; this call drafts at most `max_outcomes` (default: all
        the config allows) and stops early when `keep_going()` turns False (the next outcome
        would not fit, a real round arrived, or another sequence waits for its turn: a job
        with outcomes left goes to the back of the queue, so every sequence's likeliest guess
        comes before anyone's second). `interrupted()` True (a real round is waiting)
        abandons the outcome being drafted at the proposer's next draft step
        (`Proposer.interrupted`): a real round waits for one draft step, not a whole guess.
        """
        seq_id = next(iter(self._jobs))
        job = self._jobs.pop(seq_id)
        self._tried.add(seq_id)
        started = time.perf_counter()
        drafted, requeue = 0, True
        self.proposer.interrupted = interrupted
        try:
            if job.outcomes is None:
                self._release(self._entries.pop(seq_id, {}).values())
                try:  # ranking may draft probes (a tree without outcome rows): interruptible too
                    job.outcomes = self.outcomes(job.update, job.tree)
                except SpeculationInterrupted:
                    self.stats.interrupted += 1  # ranked again on its next turn
            entries = self._entries.setdefault(seq_id, {})
            while job.outcomes and (max_outcomes is None or drafted < max_outcomes):
                if drafted and not keep_going():
                    break
                outcome = job.outcomes.pop(0)
                done = self._draft_outcome(seq_id, job.update, outcome, entries, push)
                if done is None:  # interrupted: the outcome waits for its turn again
                    job.outcomes.insert(0, outcome)
                    break
                if not done:  # the sequence cannot be forked: nothing more to guess
                    requeue = False
                    break
                drafted += 1
        finally:
            self.proposer.interrupted = None
        if requeue and (job.outcomes is None or job.outcomes):
            self._jobs[seq_id] = job
        self.stats.drafting_s += time.perf_counter() - started
        return seq_id

    def _draft_outcome(
        self,
        seq_id: int,
        update: SequenceUpdate,
        outcome: Outcome,
        entries: dict[tuple[int, ...], _Entry],
        push: Callable[[int, SequenceUpdate, CandidateTree], None] | None,
    ) -> bool | None:
        """Draft one outcome into `entries` and push it; False when the sequence cannot be
        forked, None when a real round interrupted the drafting."""
        guess = replace(update, round=update.round + 1, new_tokens=_tensor(outcome.delta, update))
        drafting = time.perf_counter()
        try:
            drafted = self.proposer.speculate(seq_id, [guess])  # fork + extend + draft
        except SpeculationInterrupted:
            self.stats.interrupted += 1
            return None
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
            reach.append(reach[parent] * self.acceptance.rate(depth[node], update.seq_id) * share)
            paths.append((*paths[parent], tokens[node]))
        candidates: list[Outcome] = []
        leaves: list[tuple[float, tuple[int, ...]]] = []
        for node in range(len(tokens)):
            kids = {tokens[k] for k in children.get(node, [])}
            # The accepted path ends here: no child accepted (or none to accept).
            end = reach[node] * ((1 - self.acceptance.rate(depth[node] + 1, update.seq_id)) if kids else 1.0)
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
