"""Validation of candidate trees: nothing a drafter sends reaches a kernel unchecked.

A drafter is untrusted (docs/architecture.md, "Invariants"): a tree with a cycle, an out-of-vocabulary
token or a q that sums past one would crash a kernel or, worse, silently bias verification.
The checks run every round for the whole batch, so they are vectorised over the batch
flattened into one ragged layout (as in vLLM):

    trees      A (3 nodes)   B (2 nodes)
    node       0  1  2       3  4           global index; owner = [0, 0, 0, 1, 1]
    local      0  1  2       0  1           index inside its own tree, used in messages
    start      0  0  0       3  3           global index of the tree's root

Each check yields a boolean mask over nodes (or q entries); Python only runs for the few
elements that fail, to write the message. The masks are numpy arrays over views of the
trees' CPU tensors: the same vectorised checks cost ~10x less per call than torch ops,
which matters every round at small batches. A tree reports the first failing check in the
order below, so later checks may assume the earlier ones passed for it: that is why parents
are checked before depths are computed from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from outrider.proto import outrider_pb2 as pb
from outrider.proto.errors import InvalidDraftError
from outrider.proto.messages import TreeBudget
from outrider.proto.tree import CandidateTree, DraftSampling, tree_label

# A q row is the top-k of a float32 softmax, so its sum may pass 1 by rounding alone
# (~1e-6); anything past 1e-3 is a drafter bug, not arithmetic.
PROB_TOLERANCE = 1e-3


def validate_tree(
    tree: CandidateTree, budget: TreeBudget, vocab_size: int, *, prob_tolerance: float = PROB_TOLERANCE
) -> None:
    """Raise InvalidDraftError unless `tree` is well formed and fits `budget`."""
    (error,) = check_trees([tree], [budget], vocab_size, prob_tolerance=prob_tolerance)
    if error is not None:
        raise error


def check_trees(
    trees: Sequence[CandidateTree],
    budgets: Sequence[TreeBudget],
    vocab_size: int,
    *,
    prob_tolerance: float = PROB_TOLERANCE,
) -> list[InvalidDraftError | None]:
    """For each tree, None if valid under its budget, else the error saying why.

    Trees hold CPU tensors, as `CandidateTree.from_proto` makes them: this checks what came
    off the wire, before anything is moved to a device.
    """
    if len(trees) != len(budgets):
        raise ValueError(f"{len(trees)} trees but {len(budgets)} budgets")
    errors: list[InvalidDraftError | None] = [None] * len(trees)
    kept = []
    for i, (tree, budget) in enumerate(zip(trees, budgets, strict=True)):
        problem = _shape_problem(tree, budget)
        if problem is None:
            if not _plain_chain(tree, budget, vocab_size):
                kept.append(i)
        else:
            errors[i] = InvalidDraftError(f"{tree_label(tree.seq_id, tree.round)}: {problem}")
    if kept:
        kept_budgets = [budgets[i] for i in kept]
        found = _check_values([trees[i] for i in kept], kept_budgets, vocab_size, prob_tolerance)
        for position, message in found.items():
            errors[kept[position]] = InvalidDraftError(message)
    return errors


def receive_trees(
    message: pb.DraftResponse,
    budgets: Mapping[int, TreeBudget],
    vocab_size: int,
    *,
    prob_tolerance: float = PROB_TOLERANCE,
) -> tuple[list[CandidateTree], list[InvalidDraftError]]:
    """Decode and check a response: (the valid trees, an error per dropped tree).

    `budgets` maps each seq_id awaiting a tree to the budget it was sent; a tree for any
    other seq_id, or a second tree for the same one, is dropped. Matching rounds is the
    caller's business: a stale tree is not malformed.
    """
    trees: list[CandidateTree] = []
    errors: list[InvalidDraftError] = []
    seen: set[int] = set()
    for tree_message in message.trees:
        label = tree_label(tree_message.seq_id, tree_message.round)
        if tree_message.seq_id not in budgets:
            errors.append(InvalidDraftError(f"{label}: no sequence with this seq_id awaits a tree"))
        elif tree_message.seq_id in seen:
            errors.append(InvalidDraftError(f"{label}: a second tree for the same seq_id in one response"))
        else:
            seen.add(tree_message.seq_id)
            try:
                trees.append(CandidateTree.from_proto(tree_message))
            except InvalidDraftError as error:
                errors.append(error)
    tree_budgets = [budgets[tree.seq_id] for tree in trees]
    results = check_trees(trees, tree_budgets, vocab_size, prob_tolerance=prob_tolerance)
    errors.extend(error for error in results if error is not None)
    return [tree for tree, error in zip(trees, results, strict=True) if error is None], errors


def _shape_problem(tree: CandidateTree, budget: TreeBudget) -> str | None:
    """What is wrong with the tree's tensor types and sizes, before any value is read."""
    expected = {
        "tokens": (torch.int64, 1),
        "parents": (torch.int64, 1),
        "q_nodes": (torch.int64, 1),
        "q_token_ids": (torch.int64, 2),
        "q_probs": (torch.float32, 2),
    }
    for name, (dtype, ndim) in expected.items():
        value = getattr(tree, name)
        if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.dim() != ndim:
            got = f"{value.dtype} of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else value
            return f"{name} must be a {ndim}-D {dtype} tensor, got {got}"
    if not isinstance(tree.sampling, DraftSampling):
        return f"sampling = {tree.sampling!r} is not a DraftSampling"
    num_nodes = tree.tokens.shape[0]
    if num_nodes == 0:
        return "tokens is empty: a tree holds at least its root"
    if tree.parents.shape[0] != num_nodes:
        return f"len(parents) = {tree.parents.shape[0]} but len(tokens) = {num_nodes}"
    if num_nodes > budget.max_nodes:
        return f"{num_nodes} nodes, over the budget's max_nodes = {budget.max_nodes}"
    if tree.q_token_ids.shape != tree.q_probs.shape:
        return f"q_token_ids has shape {list(tree.q_token_ids.shape)} but q_probs {list(tree.q_probs.shape)}"
    if tree.q_token_ids.shape[0] != tree.q_nodes.shape[0]:
        return f"q_token_ids has {tree.q_token_ids.shape[0]} rows but len(q_nodes) = {tree.q_nodes.shape[0]}"
    if tree.q_token_ids.shape[1] > budget.q_width:
        return (
            f"q rows have {tree.q_token_ids.shape[1]} entries, over the budget's q_width = {budget.q_width}"
        )
    return None


def _plain_chain(tree: CandidateTree, budget: TreeBudget, vocab_size: int) -> bool:
    """Whether the tree (which passed `_shape_problem`) is a deterministic chain whose depth fits
    the budget, whose tokens are in the vocabulary, and whose q rows (if any) are one entry
    each, for nodes 0, 1, .. in order, a token in the vocabulary with a probability in [0, 1]:
    every check of `_check_values` passes on it (parents -1, 0, 1, ..: each precedes its child,
    one child a node, depth n - 1; no sampled or sibling check applies to it), so those are
    not run for it. That is what prompt lookup sends (a point-mass row a draft), and drafters
    at T = 0; at batch 1 the vectorised checks' ~50 numpy calls cost ~250 us of a ~5.4 ms
    round (ngram, K = 4, the small demo)."""
    num_nodes, num_rows = tree.tokens.shape[0], tree.q_nodes.shape[0]
    if tree.sampling != DraftSampling.DETERMINISTIC or num_rows > num_nodes:
        return False
    if num_nodes - 1 > budget.max_depth or (num_nodes > 1 and budget.top_k < 1):
        return False
    if tree.parents.tolist() != list(range(-1, num_nodes - 1)):
        return False
    tokens = tree.tokens.tolist()
    if num_rows:
        if tree.q_token_ids.shape[1] != 1 or tree.q_nodes.tolist() != list(range(num_rows)):
            return False
        tokens += tree.q_token_ids[:, 0].tolist()
        probs = tree.q_probs[:, 0].tolist()
        if not all(0.0 <= p <= 1.0 for p in probs):  # (NaN fails both)
            return False
    return min(tokens) >= 0 and max(tokens) < vocab_size


class _Findings:
    """The first error of each tree, in the order the checks run."""

    def __init__(self, trees: Sequence[CandidateTree]) -> None:
        self.trees = trees
        self.messages: dict[int, str] = {}

    def flag(
        self, bad: np.ndarray, owner: np.ndarray, template: str, **fields: np.ndarray | int | float
    ) -> None:
        """Record `template` for each tree owning a `bad` element, unless it has an error already.

        `bad` and `owner` are [num_elements] (owner = the tree of each element); tensor
        `fields` are [num_elements] and give the failing element's values to the template.
        """
        if not bool(bad.any()):
            return
        for element in np.flatnonzero(bad).tolist():
            position = int(owner[element])
            if position in self.messages:
                continue
            values = {k: v[element].item() if isinstance(v, np.ndarray) else v for k, v in fields.items()}
            tree = self.trees[position]
            self.messages[position] = f"{tree_label(tree.seq_id, tree.round)}: {template.format(**values)}"


def _ragged(sizes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For segments of `sizes`: owner [total], local index [total], segment starts [len(sizes)]."""
    counts = np.array(sizes, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    owner = np.repeat(np.arange(len(sizes)), counts)
    local = np.arange(int(counts.sum())) - starts[owner]
    return owner, local, starts


def _check_values(
    trees: Sequence[CandidateTree], budgets: Sequence[TreeBudget], vocab_size: int, prob_tolerance: float
) -> dict[int, str]:
    """Messages for the trees (which passed `_shape_problem`) whose values break the contract."""
    findings = _Findings(trees)
    sizes = [tree.tokens.shape[0] for tree in trees]
    owner, local, starts = _ragged(sizes)
    num_total = len(owner)
    node = np.arange(num_total)
    tokens = _cat([tree.tokens for tree in trees])  # [num_total]
    parents = _cat([tree.parents for tree in trees])  # [num_total], local indices
    max_depth = np.array([budget.max_depth for budget in budgets])[owner]  # [num_total]
    top_k = np.array([budget.top_k for budget in budgets])[owner]  # [num_total]
    modes = np.array([int(tree.sampling) for tree in trees])[owner]  # [num_total]

    findings.flag(
        (tokens < 0) | (tokens >= vocab_size),
        owner,
        "tokens[{i}] = {token} is outside the vocabulary [0, {vocab})",
        i=local,
        token=tokens,
        vocab=vocab_size,
    )
    is_root = local == 0
    findings.flag(
        is_root & (parents != -1), owner, "parents[0] = {p} must be -1: node 0 is the root", p=parents
    )
    linked = ~is_root & (parents >= 0) & (parents < local)
    findings.flag(
        ~is_root & ~linked,
        owner,
        "parents[{i}] = {p} must be in [0, {i}): parents precede their children, which also rules out cycles",
        i=local,
        p=parents,
    )

    # Global parent index; a root or broken link points at itself so every walk stays in range.
    gparent = np.where(linked, parents + starts[owner], node)  # [num_total]
    # Depth by pointer jumping: after step s each node knows its distance to its 2^s-th
    # ancestor, so log2(max nodes) steps reach every root.
    depth, jump = linked.astype(np.int64), gparent
    for _ in range((max(sizes) - 1).bit_length()):
        depth, jump = depth + depth[jump], jump[jump]
    findings.flag(
        depth > max_depth,
        owner,
        "node {i} is at depth {depth}, over the budget's max_depth = {limit}",
        i=local,
        depth=depth,
        limit=max_depth,
    )
    num_children = np.bincount(gparent[linked], minlength=num_total)  # [num_total]
    findings.flag(
        num_children > top_k,
        owner,
        "node {i} has {n} children, over the budget's top_k = {limit}",
        i=local,
        n=num_children,
        limit=top_k,
    )

    # q rows of the whole batch, padded to its widest row with padding entries (-1 / 0.0).
    # Groups of checks that cannot fail are skipped (no q rows, no sampled tree, no node with
    # two children): at batch 1 each numpy call costs more than the elements it checks, and
    # a 5-node chain took ~0.5 ms to check with every group run.
    width = max(tree.q_token_ids.shape[1] for tree in trees)
    if any(tree.q_nodes.shape[0] for tree in trees):
        q_ids = np.concatenate([_pad_to(tree.q_token_ids, width, -1) for tree in trees])  # [num_rows, width]
        q_probs = np.concatenate([_pad_to(tree.q_probs, width, 0.0) for tree in trees])  # [num_rows, width]
        node_row = _check_q(trees, findings, q_ids, q_probs, starts, vocab_size, prob_tolerance)
    else:
        q_ids, node_row = None, np.full(num_total, -1, dtype=np.int64)

    # Sampled modes: the verifier needs the q each child was drawn from, and a child the
    # drafter claims to have drawn must be possible under it.
    sampled = modes != DraftSampling.DETERMINISTIC
    if sampled.any():
        findings.flag(
            sampled & (num_children > 0) & (node_row < 0),
            owner,
            "node {i} has children but no q row (q_nodes lacks it); sampled trees must send the q "
            "their children were drawn from",
            i=local,
        )
    if q_ids is not None and sampled.any():
        parent_row = node_row[gparent]
        rows = np.maximum(parent_row, 0)
        in_support = ((q_ids[rows] == tokens[:, None]) & (q_probs[rows] > 0)).any(axis=1)
        findings.flag(
            sampled & linked & (parent_row >= 0) & ~in_support,
            owner,
            "tokens[{i}] = {token} has probability 0 under the q of its parent node {p}",
            i=local,
            token=tokens,
            p=parents,
        )
    # Siblings are distinct except in WITH_REPLACEMENT trees (i.i.d. draws may repeat): without
    # replacement a repeat would make the verifier's q update (zero the rejected token,
    # renormalise) wrong, and a deterministic repeat is a node verified for nothing (its token
    # was zeroed in the residual when its first copy was rejected).
    if num_children.max() < 2:  # no node has siblings
        return findings.messages
    in_vocab = (tokens >= 0) & (tokens < vocab_size)
    distinct = (modes != DraftSampling.WITH_REPLACEMENT) & linked & in_vocab
    key = np.where(distinct, gparent * vocab_size + tokens, -1 - node)  # unique where not checked
    _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    findings.flag(
        distinct & (counts[inverse] > 1),
        owner,
        "tokens[{i}] = {token} repeats a sibling's token under node {p}; only WITH_REPLACEMENT "
        "siblings may repeat",
        i=local,
        token=tokens,
        p=parents,
    )
    return findings.messages


def _pad_to(values: torch.Tensor, width: int, fill: float) -> np.ndarray:
    """`values` [rows, k] widened to [rows, width] with `fill`; usually a no-op (same k)."""
    array = values.numpy()
    if array.shape[1] == width:
        return array
    return np.pad(array, ((0, 0), (0, width - array.shape[1])), constant_values=fill)


def _cat(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """1-D CPU tensors, back to back, as one numpy array (views, no copy until the concatenate)."""
    return np.concatenate([t.numpy() for t in tensors])


def _check_q(
    trees: Sequence[CandidateTree],
    findings: _Findings,
    q_ids: np.ndarray,
    q_probs: np.ndarray,
    starts: np.ndarray,
    vocab_size: int,
    prob_tolerance: float,
) -> np.ndarray:
    """Check the batch's sparse q rows (`q_ids`, `q_probs` [num_rows, width]).

    Returns node_row [num_total]: each node's q row, -1 if it has none.
    """
    num_rows, width = q_ids.shape
    num_total = sum(tree.tokens.shape[0] for tree in trees)
    row_owner, row_local, _ = _ragged([tree.q_nodes.shape[0] for tree in trees])
    q_nodes = _cat([tree.q_nodes for tree in trees])  # [num_rows], local indices
    num_nodes = np.array([tree.tokens.shape[0] for tree in trees])[row_owner]  # [num_rows]

    in_tree = (q_nodes >= 0) & (q_nodes < num_nodes)
    findings.flag(
        ~in_tree,
        row_owner,
        "q_nodes[{r}] = {u} is not a node of this {n}-node tree",
        r=row_local,
        u=q_nodes,
        n=num_nodes,
    )
    # Rows outside their tree go to a spare slot past the end, so scatters stay in range.
    slot = np.where(in_tree, q_nodes + starts[row_owner], num_total)  # [num_rows]
    rows_per_node = np.bincount(slot, minlength=num_total + 1)
    findings.flag(
        in_tree & (rows_per_node[slot] > 1),
        row_owner,
        "q_nodes[{r}] = {u} appears twice: a node has one q",
        r=row_local,
        u=q_nodes,
    )

    # Entry-level checks on the flattened [num_rows * width] matrices; the messages' indices
    # are built only when some entry fails (the common case is that none does).
    ids, probs = q_ids.reshape(-1), q_probs.reshape(-1)
    checks = [
        (
            (ids < -1) | (ids >= vocab_size),
            "q_token_ids[{r}, {k}] = {v} is outside the vocabulary [0, {vocab}) (-1 pads)",
            ids,
        ),
        (~np.isfinite(probs), "q_probs[{r}, {k}] = {v} is not finite", probs),
        ((probs < 0) | (probs > 1), "q_probs[{r}, {k}] = {v} is outside [0, 1]", probs),
        (
            (ids == -1) & (probs != 0),
            "q_probs[{r}, {k}] = {v} must be 0 where q_token_ids is -1 (padding)",
            probs,
        ),
    ]
    if np.logical_or.reduce([bad for bad, _, _ in checks]).any():
        entry = {"r": np.repeat(row_local, width), "k": np.tile(np.arange(width), num_rows)}
        entry_owner = np.repeat(row_owner, width)
        for bad, template, values in checks:
            findings.flag(bad, entry_owner, template, v=values, vocab=vocab_size, **entry)
    if width > 1:
        sorted_ids = np.sort(q_ids, axis=1)
        repeated = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (
            sorted_ids[:, 1:] >= 0
        )  # [num_rows, width - 1]
        findings.flag(
            repeated.any(axis=1),
            row_owner,
            "q_token_ids[{r}] lists token {v} twice: a row is one sparse distribution",
            r=row_local,
            v=np.where(repeated, sorted_ids[:, 1:], -1).max(axis=1),
        )
    sums = q_probs.sum(axis=1, dtype=np.float64)  # [num_rows]
    findings.flag(
        sums > 1 + prob_tolerance,
        row_owner,
        "q_probs[{r}] sums to {total:.6g}, over 1 + {tolerance}",
        r=row_local,
        total=sums,
        tolerance=prob_tolerance,
    )

    node_row = np.full(num_total + 1, -1, dtype=np.int64)
    node_row[slot] = np.arange(num_rows)
    return node_row[:num_total]
