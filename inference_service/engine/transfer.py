"""Host <-> device copies that never wait for the GPU to finish the work queued before them.

A plain `torch.tensor(data, device="cuda")` copies from pageable memory and returns only once the
copy is done, which is after everything already queued on the stream: with a step in flight, it
would wait for that step. Copies through pinned memory are queued on the stream instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(data: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)`, queued on the current stream on a GPU."""
    if torch.device(device).type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostCopy:
    """Copies of device tensors on their way to the host: `wait()` returns them as Python lists
    once the copies have run, without waiting for GPU work queued after them. None stays None."""

    def __init__(self, tensors: list[torch.Tensor | None]):
        self._event: torch.cuda.Event | None = None
        if any(t is not None and t.device.type == "cuda" for t in tensors):
            # NOTE: a non-blocking copy to the CPU lands in pinned memory.
            tensors = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        self._tensors = tensors

    def wait(self) -> list[list | None]:
        if self._event is not None:
            self._event.synchronize()  # releases the GIL while it waits
        return [None if t is None else t.tolist() for t in self._tensors]
