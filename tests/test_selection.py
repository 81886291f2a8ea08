"""The carried state's selection primitives: the chosen candidates in time order, and their rows copied out.

Both replace a general PyTorch op that is slower on a GPU (a radix sort per row, an element-wise gather); both
must give that op's result exactly, whatever the shape.
"""

from __future__ import annotations

import pytest
import torch

from statekv.core.buffers import selected_rows
from statekv.core.policies import in_time_order

SHAPES = [(1, 4, 300, 200), (3, 2, 50, 49), (2, 1, 7, 1), (1, 3, 16, 16)]  # batch, KV heads, candidates, kept


@pytest.mark.parametrize("batch, heads, size, kept", SHAPES)
def test_in_time_order_is_the_sorted_choice(batch, heads, size, kept):
    generator = torch.Generator().manual_seed(size)
    chosen = torch.rand(batch, heads, size, generator=generator).topk(kept, dim=-1, sorted=False).indices
    shuffled = chosen.gather(-1, torch.rand(chosen.shape, generator=generator).argsort(dim=-1))
    ordered = in_time_order(shuffled, size)
    assert ordered.dtype == torch.long and ordered.is_contiguous()
    assert torch.equal(ordered, chosen.sort(dim=-1).values)


@pytest.mark.parametrize("batch, heads, size, kept", SHAPES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_selected_rows_are_the_gathered_slots(batch, heads, size, kept, contiguous):
    generator = torch.Generator().manual_seed(kept)
    kv = torch.randn(2, batch, heads, size if contiguous else size + 3, 8, generator=generator)
    kv = kv if contiguous else kv[:, :, :, 3:]  # a view into a longer buffer
    assert kv.is_contiguous() == contiguous
    selection = torch.rand(batch, heads, size, generator=generator).topk(kept, dim=-1).indices.sort(dim=-1).values
    expected = kv.gather(3, selection[None, ..., None].expand(2, -1, -1, -1, 8))
    assert torch.equal(selected_rows(kv, selection), expected)
