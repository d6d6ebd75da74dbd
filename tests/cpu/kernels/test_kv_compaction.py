"""KV compaction moves accepted rows to contiguous slots, also when the ranges overlap."""

import pytest
import torch

from outrider.kernels.kv_compaction import compact_kv


def naive(cache: torch.Tensor, accepted: torch.Tensor, roots: torch.Tensor, dim: int) -> torch.Tensor:
    out = cache.clone()
    for b in range(accepted.shape[0]):
        path = [n for n in accepted[b].tolist() if n >= 0]
        rows = [cache.select(dim, int(roots[b]) + n).clone() for n in path]
        for k, row in enumerate(rows, start=1):
            out.select(dim, int(roots[b]) + k).copy_(row)
    return out


@pytest.mark.parametrize(
    ("shape", "dim"), [((2, 2, 40, 3, 4), 2), ((3, 40, 5), 1), ((40, 2, 8), 0), ((2, 40), -1)]
)
def test_compaction_matches_a_row_by_row_copy(shape: tuple[int, ...], dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(shape, generator=gen)
    accepted = torch.tensor([[2, 5, 6, -1], [1, 2, 3, 4], [-1, -1, -1, -1], [3, 4, 9, 12]])
    roots = torch.tensor([0, 10, 20, 25])
    expected = naive(cache, accepted, roots, dim % cache.dim())
    compact_kv(cache, accepted, roots, slot_dim=dim)
    assert torch.equal(cache, expected)


def test_root_and_other_slots_are_untouched() -> None:
    cache = torch.arange(12.0)[None].repeat(2, 1)
    compact_kv(cache, torch.tensor([[3, 7]]), torch.tensor([2]), slot_dim=1)
    assert cache[0].tolist() == [0, 1, 2, 5, 9, 5, 6, 7, 8, 9, 10, 11]
