"""`SymmetricAllReduce`: the small all-reduces of a decode step through PyTorch symmetric memory.

A decode step of a TP2 Llama-3-8B sums 65 activations of a few KiB each; inside a CUDA graph on two H200s
NCCL takes 16-24 us for each (bench/gpu_tp.py's allreduce case). PyTorch's one-shot all-reduce
(`torch.ops.symm_mem.one_shot_all_reduce_copy`) copies the input into a buffer every rank maps, then each
rank reads its peers' buffers over NVLink and sums them in one kernel, with no ring and no proxy thread:
about 7 us, and capturable in a CUDA graph.
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


class SymmetricAllReduce:
    """Sums small tensors over the default process group's ranks through one symmetric buffer."""

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes
        self.group_name = dist.group.WORLD.group_name
        # One byte buffer viewed per dtype: every rank allocates the same size, in the same order.
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    @classmethod
    def try_create(cls, device: torch.device, world_size: int) -> SymmetricAllReduce | None:
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
            logger.warning("symmetric-memory all-reduce unavailable (%s); NCCL does every all-reduce", e)
            return None

    def can_reduce(self, tensor: torch.Tensor) -> bool:
        num_bytes = tensor.numel() * tensor.element_size()
        # NOTE: the kernel moves 16-byte vectors: the size must be a multiple of that.
        return (tensor.dtype in _DTYPES and tensor.is_contiguous() and num_bytes <= self.max_bytes
                and num_bytes % 16 == 0)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `tensor` (same shape), in a new tensor; `tensor` is left as it was."""
        symm_input = self.buffer.view(tensor.dtype)[: tensor.numel()]
        summed = torch.ops.symm_mem.one_shot_all_reduce_copy(symm_input, tensor.view(-1), "sum", self.group_name)
        return summed.view(tensor.shape)
