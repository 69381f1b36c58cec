"""Which all-reduces and broadcasts take the symmetric-memory path: only where it can run, and only tensors its kernel
takes (the kernel itself needs two GPUs: `bench/gpu_tp.py`'s allreduce case checks its sums and times)."""

from __future__ import annotations

import pytest
import torch

from inference_service.distributed.symmetric_collectives import SymmetricCollectives, missing_peer_access


def _gate(max_bytes: int) -> SymmetricCollectives:
    gate = object.__new__(SymmetricCollectives)  # no buffer: only the size and dtype checks
    gate.max_bytes = max_bytes
    return gate


@pytest.mark.parametrize(("shape", "dtype", "expected"), [
    ((1, 4096), torch.bfloat16, True),  # a decode row of Llama-3-8B
    ((32, 4096), torch.bfloat16, True),  # exactly max_bytes
    ((33, 4096), torch.bfloat16, False),  # larger: NCCL's bandwidth wins
    ((1, 8191), torch.bfloat16, False),  # not a whole number of 16-byte vectors
    ((1, 4096), torch.float32, True),
    ((1, 4096), torch.int64, False),
])
def test_only_small_aligned_float_tensors_take_the_symmetric_path(shape, dtype, expected):
    assert _gate(32 * 4096 * 2).can_reduce(torch.zeros(shape, dtype=dtype)) is expected


@pytest.mark.parametrize(("shape", "dtype", "expected"), [
    ((1,), torch.int64, True),  # a decode step's token id
    ((256, 512), torch.int32, True),  # block tables: exactly max_bytes
    ((257, 512), torch.int32, False),
    ((3,), torch.int16, False),  # not a whole number of 32-bit words
    ((1, 4096), torch.bfloat16, True),
])
def test_broadcasts_of_small_whole_words_take_the_symmetric_path(shape, dtype, expected):
    assert _gate(256 * 512 * 4).can_broadcast(torch.zeros(shape, dtype=dtype)) is expected


def test_a_non_contiguous_tensor_goes_to_the_collective():
    assert not _gate(1 << 20).can_reduce(torch.zeros(64, 64, dtype=torch.bfloat16).t())
    assert not _gate(1 << 20).can_broadcast(torch.zeros(64, 64, dtype=torch.int32).t())


def test_no_symmetric_path_off_cuda():
    assert SymmetricCollectives.try_create(torch.device("cpu"), 2) is None


def test_only_the_groups_gpus_need_peer_access():
    # GPUs 0 and 1 reach each other; GPU 2 (outside a group on 0 and 1) reaches neither.
    links = {(0, 1), (1, 0)}

    def can_access(a, b):
        return (a, b) in links

    assert missing_peer_access(0, [0, 1], can_access) is None
    assert missing_peer_access(1, [0, 1], can_access) is None
    assert missing_peer_access(0, [0, 1, 2], can_access) == "GPU 0 cannot access GPU 2 directly"
