"""The carried state's selection: the chosen candidates in time order (`in_time_order`), which replaces a sort
that is slower on a GPU and must give the sort's result exactly, whatever the shape."""

from __future__ import annotations

import pytest
import torch

from statekv.core.rules import in_time_order

SHAPES = [(1, 4, 300, 200), (3, 2, 50, 49), (2, 1, 7, 1), (1, 3, 16, 16)]  # batch, KV heads, candidates, kept


@pytest.mark.parametrize("batch, heads, size, kept", SHAPES)
def test_in_time_order_is_the_sorted_choice(batch, heads, size, kept):
    generator = torch.Generator().manual_seed(size)
    chosen = torch.rand(batch, heads, size, generator=generator).topk(kept, dim=-1, sorted=False).indices
    shuffled = chosen.gather(-1, torch.rand(chosen.shape, generator=generator).argsort(dim=-1))
    ordered = in_time_order(shuffled, size)
    assert ordered.dtype == torch.long and ordered.is_contiguous()
    assert torch.equal(ordered, chosen.sort(dim=-1).values)


def test_in_time_order_stays_right_as_batches_grow_and_shrink():
    """Rows of ranks are shared by every batch size of one budget (a table that grows): each size, in any order,
    still gets the sorted choice."""
    generator = torch.Generator().manual_seed(0)
    for batch in (1, 2, 5, 3, 9, 1, 16, 4):
        chosen = torch.rand(batch, 2, 40, generator=generator).topk(17, dim=-1, sorted=False).indices
        assert torch.equal(in_time_order(chosen, 40), chosen.sort(dim=-1).values), batch
