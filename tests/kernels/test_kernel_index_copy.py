"""dst[dst_index] = src[src_index] in one launch, as the pending token ids reach a step's input ids."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE

from kernels.index_copy import gather_scatter


@pytest.mark.parametrize("n", [1, 3, 200, 2500])
def test_gather_scatter_equals_index_copy(n):
    gen = torch.Generator().manual_seed(n)
    dst = torch.randint(0, 1 << 40, (n + 50,), generator=gen)
    src = torch.randint(0, 1 << 40, (n + 7,), generator=gen)
    dst_index = torch.randperm(n + 50, generator=gen)[:n]
    src_index = torch.randint(0, n + 7, (n,), generator=gen)  # a source may repeat
    expected = dst.clone().index_copy_(0, dst_index, src.index_select(0, src_index))
    out = dst.to(DEVICE)
    gather_scatter(out, dst_index.to(DEVICE), src.to(DEVICE), src_index.to(DEVICE))
    assert out.tolist() == expected.tolist()


def test_gather_scatter_checks():
    ids = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    gather_scatter(ids, index[:0], ids, index[:0])  # nothing to copy
    with pytest.raises(ValueError, match="differ"):
        gather_scatter(ids, index, ids.int(), index)
    with pytest.raises(ValueError, match="int64"):
        gather_scatter(ids, index.int(), ids, index.int())
    with pytest.raises(ValueError, match="one length"):
        gather_scatter(ids, index, ids, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="1-D"):
        gather_scatter(ids.view(2, 2), index, ids, index)
