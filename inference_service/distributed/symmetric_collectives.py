"""`SymmetricCollectives`: a decode step's small all-reduces and broadcasts through PyTorch symmetric memory.

A decode step of a TP2 Llama-3-8B sums 65 activations of a few KiB each; inside a CUDA graph on two H200s
NCCL takes 16-24 us for each (bench/gpu_tp.py's allreduce case), PyTorch's one-shot all-reduce
(`torch.ops.symm_mem.one_shot_all_reduce_copy`: a barrier, a copy, the peers' reads, a barrier) ~7 us.
Here every rank maps its peers' buffers (symmetric memory) and `kernels.all_reduce` does the sum in one
kernel with no flag exchange (each word travels with its call's number) and no reads over NVLink, launched
like the step's other kernels (programmatic dependent launch): 161 of them in a graph on two H100s 0.82 ms
with the flag exchange it had before, NCCL's 3.35 (2026-11-27).
The step's inputs (token ids, positions, slots, block tables) reach the other ranks through the same
kernel's broadcast, where NCCL took ~6 us a tensor and broke the chain of early launches.
It is the latency-bound regime only: messages above `max_bytes` (prefill) go to NCCL, whose bandwidth wins.
The engine uses it where it sets up for every rank (CUDA, peer access between the group's GPUs) unless
`--disable-custom-all-reduce`; anything else falls back to NCCL with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024  # a [32, 4096] bf16 activation; larger batches are bandwidth-bound
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def missing_peer_access(own: int, devices: list[int], can_access: Callable[[int, int], bool]) -> str | None:
    """Why GPU `own` cannot read the other ranks' GPUs `devices` directly (None: it can read them all)."""
    for peer in devices:
        if peer != own and not can_access(own, peer):
            return f"GPU {own} cannot access GPU {peer} directly"
    return None


class SymmetricCollectives:
    """Sums and broadcasts small tensors over the default process group's ranks through symmetric buffers."""

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from kernels.all_reduce import OneShotCollectives

        self.max_bytes = max_bytes
        group_name = dist.group.WORLD.group_name
        # Every rank allocates the same sizes in the same order, so a tensor's offset in its rank's mapping
        # is the same on every rank.
        world_size = dist.get_world_size()
        data = symm_mem.empty(OneShotCollectives.buffer_bytes(max_bytes, world_size), dtype=torch.uint8, device=device)
        data.zero_()  # call numbers 0: no call's
        peer_ptrs = _peer_ptrs(data, symm_mem.rendezvous(data, group_name))
        self._buffer = data  # the mappings live as long as this tensor
        self._kernel = OneShotCollectives(dist.get_rank(), world_size, peer_ptrs, max_bytes, device)
        torch.cuda.synchronize(device)
        dist.barrier()  # no rank's first words reach a peer before that peer zeroed its buffer

    @classmethod
    def try_create(cls, device: torch.device, world_size: int) -> SymmetricCollectives | None:
        """The fast path where it can work for every rank, else None (NCCL does every all-reduce). Every rank
        of the group calls it: they decide together (one rank alone in the rendezvous would wait forever)."""
        if device.type != "cuda" or world_size < 2:
            return None
        import torch.distributed as dist

        try:
            devices: list[int | None] = [None] * world_size
            dist.all_gather_object(devices, device.index)
            problems: list[str | None] = [None] * world_size
            dist.all_gather_object(problems, missing_peer_access(device.index, devices,
                                                                 torch.cuda.can_device_access_peer))
            problem = next((p for p in problems if p is not None), None)
            if problem is not None:
                raise RuntimeError(problem)
            return cls(device)
        except Exception as e:  # noqa: BLE001 - any failure here means "use NCCL", said once
            logger.warning("symmetric-memory collectives unavailable (%s); NCCL does every all-reduce and broadcast", e)
            return None

    def can_reduce(self, tensor: torch.Tensor) -> bool:
        num_bytes = tensor.numel() * tensor.element_size()
        # NOTE: a multiple of 16 bytes keeps every rank's part of the buffer 16-byte aligned (vector loads).
        return (tensor.dtype in _DTYPES and tensor.is_contiguous() and num_bytes <= self.max_bytes
                and num_bytes % 16 == 0)

    def can_broadcast(self, tensor: torch.Tensor) -> bool:
        num_bytes = tensor.numel() * tensor.element_size()
        return tensor.is_contiguous() and num_bytes <= self.max_bytes and num_bytes % 4 == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `tensor` (same shape), in a new tensor; `tensor` is left as it was."""
        return self._kernel(tensor)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's, in place; returns it."""
        return self._kernel.broadcast(tensor)


def _peer_ptrs(tensor: torch.Tensor, handle) -> list[int]:
    """`tensor`'s address in every rank's mapping, in rank order."""
    offset = tensor.data_ptr() - handle.buffer_ptrs[handle.rank]
    return [base + offset for base in handle.buffer_ptrs]
