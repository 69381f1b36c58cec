"""One-shot all-reduce (and broadcast) of a decode step's small tensors between the GPUs of one host.

Every rank maps every other rank's buffer (PyTorch symmetric memory, peer access over NVLink). A call
stores its input into its slot of each peer's buffer, tells each peer so with one flag store, waits for
the peers' flags, then sums the slots of its own buffer in rank order (the same bits on every rank).

Against `torch.ops.symm_mem.one_shot_all_reduce_copy` (a barrier before and one after, no PDL):
- one flag exchange a call, not two: calls alternate between two halves of the buffers, so a rank
  writes a peer's half again only after that peer has flagged the next call, which it does only once it
  has finished reading the half;
- no reads over NVLink: the writes to the peers are posted, the sum reads local memory;
- launched with programmatic dependent launch like the step's other kernels, so neither its launch
  nor the next GEMV's is a gap in the step.

Flags count calls (per program, in device memory the kernel itself advances): nothing is reset, so
CUDA graph replays need no host work, and a peer that is already a call ahead is seen as arrived.
A broadcast is the same call with rank 0 the only one pushing (its tensor moved as 32-bit words).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import ACT_DTYPES, cast, is_interpreter, pdl_args, pdl_enter, require

BLOCK = 1024  # elements a program moves: 2 KiB of bf16, one 16-byte vector per thread of 4 warps
MIN_ELEMENT_SIZE = 2  # bytes: bf16, fp16 (and fp32)


@triton.jit
def _one_shot_kernel(
    x_ptr,  # [N] this rank's addend (all-reduce), or rank 0's data (broadcast)
    y_ptr,  # [N] the sum, or rank 0's data
    data_ptrs,  # [WORLD] int64: each rank's buffer [2 halves, WORLD slots, `slot_elems`] of x's dtype
    flag_ptrs,  # [WORLD] int64: each rank's flags, int32 [num_programs, WORLD]
    calls_ptr,  # [num_programs] int32: this rank's calls so far, per program
    N,
    slot_elems,
    rank,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_BROADCAST: tl.constexpr,  # rank 0 pushes, every rank's y is rank 0's x; else every rank pushes and sums
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dtype = y_ptr.dtype.element_ty
    pdl_enter(USE_PDL)
    call = tl.load(calls_ptr + pid) + 1
    half = (call % 2) * WORLD
    x = tl.load(x_ptr + offs, mask=mask)
    # Pushed, not pulled: stores to a peer are posted, and each rank then reads its own memory; reading
    # the peers' buffers instead would add a round trip over NVLink.
    if not IS_BROADCAST or rank == 0:
        for peer in tl.static_range(WORLD):
            if peer != rank:
                peer_data = tl.multiple_of(tl.load(data_ptrs + peer).to(tl.pointer_type(dtype)), 16)
                tl.store(peer_data + (half + rank) * slot_elems + offs, x, mask=mask)
    # NOTE: every thread's stores are done before one thread's release store publishes them, and every
    # thread has read the call count before one thread advances it.
    tl.debug_barrier()
    tl.store(calls_ptr + pid, call)
    # Every rank flags every other, in a broadcast too: rank 0 may write a half again only once the others
    # have flagged the next call, that is, have read the half.
    for peer in tl.static_range(WORLD):
        if peer != rank:
            peer_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + pid * WORLD + rank, call, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            # A peer a call ahead has flagged call + 1 over call: it arrived (and wrote the other half).
            arrived = tl.atomic_add(own_flags + pid * WORLD + peer, 0, sem="acquire", scope="sys")
            while arrived - call < 0:
                arrived = tl.atomic_add(own_flags + pid * WORLD + peer, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    own_data = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(dtype)), 16)
    # .cv: another GPU wrote the slots since this SM may last have cached their lines
    if IS_BROADCAST:
        if rank != 0:
            tl.store(y_ptr + offs, tl.load(own_data + half * slot_elems + offs, mask=mask, cache_modifier=".cv"),
                     mask=mask)
    else:
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for source in tl.static_range(WORLD):
            if source == rank:
                total += x.to(tl.float32)
            else:
                total += tl.load(own_data + (half + source) * slot_elems + offs, mask=mask, other=0.0,
                                 cache_modifier=".cv").to(tl.float32)
        tl.store(y_ptr + offs, cast(total, dtype), mask=mask)


class OneShotCollectives:
    """All-reduces (`__call__`) and broadcasts from rank 0 (`broadcast`) of small tensors. The kernel's state
    on one rank: device tensors of every rank's buffer and flag addresses, and this rank's call counts.
    Every rank builds it with the same `max_bytes` and calls it with the same tensors' sizes in the same
    order (as any collective)."""

    def __init__(self, rank: int, world_size: int, data_ptrs: list[int], flag_ptrs: list[int], max_bytes: int,
                 device: torch.device):
        require(len(data_ptrs) == len(flag_ptrs) == world_size and 0 <= rank < world_size,
                lambda: f"rank {rank} of {world_size} with {len(data_ptrs)} buffers and {len(flag_ptrs)} flag arrays")
        self.rank, self.world_size, self.max_bytes = rank, world_size, max_bytes
        self.data_ptrs = torch.tensor(data_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flag_ptrs, dtype=torch.int64, device=device)
        self.calls = torch.zeros(self.max_programs(max_bytes), dtype=torch.int32, device=device)

    @staticmethod
    def max_programs(max_bytes: int) -> int:
        return triton.cdiv(max_bytes // MIN_ELEMENT_SIZE, BLOCK)

    @staticmethod
    def buffer_bytes(max_bytes: int, world_size: int) -> int:
        """Bytes of the data buffer every rank maps: two halves of one `max_bytes` slot a rank."""
        return 2 * world_size * max_bytes

    @staticmethod
    def flag_count(max_bytes: int, world_size: int) -> int:
        """int32 flags every rank maps, zeroed on every rank before any rank's first call."""
        return OneShotCollectives.max_programs(max_bytes) * world_size

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum over ranks of `x` (contiguous, at most `max_bytes`), in `out` or a new tensor."""
        require(x.is_contiguous() and x.dtype in ACT_DTYPES and x.numel() * x.element_size() <= self.max_bytes,
                lambda: f"x: contiguous 16- or 32-bit floats, at most {self.max_bytes} bytes; got {tuple(x.shape)} "
                        f"{x.dtype}")
        out = torch.empty_like(x) if out is None else out
        self._launch(x, out, is_broadcast=False)
        return out

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype: contiguous, a whole number of 32-bit
        words, at most `max_bytes`), in place; returns it."""
        num_bytes = tensor.numel() * tensor.element_size()
        require(tensor.is_contiguous() and num_bytes % 4 == 0 and num_bytes <= self.max_bytes,
                lambda: f"tensor: contiguous, whole 32-bit words, at most {self.max_bytes} bytes; got "
                        f"{tuple(tensor.shape)} {tensor.dtype}")
        words = tensor.view(-1).view(torch.int32)  # any dtype: moved as words
        self._launch(words, words, is_broadcast=True)
        return tensor

    def _launch(self, x: torch.Tensor, out: torch.Tensor, is_broadcast: bool) -> None:
        num_elems = x.numel()
        if num_elems == 0:
            return  # no programs, on every rank alike
        opts = {} if is_interpreter() else {"num_warps": 4}
        _one_shot_kernel[(triton.cdiv(num_elems, BLOCK),)](
            x, out, self.data_ptrs, self.flag_ptrs, self.calls, num_elems, self.max_bytes // x.element_size(),
            self.rank, WORLD=self.world_size, BLOCK=BLOCK, IS_BROADCAST=is_broadcast, **opts, **pdl_args(x.device))
