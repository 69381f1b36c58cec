"""`TensorParallelGroup`: one process per device, and the few collectives tensor parallelism needs.

Every collective runs under the group's timeout: a rank that died makes the others fail with an error
instead of waiting forever (gloo honours the timeout directly; NCCL through its watchdog, with
`TORCH_NCCL_ASYNC_ERROR_HANDLING`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from inference_service.distributed.symmetric_collectives import SymmetricCollectives

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """This process's place among `world_size` ranks; rank 0 owns scheduling and sampling."""

    rank: int
    world_size: int
    # The latency path for a decode step's small all-reduces and broadcasts (CUDA with peer access); None =
    # NCCL/gloo only.
    symmetric: SymmetricCollectives | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the ranks: `tensor` itself summed in place, or a new tensor (small
        ones on the symmetric-memory path); use the return value."""
        if self.symmetric is not None and self.symmetric.can_reduce(tensor):
            return self.symmetric.all_reduce(tensor)
        dist.all_reduce(tensor)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n] on rank 0, in rank order; other ranks get
        their own `tensor` back (they do not sample)."""
        tensor = tensor.contiguous()
        if not self.is_driver:
            dist.gather(tensor, None, dst=0)
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place; returns it."""
        if self.symmetric is not None and self.symmetric.can_broadcast(tensor):
            return self.symmetric.broadcast(tensor)
        dist.broadcast(tensor, src=0)
        return tensor


def init_group(rank: int, world_size: int, init_method: str, device: torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S, use_symmetric_memory: bool = True) -> TensorParallelGroup:
    """Joins the process group (NCCL for CUDA devices, gloo for the CPU); `device` is this rank's.
    `use_symmetric_memory` False (`--disable-custom-all-reduce`) leaves every all-reduce to NCCL."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
        # NOTE: NVLink SHARP (multicast) hangs on some drivers; off unless the user chose otherwise.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if backend == "gloo":
        # NOTE: N CPU ranks on one host share its cores; each with a thread per core, their idle
        # threads spin against each other's work.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    symmetric = SymmetricCollectives.try_create(device, world_size) if use_symmetric_memory else None
    return TensorParallelGroup(rank, world_size, symmetric)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
