"""KV compaction moves accepted rows into place, also when the ranges overlap, through
contiguous extents and paged (scattered) slot maps alike."""

import pytest
import torch

from outrider.kernels.kv_compaction import compact_kv, extent_slot_map, kv_moves


def naive(cache: torch.Tensor, accepted: torch.Tensor, slot_map: torch.Tensor, dim: int) -> torch.Tensor:
    out = cache.clone()
    for b in range(accepted.shape[0]):
        path = [n for n in accepted[b].tolist() if n >= 0]
        rows = [cache.select(dim, int(slot_map[b, n])).clone() for n in path]
        for k, row in enumerate(rows, start=1):
            out.select(dim, int(slot_map[b, k])).copy_(row)
    return out


ACCEPTED = torch.tensor([[2, 5, 6, -1], [1, 2, 3, 4], [-1, -1, -1, -1], [3, 4, 9, 12]])


@pytest.mark.parametrize(
    ("shape", "dim"), [((2, 2, 40, 3, 4), 2), ((3, 40, 5), 1), ((40, 2, 8), 0), ((2, 40), -1)]
)
@pytest.mark.parametrize("paged", [False, True])
def test_compaction_matches_a_row_by_row_copy(shape: tuple[int, ...], dim: int, paged: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(shape, generator=gen)
    if paged:  # each sequence's 13 local slots scattered over the 40 rows, disjoint across sequences
        accepted, slot_map = ACCEPTED[[0, 1, 3]], torch.randperm(40, generator=gen)[:39].view(3, 13)
    else:
        accepted, slot_map = ACCEPTED, extent_slot_map(torch.tensor([0, 10, 20, 25]), 13)
    expected = naive(cache, accepted, slot_map, dim % cache.dim())
    compact_kv(cache, accepted, slot_map, slot_dim=dim)
    assert torch.equal(cache, expected)


def test_root_and_other_slots_are_untouched() -> None:
    cache = torch.arange(12.0)[None].repeat(2, 1)
    compact_kv(cache, torch.tensor([[3, 7]]), extent_slot_map(torch.tensor([2]), 8), slot_dim=1)
    assert cache[0].tolist() == [0, 1, 2, 5, 9, 5, 6, 7, 8, 9, 10, 11]


def test_a_paged_path_lands_on_the_mapped_rows() -> None:
    """Local slots 0..3 live on rows 9, 2, 7, 4: accepting 0 -> 2 -> 3 copies row 7 to 2 and 4 to 7."""
    cache = torch.arange(12.0)[None]
    compact_kv(cache, torch.tensor([[2, 3]]), torch.tensor([[9, 2, 7, 4]]), slot_dim=1)
    assert cache[0].tolist() == [0, 1, 7, 3, 4, 5, 6, 4, 8, 9, 10, 11]


def test_moves_are_empty_when_every_path_is_already_in_place():
    """A chain's accepted nodes are 1, 2, ... in order: nothing moves (told without tensor ops);
    a branch's path (0 -> 2 -> 5) moves local slots 2 and 5 to 1 and 2."""
    slot_map = extent_slot_map(torch.tensor([10, 40]), 6)
    src, dst = kv_moves(torch.tensor([[1, 2, -1], [-1, -1, -1]]), slot_map)
    assert src.numel() == dst.numel() == 0
    src, dst = kv_moves(torch.tensor([[2, 5, -1], [1, -1, -1]]), slot_map)
    assert src.tolist() == [12, 15] and dst.tolist() == [11, 12]
