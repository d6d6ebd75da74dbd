"""`medusa`: the static tree's buffers, its cut to a budget, and the best tree for measured
head accuracies."""

from __future__ import annotations

import pytest
from medusa_testlib import CHOICES

from outrider.draft_worker.medusa.static_tree import StaticTree, best_choices
from outrider.proto import TreeBudget


def test_choices_compile_to_buffers_parents_first_siblings_by_rank():
    tree = StaticTree.compile(CHOICES, num_heads=3)
    # layout: root, (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert tree.rank.tolist() == [0, 0, 1, 2, 0, 1, 0, 0]
    assert tree.sibling.tolist() == [0, 0, 1, 2, 0, 1, 0, 0]
    assert tree.expanded.tolist() == [0, 1, 2, 4] and tree.q_width == 3


def test_a_budget_keeps_the_first_paths_that_fit_prefix_closed():
    tree = StaticTree.compile(CHOICES, num_heads=3)
    cut = tree.cut(TreeBudget(max_nodes=5, max_depth=2, top_k=2))
    assert cut.paths == ((0,), (1,), (0, 0), (0, 1))  # (2,) is past top_k, (0, 0, 0) past the depth
    # A path whose prefix was cut goes too, even when it fits.
    sparse = StaticTree.compile([(0,), (2,), (2, 0), (0, 0)], num_heads=2)
    assert sparse.cut(TreeBudget(max_nodes=8, max_depth=2, top_k=2)).paths == ((0,), (0, 0))


@pytest.mark.parametrize(
    "choices, message",
    [
        ([(0, 0)], "without"),
        ([(0,), (0,)], "twice"),
        ([(0,), (0, 0, 0, 0)], "ranks"),
        ([(-1,)], "ranks"),
    ],
)
def test_bad_choices_are_refused(choices, message):
    with pytest.raises(ValueError, match=message):
        StaticTree.compile(choices, num_heads=3)


def test_a_path_listed_before_its_prefix_waits_for_it():
    tree = StaticTree.compile([(0, 0), (1,), (0,), (0, 0, 0)], num_heads=3)
    assert tree.paths == ((1,), (0,), (0, 0), (0, 0, 0))
    assert tree.cut(TreeBudget(max_nodes=3, max_depth=3, top_k=2)).paths == ((1,), (0,))


def test_best_choices_follow_the_accuracies():
    accuracy = [[0.8, 0.1, 0.05], [0.5, 0.3, 0.1], [0.4, 0.2, 0.1]]
    assert best_choices(accuracy, TreeBudget(max_nodes=4, max_depth=3, top_k=1)) == [(0,), (0, 0), (0, 0, 0)]
    # values: (0,) .8, (0,0) .4, (0,1) .24, (0,0,0) .16, (1,) .1, (0,1,0) .096, (0,0,1) .08 ...
    choices = best_choices(accuracy, TreeBudget(max_nodes=7, max_depth=3, top_k=3))
    assert choices == [(0,), (0, 0), (0, 1), (0, 0, 0), (1,), (0, 1, 0)]
    StaticTree.compile(choices, num_heads=3)  # prefix-closed in priority order
