"""Tree buffers: positions, depths, ancestor masks, retrieve paths, and the SDPA mask layout."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.kernels.tree_buffers import build_tree_buffers, tree_attention_mask

# SGLang build_eagle_tree.py: topk = 4, depth = 4, N = 8, context lengths [5, 10].
SGLANG_PARENTS = torch.tensor([-1, 0, 0, 1, 1, 3, 3, 5, -1, 0, 1, 1, 1, 1, 2, 6])
SGLANG_CU = torch.tensor([0, 8, 16])
SGLANG_CONTEXT = torch.tensor([5, 10])


def test_sglang_position_vector() -> None:
    buffers = build_tree_buffers(SGLANG_PARENTS, SGLANG_CU, SGLANG_CONTEXT)
    assert buffers.positions.tolist() == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert buffers.max_depth == 4 and buffers.max_num_nodes == 8


def test_mask_and_paths_of_a_small_tree() -> None:
    #   0 -> 1 -> 3
    #     -> 2
    parents = torch.tensor([-1, 0, 0, 1, -1])
    buffers = build_tree_buffers(parents, torch.tensor([0, 4, 5]), torch.tensor([7, 0]))
    assert buffers.depths.tolist() == [0, 1, 1, 2, 0]
    assert buffers.tree_mask.int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
        [1, 0, 0, 0],
    ]
    assert buffers.retrieve_paths.tolist() == [[[0, 2, -1], [0, 1, 3]], [[0, -1, -1], [-1, -1, -1]]]


def test_attention_mask_layout_against_an_absolute_slot_cache() -> None:
    parents = torch.tensor([-1, 0, 0, -1])
    cu, context = torch.tensor([0, 3, 4]), torch.tensor([2, 0])
    buffers = build_tree_buffers(parents, cu, context)
    mask = tree_attention_mask(buffers.tree_mask, cu, context, num_kv_slots=6)
    assert mask.shape == (2, 1, 3, 6)
    assert mask[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0, 0],  # root: context + itself (slot 2)
        [1, 1, 1, 1, 0, 0],  # node 1 at slot 3
        [1, 1, 1, 0, 1, 0],  # node 2 at slot 4, not its sibling
    ]
    assert mask[1, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],  # root-only tree with empty context
        [1, 0, 0, 0, 0, 0],  # padding rows attend to slot 0 only
        [1, 0, 0, 0, 0, 0],
    ]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10_000), min_size=0, max_size=9), min_size=2, max_size=4))
def test_paths_and_masks_agree_on_random_trees(raw: list[list[int]]) -> None:
    parents = [[-1] + [r % (i + 1) for i, r in enumerate(tree)] for tree in raw]
    sizes = torch.tensor([len(p) for p in parents])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    buffers = build_tree_buffers(torch.tensor(sum(parents, [])), cu, torch.zeros(len(raw), dtype=torch.int64))
    for b, par in enumerate(parents):
        start = int(cu[b])
        for node in range(len(par)):
            ancestors, walk = set(), node
            while walk >= 0:
                ancestors.add(walk)
                walk = par[walk]
            row = buffers.tree_mask[start + node, : len(par)].nonzero().squeeze(1).tolist()
            assert set(row) == ancestors
            assert buffers.depths[start + node] == len(ancestors) - 1
        leaves = [i for i in range(len(par)) if i not in par]
        paths = [[n for n in path if n >= 0] for path in buffers.retrieve_paths[b].tolist()]
        assert [path[-1] for path in paths if path] == leaves
