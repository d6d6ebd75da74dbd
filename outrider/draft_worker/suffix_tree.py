"""`suffix`: a tree of the most frequent continuations seen before (SuffixDecoding, arXiv 2411.04975).

Every sequence keeps a suffix trie of its context: each substring of up to `max_tree_depth`
tokens is a path from the trie's root, and each trie node counts how often its substring
occurred. Finished sequences go into one shared trie (the last `max_cached_requests` of them),
so patterns carry across requests. To draft, find the longest suffix of the context that
occurs earlier with a continuation, then grow a candidate tree from its trie node best-first
by path probability:

    context ... a b | a b c ... a b d ... a b c ... a b      suffix "a b" seen 3 times before
    trie node "a b": children c (2), d (1)  ->  q = {c: 2/3, d: 1/3}
    candidate tree:  root -> c (2/3) -> ..., root -> d (1/3) -> ...

A child's probability is its count over its siblings' total: the empirical next-token
distribution after that substring. Nodes below `min_token_prob` (path probability) are not
proposed, and a match of length m proposes at most `max_spec_factor * m` tokens (longer
matches are more trustworthy). The tree is deterministic (the most frequent children, not
samples), so DraftSampling.DETERMINISTIC; its q rows carry the frequencies, as draft scores.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.draft_worker.proposer import Proposer, register_proposer, root_only_tree
from outrider.proto import CandidateTree, DraftSampling, SequenceUpdate, TreeBudget


class SuffixTrie:
    """Counts of every substring of up to `max_depth` tokens of the streams added to it.

    Nodes are ints (0 is the root): `children[node]` maps a token to the child's node and
    `count[node]` counts the node's substring. A node object per substring would make the
    tries most of what Python's full garbage collections walk (~24 nodes per cached token;
    one full collection of a process holding them took ~110 ms); dicts of ints are not
    tracked by the collector at all."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.children: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self._free: list[int] = []  # nodes of removed substrings, reused first

    def _new_node(self) -> int:
        if self._free:
            return self._free.pop()
        self.children.append({})
        self.count.append(0)
        return len(self.count) - 1

    def walk(self, tokens: Sequence[int]) -> int | None:
        node: int | None = 0
        children = self.children
        for token in tokens:
            node = children[node].get(token)
            if node is None:
                return None
        return node

    def continuations(self, node: int, top_k: int) -> list[tuple[int, float]]:
        """The `top_k` most frequent next tokens after `node` with their share of all continuations."""
        count = self.count
        ranked = sorted(self.children[node].items(), key=lambda item: (-count[item[1]], item[0]))
        total = sum(count[child] for _, child in ranked)
        return [(token, count[child] / total) for token, child in ranked[:top_k]]

    def add(self, open_nodes: list[int], token: int) -> list[int]:
        """Extend a stream by `token`: `open_nodes` are its suffixes shorter than max_depth,
        shortest first; returns them for the longer stream."""
        children, count = self.children, self.count
        extended = []
        for node in (0, *open_nodes[: self.max_depth - 1]):
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = self._new_node()
            count[child] += 1
            extended.append(child)
        return extended

    def add_stream(self, tokens: Sequence[int]) -> None:
        open_nodes: list[int] = []
        for token in tokens:
            open_nodes = self.add(open_nodes, token)

    def remove_stream(self, tokens: Sequence[int]) -> None:
        """Undo `add_stream(tokens)`, pruning substrings no stream holds any more."""
        children, count = self.children, self.count
        for start in range(len(tokens)):
            node = 0
            for token in tokens[start : start + self.max_depth]:
                child = children[node][token]
                count[child] -= 1
                if count[child] == 0:  # and so is every longer substring below it
                    del children[node][token]
                    self._release(child)
                    break
                node = child

    def _release(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.children[node], self.count[node] = {}, 0
            self._free.append(node)

    def longest_match(self, context: Sequence[int]) -> tuple[int, int | None]:
        """The longest suffix of `context` seen before with a continuation: (its length, node).

        If a suffix of length m has been followed by some token, so has every shorter suffix
        (it is a substring of the same stream), so the length is found by bisection.
        """
        low, high, best = 1, min(len(context), self.max_depth - 1), None
        while low <= high:
            mid = (low + high) // 2
            node = self.walk(context[len(context) - mid :])
            if node is not None and self.children[node]:
                best, low = (mid, node), mid + 1
            else:
                high = mid - 1
        return best if best is not None else (0, None)


@dataclass(frozen=True)
class SuffixOptions:
    # vLLM's `suffix` method keys; the cache default is far below vLLM's 10000 because these
    # tries are Python objects (about max_tree_depth nodes per cached token).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 64  # 0 = no cross-request cache
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.suffix_decoding_max_tree_depth < 2:
            raise ValueError("suffix: suffix_decoding_max_tree_depth must be >= 2")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix: suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix: suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix: suffix_decoding_min_token_prob must be in [0, 1]")


@dataclass
class SuffixState:
    tokens: list[int]
    trie: SuffixTrie
    open_nodes: list[int]


@register_proposer("suffix")
class SuffixProposer(Proposer[SuffixState]):
    Options = SuffixOptions
    default_num_speculative_tokens = 24  # vLLM: suffix_decoding_max_tree_depth

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        options: SuffixOptions = self.config.options
        self.options = options
        self.shared = SuffixTrie(options.suffix_decoding_max_tree_depth)
        self.cached: collections.deque[list[int]] = collections.deque()

    def new_state(self, update: SequenceUpdate) -> SuffixState:
        return SuffixState([], SuffixTrie(self.options.suffix_decoding_max_tree_depth), [])

    def extend(self, state: SuffixState, update: SequenceUpdate) -> None:
        for token in update.new_tokens.tolist():
            state.open_nodes = state.trie.add(state.open_nodes, token)
            state.tokens.append(token)

    def retire(self, state: SuffixState) -> None:
        if self.options.suffix_decoding_max_cached_requests == 0:
            return
        self.shared.add_stream(state.tokens)
        self.cached.append(state.tokens)
        if len(self.cached) > self.options.suffix_decoding_max_cached_requests:
            self.shared.remove_stream(self.cached.popleft())

    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[SuffixState]) -> list[CandidateTree]:
        trees = []
        for update, state in zip(updates, states, strict=True):
            budget = self.budget(update)
            best: tuple[float, CandidateTree] | None = None
            for trie in (state.trie, self.shared):
                match_length, node = trie.longest_match(state.tokens)
                if node is None:
                    continue
                limit = math.ceil(self.options.suffix_decoding_max_spec_factor * match_length)
                found = grow_tree(
                    update, trie, node, budget, limit, self.options.suffix_decoding_min_token_prob
                )
                if found is not None and (best is None or found[0] > best[0]):
                    best = found
            trees.append(best[1] if best is not None else root_only_tree(update))
        return trees


def grow_tree(
    update: SequenceUpdate, trie: SuffixTrie, match: int, budget: TreeBudget, max_drafts: int, min_prob: float
) -> tuple[float, CandidateTree] | None:
    """Best-first tree of continuations below `match`: (expected accepted tokens, tree).

    The expected count is the sum of path probabilities, the tree's score when the shared
    and own tries both match. None when no continuation reaches `min_prob`.
    """
    max_drafts = min(max_drafts, budget.max_nodes - 1)
    if budget.top_k == 0 or budget.max_depth == 0 or max_drafts <= 0:
        return None
    tokens, parents, depths, trie_nodes = [int(update.new_tokens[-1])], [-1], [0], [match]
    q_rows: dict[int, list[tuple[int, float]]] = {}
    # Heap of (-path probability, order pushed, token, parent node, trie node): the order
    # keeps ties stable, and a child is pushed only after its parent joined the tree.
    frontier: list[tuple[float, int, int, int, int]] = []
    pushed = 0

    def push_children(node: int, path_prob: float) -> None:
        nonlocal pushed
        if depths[node] == budget.max_depth or not trie.children[trie_nodes[node]]:
            return
        q_rows[node] = trie.continuations(trie_nodes[node], budget.top_k)
        for token, prob in q_rows[node]:
            child = trie.children[trie_nodes[node]][token]
            heapq.heappush(frontier, (-path_prob * prob, pushed, token, node, child))
            pushed += 1

    push_children(0, 1.0)
    expected = 0.0
    while frontier and len(tokens) <= max_drafts:
        neg_prob, _, token, parent, trie_node = heapq.heappop(frontier)
        if -neg_prob < min_prob:
            break
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        trie_nodes.append(trie_node)
        expected -= neg_prob
        push_children(len(tokens) - 1, -neg_prob)
    if len(tokens) == 1:
        return None
    expanded = sorted(set(parents[1:]))
    q_width = max(len(q_rows[u]) for u in expanded)
    q_ids = torch.full((len(expanded), q_width), -1, dtype=torch.int64)  # [num_expanded, q_width]
    q_probs = torch.zeros(len(expanded), q_width, dtype=torch.float32)  # [num_expanded, q_width]
    for row, node in enumerate(expanded):
        ids, probs = zip(*q_rows[node], strict=True)
        q_ids[row, : len(ids)] = torch.tensor(ids)
        q_probs[row, : len(probs)] = torch.tensor(probs)
    tree = CandidateTree(
        seq_id=update.seq_id,
        round=update.round,
        tokens=torch.tensor(tokens, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        q_nodes=torch.tensor(expanded, dtype=torch.int64),
        q_token_ids=q_ids,
        q_probs=q_probs,
        sampling=DraftSampling.DETERMINISTIC,
    )
    return expected, tree
