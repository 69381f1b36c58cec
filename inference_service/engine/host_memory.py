"""Host memory for the CPU engine's large buffers, backed by transparent huge pages where Linux has them.

NOTE: why: a CPU decode step streams the KV cache of every running sequence from memory (16 sequences of
128 tokens: ~94 MB a step for the embedded model, as much as its weights), in blocks scattered over the
cache. On 4 KiB pages nearly every block costs a TLB miss and a page walk (a nested one in a VM); on
2 MiB pages a step at 16 sequences x 128 tokens took 28.5 ms instead of 31.3 on the 2-core machine
(2026-11-27). Linux backs a range with huge pages at first touch when it was advised so (THP "madvise"
mode, the common default) or always ("always"); in "never" mode, or elsewhere, the advice is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14


def _madvise_huge(address: int, num_bytes: int) -> None:
    """Advice only: where it fails, the buffer stays on ordinary pages."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, num_bytes, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())


def huge_page_zeros(num_bytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `num_bytes`, starting on a huge-page boundary, its pages advised huge
    before they are first touched (so the zeroing faults them in as huge pages)."""
    padded = -(-num_bytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    backing = torch.empty(padded + HUGE_PAGE_BYTES, dtype=torch.uint8)  # untouched: large allocations are mmapped
    offset = -backing.data_ptr() % HUGE_PAGE_BYTES
    buffer = backing[offset:offset + padded]
    _madvise_huge(buffer.data_ptr(), padded)
    return buffer.zero_()[:num_bytes]
