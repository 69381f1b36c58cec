"""The one-launch argmax of the greedy sampler: the first maximum of each row, as torch's argmax picks it."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testlib import DEVICE, ON_GPU

from kernels.argmax import argmax_rows

NEG_INF = float("-inf")


def _first_max(row: list[float]) -> int:
    return max(range(len(row)), key=lambda t: (math.isnan(row[t]), 0.0 if math.isnan(row[t]) else row[t], -t))


# vocabularies: under one chunk, exactly one, several with a ragged last one, the embedded model's
VOCABS = (96, 2048, 5000, 49152, 128256) if ON_GPU else (96, 2048, 5000)


@pytest.mark.parametrize("vocab", VOCABS)
def test_argmax_rows_picks_the_first_maximum(vocab):
    x = torch.randn(9, vocab)
    x[1] = 0.5  # a row of ties: index 0
    x[2, [vocab - 1, 3, vocab // 2]] = 100.0  # equal maxima in different chunks: the first
    x[3, [7, 90]] = float("inf")
    x[4] = NEG_INF  # nothing above -inf: index 0
    x[5, [vocab - 3, 10]] = float("nan")  # NaN is the maximum, its first occurrence wins
    x[6] = torch.arange(vocab, dtype=torch.float32)  # the maximum in the very last column
    x[7] = -1.0
    x[7, [vocab - 2, 4]] = torch.tensor([0.0, -0.0])  # -0.0 equals 0.0: the first of them
    x[8, 5] = -float("nan")  # a NaN with its sign bit set is a NaN too
    expected = [_first_max(row) for row in x.tolist()]
    assert expected[7] == 4 and expected[8] == 5
    out = torch.full((9,), -7, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(x.to(DEVICE), out=out) is out
    assert out.tolist() == expected == x.argmax(-1).tolist()


def test_argmax_rows_again_and_on_more_rows_after_fewer():
    """The arrival counters are left zeroed: calls in a row, then on more rows (a larger workspace), agree."""
    gen = torch.Generator().manual_seed(0)
    for num_rows in (1, 3, 1, 300):
        x = torch.randn(num_rows, 3000, generator=gen)
        assert argmax_rows(x.to(DEVICE)).tolist() == x.argmax(-1).tolist()


def test_argmax_rows_strided_rows_and_checks():
    big = torch.randn(4, 3000)
    x = big[:, :2500]  # rows 3000 apart
    assert argmax_rows(x.to(DEVICE) if ON_GPU else x).tolist() == x.argmax(-1).tolist()
    assert argmax_rows(torch.empty(0, 10, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="float32"):
        argmax_rows(torch.randn(2, 10, device=DEVICE).half())
    with pytest.raises(ValueError, match="contiguous"):
        argmax_rows(torch.randn(10, 2, device=DEVICE).t())
    with pytest.raises(ValueError, match="num_rows, V"):
        argmax_rows(torch.randn(10, device=DEVICE))
