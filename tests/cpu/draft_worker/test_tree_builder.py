"""The EAGLE-2 tree builder: hand-built and reference-checked shapes, budgets, sampled children."""

import math

import pytest
import torch
from draft_testlib import VOCAB, assert_valid, bigram_table, depths, mixed_updates

from outrider.draft_worker import Frontier, build_proposer, build_trees
from outrider.kernels import process_logits
from outrider.proto import DraftSampling, SamplingParams, SequenceUpdate, TreeBudget

GREEDY = SamplingParams()


def bigram(tree_top_k=4, depth=4, nodes=16, sampling="without_replacement"):
    config = {
        "method": "test_bigram",
        "num_speculative_tokens": depth,
        "tree_top_k": tree_top_k,
        "tree_max_nodes": nodes,
        "draft_sampling": sampling,
    }
    return build_proposer(config, vocab_size=VOCAB)


def table_from_probs(rows: dict[int, dict[int, float]], vocab: int = 6) -> torch.Tensor:
    """Logits whose softmax is `rows` (tokens not listed share 1e-6)."""
    probs = torch.full((vocab, vocab), 1e-6)
    for token, row in rows.items():
        for child, p in row.items():
            probs[token, child] = p
    return (probs / probs.sum(-1, keepdim=True)).log()


def greedy_trees(table, roots, budgets):
    updates = [
        SequenceUpdate(i, 0, torch.tensor([r]), GREEDY, b)
        for i, (r, b) in enumerate(zip(roots, budgets, strict=True))
    ]
    trees = build_trees(
        updates,
        budgets,
        table[torch.tensor(roots)],
        lambda f: table[f.tokens],
        sampled_mode=DraftSampling.WITHOUT_REPLACEMENT,
        generators=[None] * len(updates),
    )
    assert_valid(trees, updates, table.shape[0])
    return trees


def test_hand_built_logits_give_the_known_top_n_tree():
    # Paths: 1 (.5), 1->4 (.35), 2 (.3), 2->4 (.27), 1->5 (.15), 2->5 (.03); 3 (.2) is not in top-2.
    table = table_from_probs({0: {1: 0.5, 2: 0.3, 3: 0.2}, 1: {4: 0.7, 5: 0.3}, 2: {4: 0.9, 5: 0.1}})
    small, large = TreeBudget(4, 2, 2), TreeBudget(6, 2, 2)
    tree_small, tree_large = greedy_trees(table, [0, 0], [small, large])
    assert tree_small.tokens.tolist() == [0, 1, 2, 4] and tree_small.parents.tolist() == [-1, 0, 0, 1]
    assert tree_large.tokens.tolist() == [0, 1, 2, 4, 5, 4]
    assert tree_large.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree_large.sampling == DraftSampling.DETERMINISTIC
    # q rows: the top-k softmax of each expanded node, children within them.
    assert tree_large.q_nodes.tolist() == [0, 1, 2]
    torch.testing.assert_close(
        tree_large.q_probs, torch.tensor([[0.5, 0.3], [0.7, 0.3], [0.9, 0.1]]), atol=1e-4, rtol=0
    )


def reference_eagle2(probs: torch.Tensor, root: int, budget: TreeBudget) -> dict[tuple[int, ...], float]:
    """EAGLE-2 written plainly: {path of draft tokens: path probability} of the kept nodes."""
    candidates: dict[tuple[int, ...], float] = {}
    frontier = {(): 1.0}
    for _ in range(budget.max_depth):
        level = {}
        for path, value in frontier.items():
            last = path[-1] if path else root
            top = probs[last].topk(budget.top_k)
            for p, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                level[(*path, token)] = value * p
        candidates |= level
        frontier = dict(sorted(level.items(), key=lambda kv: -kv[1])[: budget.top_k])
    return dict(sorted(candidates.items(), key=lambda kv: -kv[1])[: budget.max_nodes - 1])


@pytest.mark.parametrize(
    "budget", [TreeBudget(16, 4, 3), TreeBudget(9, 8, 1), TreeBudget(24, 5, 4), TreeBudget(3, 1, 4)]
)
def test_greedy_trees_match_a_plain_eagle2(budget):
    table = bigram_table(seed=3)
    roots = [0, 5, 7]
    for root, tree in zip(roots, greedy_trees(table, roots, [budget] * 3), strict=True):
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        paths = [()]
        for i in range(1, len(tokens)):
            paths.append((*paths[parents[i]], tokens[i]))
        expected = reference_eagle2(table.softmax(-1), root, budget)
        assert set(paths[1:]) == set(expected)
        assert depths(tree.parents) == sorted(depths(tree.parents))  # by depth: parents first


def test_mixed_batch_budgets_and_per_round_changes():
    proposer = bigram(tree_top_k=4, depth=5, nodes=20)
    budgets = [
        TreeBudget(20, 5, 4),
        TreeBudget(6, 2, 3),
        TreeBudget(1, 5, 4),
        TreeBudget(8, 5, 1),
        TreeBudget(12, 3, 0),
    ]
    samplings = [
        GREEDY,
        SamplingParams(1.0, seed=1),
        SamplingParams(0.7, top_k=5),
        GREEDY,
        SamplingParams(0.9, top_p=0.8),
    ]
    updates = mixed_updates(budgets, samplings)
    trees = proposer.propose(updates)
    assert_valid(trees, updates)
    assert [t.num_nodes for t in trees] == [20, 6, 1, 6, 1]  # the chain stops at depth 5
    assert max(depths(trees[3].parents)) == 5  # top_k = 1: a chain of 5
    # The engine shrinks every budget next round (heavier load): trees shrink with it.
    smaller = [TreeBudget(4, 2, 2)] * len(updates)
    updates = [
        SequenceUpdate(u.seq_id, 1, torch.tensor([3]), u.sampling, b)
        for u, b in zip(updates, smaller, strict=True)
    ]
    trees = proposer.propose(updates)
    assert_valid(trees, updates)
    assert all(t.num_nodes == 4 and max(depths(t.parents)) <= 2 for t in trees)


def test_frontier_calls_are_batched_and_consistent():
    proposer = bigram(tree_top_k=3, depth=4, nodes=12)
    budgets = [TreeBudget(12, 4, 3), TreeBudget(12, 2, 2), TreeBudget(5, 4, 1)]
    updates = mixed_updates(budgets, [GREEDY, SamplingParams(1.0), GREEDY])
    proposer.propose(updates)
    calls: list[Frontier] = proposer.frontiers
    assert [f.depth for f in calls] == [1, 2, 3]  # one call per depth for the whole batch
    assert (calls[0].parent_row == -1).all()
    roots = torch.stack([u.new_tokens[-1] for u in updates])
    assert torch.equal(calls[0].paths[:, 0], roots[calls[0].seq_index])
    for previous, call in zip(calls, calls[1:], strict=False):
        assert torch.equal(call.paths[:, :-1], previous.paths[call.parent_row])
        assert torch.equal(call.seq_index, previous.seq_index[call.parent_row])
    for call in calls:
        assert torch.equal(call.paths[:, -1], call.tokens)
        assert (torch.bincount(call.seq_index, minlength=3) <= torch.tensor([3, 2, 1])).all()


def test_no_expansion_past_what_can_make_the_cut():
    proposer = bigram(tree_top_k=1, depth=8, nodes=3)
    (tree,) = proposer.propose(mixed_updates([TreeBudget(3, 8, 1)], [GREEDY]))
    assert tree.num_nodes == 3
    assert [f.depth for f in proposer.frontiers] == [1]  # the 2-token chain needs one call


def test_seeded_drafts_do_not_depend_on_the_batch():
    budget, seeded = TreeBudget(10, 4, 3), SamplingParams(1.0, seed=42)
    alone = bigram().propose(mixed_updates([budget], [seeded]))[0]
    batch = mixed_updates([budget] * 3, [seeded, SamplingParams(1.0), seeded])
    batch[1].new_tokens, batch[2].new_tokens = batch[1].new_tokens[:2], batch[0].new_tokens
    together = bigram().propose(batch)
    assert torch.equal(together[0].tokens, alone.tokens) and torch.equal(together[2].tokens, alone.tokens)


NUM_DRAWS = 6000


def tv_bound(cells: int, draws: int = NUM_DRAWS, delta: float = 1e-6) -> float:
    """TV(empirical, true) stays below this with probability 1 - delta (Weissman et al. 2003)."""
    return math.sqrt(2 * (cells * math.log(2) + math.log(1 / delta)) / draws) / 2


@pytest.mark.parametrize("mode", [DraftSampling.WITH_REPLACEMENT, DraftSampling.WITHOUT_REPLACEMENT])
def test_sampled_children_follow_the_stated_q(mode):
    """The root's q row is the renormalised top-k of process_logits, and its first two
    children are draws from it (i.i.d., or the second from q without the first)."""
    torch.manual_seed(0)
    name = "with_replacement" if mode == DraftSampling.WITH_REPLACEMENT else "without_replacement"
    proposer = bigram(tree_top_k=4, depth=1, nodes=5, sampling=name)
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    budget = TreeBudget(5, 1, 4)
    updates = [SequenceUpdate(i, 0, torch.tensor([2]), sampling, budget) for i in range(NUM_DRAWS)]
    trees = proposer.propose(updates)
    assert_valid(trees[:50], updates[:50])
    expected = process_logits(proposer.table[2:3], torch.tensor([0.8]), None, torch.tensor([0.95]))[0]
    top = expected.topk(4)
    q = torch.zeros(VOCAB).scatter(0, top.indices, top.values / top.values.sum())
    assert torch.allclose(
        trees[0].q_probs[0].sort(descending=True).values, q.sort(descending=True).values[:4]
    )
    assert all(t.sampling == mode for t in trees)
    children = torch.stack([t.tokens[1:3] for t in trees])  # [NUM_DRAWS, 2]
    first = torch.bincount(children[:, 0], minlength=VOCAB) / NUM_DRAWS
    assert 0.5 * (first - q).abs().sum() < tv_bound(4)
    second = torch.bincount(children[:, 1], minlength=VOCAB) / NUM_DRAWS
    if mode == DraftSampling.WITH_REPLACEMENT:
        expected_second = q
    else:  # P(second = y) = sum_x q(x) q(y) / (1 - q(x)), x != y
        pair = q[:, None] * q[None, :] / (1 - q[:, None])
        expected_second = pair.fill_diagonal_(0).sum(0)
        assert (children[:, 0] != children[:, 1]).all()
    assert 0.5 * (second - expected_second).abs().sum() < tv_bound(4)


def test_without_replacement_siblings_are_distinct_everywhere():
    proposer = bigram(tree_top_k=4, depth=4, nodes=16)
    updates = mixed_updates([TreeBudget(16, 4, 4)] * 8, [SamplingParams(1.5)] * 8)
    for tree in proposer.propose(updates):
        assert tree.sampling == DraftSampling.WITHOUT_REPLACEMENT
        keys = set(zip(tree.parents.tolist()[1:], tree.tokens.tolist()[1:], strict=True))
        assert len(keys) == tree.num_nodes - 1


def test_a_sampled_chain_draws_from_a_q_width_row_not_a_point_mass():
    """top_k = 1 with q_width 6: the child is a draw from q's renormalised top 6 (sent whole),
    so verification can accept it with ~sum(min(p, q)); a greedy chain keeps its one-entry row."""
    torch.manual_seed(1)
    proposer = bigram(tree_top_k=1, depth=1, nodes=2, sampling="with_replacement")
    sampling = SamplingParams(temperature=1.0)
    budget = TreeBudget(2, 1, 1, q_width=6)
    updates = [SequenceUpdate(i, 0, torch.tensor([2]), sampling, budget) for i in range(NUM_DRAWS)]
    trees = proposer.propose(updates)
    assert_valid(trees[:50], updates[:50])
    expected = process_logits(proposer.table[2:3], torch.tensor([1.0]), None, None)[0]
    top = expected.topk(6)
    q = torch.zeros(VOCAB).scatter(0, top.indices, top.values / top.values.sum())
    assert trees[0].q_token_ids.shape == (1, 6)
    assert torch.allclose(trees[0].q_probs[0], q[trees[0].q_token_ids[0]])
    first = torch.bincount(torch.stack([t.tokens[1] for t in trees]), minlength=VOCAB) / NUM_DRAWS
    assert 0.5 * (first - q).abs().sum() < tv_bound(6)
    (greedy,) = proposer.propose([SequenceUpdate(0, 0, torch.tensor([2]), GREEDY, budget)])
    assert greedy.q_token_ids.shape == (1, 1) and int(greedy.tokens[1]) == int(expected.argmax())
