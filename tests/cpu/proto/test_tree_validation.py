"""Every arriving candidate tree is checked: each way a drafter can break the contract is refused
with a message naming the field, index and value; valid chains and trees pass."""

from __future__ import annotations

import math
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.proto import (
    CandidateTree,
    DraftResponse,
    DraftSampling,
    InvalidDraftError,
    TreeBudget,
    check_trees,
    receive_trees,
    validate_tree,
)

VOCAB = 16
BUDGET = TreeBudget(max_nodes=8, max_depth=4, top_k=3)


def make_tree(
    sampling: DraftSampling = DraftSampling.WITHOUT_REPLACEMENT, **overrides: object
) -> CandidateTree:
    """root 0 -> {1 -> {3}, 2}; nodes 0 and 1 are expanded."""
    fields: dict[str, object] = {
        "seq_id": 7,
        "round": 3,
        "tokens": torch.tensor([5, 7, 9, 11]),
        "parents": torch.tensor([-1, 0, 0, 1]),
        "q_nodes": torch.tensor([0, 1]),
        "q_token_ids": torch.tensor([[7, 9, 3], [11, -1, -1]]),
        "q_probs": torch.tensor([[0.5, 0.3, 0.1], [0.9, 0.0, 0.0]]),
        "sampling": sampling,
    }
    fields.update(overrides)
    return CandidateTree(**fields)  # type: ignore[arg-type]


def rejects(tree: CandidateTree, match: str, budget: TreeBudget = BUDGET) -> None:
    with pytest.raises(InvalidDraftError, match=match) as caught:
        validate_tree(tree, budget, VOCAB)
    assert str(caught.value).startswith("tree seq_id=7 round=3: ")


@pytest.mark.parametrize("sampling", list(DraftSampling))
def test_accepts_hand_built_tree(sampling: DraftSampling) -> None:
    validate_tree(make_tree(sampling), BUDGET, VOCAB)


@pytest.mark.parametrize("sampling", list(DraftSampling))
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_accepts_dummy_chains_and_trees(sampling: DraftSampling, top_k: int) -> None:
    tree = CandidateTree.make_dummy(12, vocab_size=50, top_k=top_k, sampling=sampling, seed=top_k)
    validate_tree(tree, TreeBudget(max_nodes=12, max_depth=11, top_k=top_k), 50)


def test_accepts_root_only_tree() -> None:
    tree = make_tree(
        tokens=torch.tensor([5]),
        parents=torch.tensor([-1]),
        q_nodes=torch.zeros(0, dtype=torch.int64),
        q_token_ids=torch.zeros(0, 0, dtype=torch.int64),
        q_probs=torch.zeros(0, 0),
    )
    validate_tree(tree, TreeBudget(max_nodes=1, max_depth=0, top_k=0), VOCAB)


def test_deterministic_tree_needs_no_q() -> None:
    tree = make_tree(
        DraftSampling.DETERMINISTIC,
        q_nodes=torch.zeros(0, dtype=torch.int64),
        q_token_ids=torch.zeros(0, 3, dtype=torch.int64),
        q_probs=torch.zeros(0, 3),
    )
    validate_tree(tree, BUDGET, VOCAB)


def test_rejects_cycle() -> None:
    # 1 -> 2 -> 1: any cycle needs a parent that does not precede its child.
    rejects(make_tree(parents=torch.tensor([-1, 2, 1, 1])), r"parents\[1\] = 2 must be in \[0, 1\)")


def test_rejects_self_parent() -> None:
    rejects(make_tree(parents=torch.tensor([-1, 0, 2, 1])), r"parents\[2\] = 2 must be in \[0, 2\)")


def test_rejects_forward_parent() -> None:
    rejects(make_tree(parents=torch.tensor([-1, 0, 3, 1])), r"parents\[2\] = 3 must be in \[0, 2\)")


def test_rejects_parent_out_of_range() -> None:
    rejects(make_tree(parents=torch.tensor([-1, 0, 0, 99])), r"parents\[3\] = 99 must be in \[0, 3\)")


def test_rejects_negative_parent_of_non_root() -> None:
    rejects(make_tree(parents=torch.tensor([-1, 0, -1, 1])), r"parents\[2\] = -1 must be in \[0, 2\)")


def test_rejects_root_with_a_parent() -> None:
    rejects(make_tree(parents=torch.tensor([0, 0, 0, 1])), r"parents\[0\] = 0 must be -1")


@pytest.mark.parametrize("token", [VOCAB, -1, 2**40])
def test_rejects_out_of_vocab_token(token: int) -> None:
    rejects(
        make_tree(tokens=torch.tensor([5, 7, 9, token])), rf"tokens\[3\] = {token} is outside the vocabulary"
    )


def test_rejects_out_of_vocab_q_token() -> None:
    ids = torch.tensor([[7, 9, VOCAB], [11, -1, -1]])
    rejects(make_tree(q_token_ids=ids), rf"q_token_ids\[0, 2\] = {VOCAB} is outside the vocabulary")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_rejects_non_finite_probability(value: float) -> None:
    probs = torch.tensor([[0.5, 0.3, 0.1], [0.9, 0.0, value]])
    rejects(make_tree(q_probs=probs), rf"q_probs\[1, 2\] = {value} is not finite")


def test_rejects_negative_probability() -> None:
    probs = torch.tensor([[0.5, 0.3, -0.1], [0.9, 0.0, 0.0]])
    rejects(make_tree(q_probs=probs), r"q_probs\[0, 2\] = -0.1\d* is outside \[0, 1\]")


def test_rejects_probability_over_one() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.1], [1.5, 0.0, 0.0]])
    rejects(make_tree(q_probs=probs), r"q_probs\[1, 0\] = 1.5 is outside \[0, 1\]")


def test_rejects_q_sum_over_one() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.2], [0.9, 0.0, 0.0]])
    rejects(make_tree(q_probs=probs), r"q_probs\[0\] sums to 1.1, over 1 \+ 0.001")


def test_accepts_q_sum_within_tolerance() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.1001], [0.9, 0.0, 0.0]])
    validate_tree(make_tree(q_probs=probs), BUDGET, VOCAB)


def test_rejects_mass_on_padding() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.1], [0.9, 0.05, 0.0]])
    rejects(make_tree(q_probs=probs), r"q_probs\[1, 1\] = 0.05\d* must be 0 where q_token_ids is -1")


def test_rejects_token_listed_twice_in_a_q_row() -> None:
    ids = torch.tensor([[7, 9, 9], [11, -1, -1]])
    rejects(make_tree(q_token_ids=ids), r"q_token_ids\[0\] lists token 9 twice")


def test_rejects_too_many_nodes() -> None:
    rejects(make_tree(), r"4 nodes, over the budget's max_nodes = 3", TreeBudget(3, 4, 3))


def test_rejects_too_deep() -> None:
    rejects(make_tree(), r"node 3 is at depth 2, over the budget's max_depth = 1", TreeBudget(8, 1, 3))


def test_rejects_too_many_children() -> None:
    tree = make_tree(DraftSampling.DETERMINISTIC, parents=torch.tensor([-1, 0, 0, 0]))
    tree.q_token_ids, tree.q_probs = tree.q_token_ids[:, :2], tree.q_probs[:, :2]
    rejects(tree, r"node 0 has 3 children, over the budget's top_k = 2", TreeBudget(8, 4, 2))


def test_rejects_q_wider_than_budget() -> None:
    rejects(
        make_tree(),
        r"q rows have 3 entries, over the budget's q_width = 2",
        TreeBudget(8, 4, 2),
    )
    validate_tree(make_tree(), TreeBudget(8, 4, 2, q_width=3), VOCAB)  # a wider q row is allowed


def test_rejects_mismatched_lengths() -> None:
    rejects(make_tree(parents=torch.tensor([-1, 0, 0])), r"len\(parents\) = 3 but len\(tokens\) = 4")


def test_rejects_mismatched_q_shapes() -> None:
    rejects(
        make_tree(q_probs=torch.tensor([[0.5, 0.3], [0.9, 0.0]])),
        r"q_token_ids has shape \[2, 3\] but q_probs",
    )
    rejects(make_tree(q_nodes=torch.tensor([0])), r"q_token_ids has 2 rows but len\(q_nodes\) = 1")


def test_rejects_empty_tree() -> None:
    rejects(
        make_tree(tokens=torch.zeros(0, dtype=torch.int64), parents=torch.zeros(0, dtype=torch.int64)),
        "empty",
    )


def test_rejects_wrong_dtype() -> None:
    rejects(
        make_tree(parents=torch.tensor([-1, 0, 0, 1], dtype=torch.int32)),
        r"parents must be a 1-D torch.int64",
    )
    rejects(
        make_tree(q_probs=torch.tensor([[0.5, 0.3, 0.1], [0.9, 0, 0]], dtype=torch.float64)),
        "q_probs must be",
    )


def test_rejects_q_node_out_of_range() -> None:
    rejects(make_tree(q_nodes=torch.tensor([0, 4])), r"q_nodes\[1\] = 4 is not a node of this 4-node tree")


def test_rejects_q_node_listed_twice() -> None:
    rejects(make_tree(q_nodes=torch.tensor([1, 1])), r"q_nodes\[0\] = 1 appears twice")


@pytest.mark.parametrize("sampling", [DraftSampling.WITH_REPLACEMENT, DraftSampling.WITHOUT_REPLACEMENT])
def test_sampled_tree_rejects_children_without_q(sampling: DraftSampling) -> None:
    tree = make_tree(sampling, q_nodes=torch.tensor([0]), q_token_ids=torch.tensor([[7, 9, 3]]))
    tree.q_probs = tree.q_probs[:1]
    rejects(tree, r"node 1 has children but no q row")


def test_sampled_tree_without_any_q_row_is_rejected() -> None:
    """No q row in the whole batch takes the path that skips the q checks: still rejected."""
    tree = make_tree(
        DraftSampling.WITHOUT_REPLACEMENT,
        q_nodes=torch.zeros(0, dtype=torch.int64),
        q_token_ids=torch.zeros(0, 3, dtype=torch.int64),
    )
    tree.q_probs = tree.q_probs[:0]
    rejects(tree, r"node 0 has children but no q row")


def test_sampled_tree_rejects_child_outside_q_support() -> None:
    rejects(
        make_tree(tokens=torch.tensor([5, 7, 4, 11])),
        r"tokens\[2\] = 4 has probability 0 under the q of its parent",
    )


def test_sampled_tree_rejects_child_with_zero_q_probability() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.1], [0.9, 0.0, 0.0]])
    rejects(make_tree(q_probs=probs), r"tokens\[2\] = 9 has probability 0")


@pytest.mark.parametrize("sampling", [DraftSampling.WITHOUT_REPLACEMENT, DraftSampling.DETERMINISTIC])
def test_distinct_modes_reject_repeated_siblings(sampling: DraftSampling) -> None:
    rejects(
        make_tree(sampling, tokens=torch.tensor([5, 7, 7, 11])),
        r"tokens\[\d\] = 7 repeats a sibling's token under node 0",
    )


def test_with_replacement_allows_repeated_siblings() -> None:
    """i.i.d. draws may repeat; a target that does not trust the drafter prunes the repeats
    when it demotes the tree (`target_worker.draft_trust.demote`)."""
    validate_tree(
        make_tree(DraftSampling.WITH_REPLACEMENT, tokens=torch.tensor([5, 7, 7, 11])), BUDGET, VOCAB
    )


def test_batch_reports_each_bad_tree_and_only_those() -> None:
    good = [CandidateTree.make_dummy(6, vocab_size=VOCAB, seq_id=i, seed=i) for i in range(3)]
    cyclic = make_tree(seq_id=11, parents=torch.tensor([-1, 2, 1, 1]))
    nan = make_tree(seq_id=12, q_probs=torch.tensor([[0.5, math.nan, 0.1], [0.9, 0.0, 0.0]]))
    ragged = make_tree(seq_id=13, parents=torch.tensor([-1]))
    trees = [good[0], cyclic, good[1], nan, ragged, good[2]]
    errors = check_trees(trees, [BUDGET] * len(trees), VOCAB)
    assert [error is None for error in errors] == [True, False, True, False, False, True]
    assert "seq_id=11" in str(errors[1]) and "parents[1]" in str(errors[1])
    assert "seq_id=12" in str(errors[3]) and "not finite" in str(errors[3])
    assert "seq_id=13" in str(errors[4]) and "len(parents)" in str(errors[4])


def test_receive_trees_keeps_the_good_and_explains_the_rest() -> None:
    budgets = {i: BUDGET for i in range(4)}
    trees = [CandidateTree.make_dummy(5, vocab_size=VOCAB, seq_id=i, seed=i) for i in range(3)]
    message = DraftResponse(trees).to_proto()
    message.trees.append(trees[0].to_proto())  # a second tree for seq 0
    message.trees.append(make_tree(seq_id=99).to_proto())  # nobody asked
    bad_sampling = message.trees.add(seq_id=3, round=1, tokens=[1], parents=[-1])  # sampling UNSPECIFIED
    bad_values = make_tree(seq_id=2, tokens=torch.tensor([5, 7, 9, VOCAB])).to_proto()
    message.trees[2].CopyFrom(bad_values)
    kept, errors = receive_trees(message, budgets, VOCAB)
    assert [tree.seq_id for tree in kept] == [0, 1]
    text = "\n".join(map(str, errors))
    assert len(errors) == 4, text
    assert "a second tree" in text and "seq_id=99" in text and "DRAFT_SAMPLING_UNSPECIFIED" in text
    assert "tokens[3] = 16" in text
    assert bad_sampling.seq_id == 3


def _reference_structure_ok(parents: list[int], budget: TreeBudget) -> bool:
    """A per-node Python walk: the obviously correct version of the vectorised checks."""
    if not parents or len(parents) > budget.max_nodes or parents[0] != -1:
        return False
    if any(not 0 <= p < i for i, p in enumerate(parents) if i > 0):
        return False
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return max(depths) <= budget.max_depth and all(
        parents.count(u) <= budget.top_k for u in range(len(parents))
    )


@settings(max_examples=100, deadline=None)
@given(
    batch=st.lists(st.lists(st.integers(-2, 9), min_size=1, max_size=10), min_size=1, max_size=6),
    max_depth=st.integers(0, 6),
    top_k=st.integers(1, 4),
)
def test_structure_checks_match_a_python_walk(batch: list[list[int]], max_depth: int, top_k: int) -> None:
    budget = TreeBudget(max_nodes=9, max_depth=max_depth, top_k=top_k)
    trees = []
    for seq_id, parents in enumerate(batch):
        fixed = [-1 if i == 0 and p == -2 else p for i, p in enumerate(parents)]
        trees.append(
            make_tree(
                DraftSampling.DETERMINISTIC,
                seq_id=seq_id,
                tokens=torch.zeros(len(fixed), dtype=torch.int64),
                parents=torch.tensor(fixed),
                q_nodes=torch.zeros(0, dtype=torch.int64),
                q_token_ids=torch.zeros(0, 1, dtype=torch.int64),
                q_probs=torch.zeros(0, 1),
            )
        )
    errors = check_trees(trees, [budget] * len(trees), VOCAB)
    for tree, error in zip(trees, errors, strict=True):
        assert (error is None) == _reference_structure_ok(tree.parents.tolist(), budget), error


@settings(max_examples=300, deadline=None)
@given(
    batch=st.lists(
        st.tuples(
            st.integers(1, 9),  # nodes
            st.sampled_from(
                ["none", "rows", "token", "parent", "q_id", "q_prob", "q_nan", "q_nodes", "q_wide", "sampled"]
            ),  # what is off a plain chain (rows: point-mass q rows, as prompt lookup sends)
            st.integers(0, 8),  # where
        ),
        min_size=1,
        max_size=5,
    ),
    max_depth=st.integers(0, 8),
    top_k=st.integers(1, 3),
)
def test_plain_chains_skip_the_value_checks_with_the_same_verdicts(batch, max_depth, top_k) -> None:
    """Deterministic chains with at most point-mass q rows (prompt lookup, drafters at T = 0)
    are accepted without the vectorised checks; anything off such a chain still goes through
    them, and every verdict and message is what the checks alone give."""
    from outrider.proto import validation

    budget = TreeBudget(max_nodes=9, max_depth=max_depth, top_k=top_k, q_width=2)
    trees = []
    for seq_id, (num_nodes, off, where) in enumerate(batch):
        tokens, parents = list(range(num_nodes)), list(range(-1, num_nodes - 1))
        at = min(where, num_nodes - 1)
        rows = max(num_nodes - 1, 1) if off not in ("none", "token", "parent", "sampled") else 0
        q_nodes, q_ids, q_probs = list(range(rows)), [[t] for t in tokens[1:] or [0]], [[1.0]] * rows
        sampling = DraftSampling.WITHOUT_REPLACEMENT if off == "sampled" else DraftSampling.DETERMINISTIC
        if off == "token":
            tokens[at] = VOCAB + where
        elif off == "parent" and at > 0:
            parents[at] = at - 1 - where % 2 if where % 3 else at
        elif off == "q_id":
            q_ids[min(at, rows - 1)] = [VOCAB if where % 2 else -1]
        elif off in ("q_prob", "q_nan"):
            q_probs = [[1.0]] * (rows - 1) + [[math.nan if off == "q_nan" else 1.0 + where / 8]]
        elif off == "q_nodes":
            q_nodes = [min(where, rows)] + q_nodes[1:]
        elif off == "q_wide":
            q_ids, q_probs = (
                [row + [VOCAB if where % 2 else -1] for row in q_ids],
                [r + [0.0] for r in q_probs],
            )
        width = len(q_ids[0])
        trees.append(
            make_tree(
                sampling,
                seq_id=seq_id,
                tokens=torch.tensor(tokens),
                parents=torch.tensor(parents),
                q_nodes=torch.tensor(q_nodes, dtype=torch.int64),
                q_token_ids=torch.tensor(q_ids[:rows], dtype=torch.int64).reshape(rows, width),
                q_probs=torch.tensor(q_probs[:rows], dtype=torch.float32).reshape(rows, width),
            )
        )
    budgets = [budget] * len(trees)
    fast = [None if e is None else str(e) for e in check_trees(trees, budgets, VOCAB)]
    with patch.object(validation, "_plain_chain", lambda *_: False):
        full = [None if e is None else str(e) for e in check_trees(trees, budgets, VOCAB)]
    assert fast == full
    # (Not vacuous: plain chains within the budget pass.)
    plain = [i for i, (n, off, _) in enumerate(batch) if off in ("none", "rows") and n - 1 <= max_depth]
    assert all(fast[i] is None for i in plain)
