"""One-shot all-reduce (and broadcast) of a decode step's small tensors between the GPUs of one host.

Every rank maps every other rank's buffer (PyTorch symmetric memory, peer access over NVLink). A call
stores its input into its slot of each peer's buffer, each 32-bit word beside the call's number in one
64-bit store, waits until its own buffer holds the peers' words of this call, then sums the slots in
rank order (the same bits on every rank).

Against `torch.ops.symm_mem.one_shot_all_reduce_copy` (a barrier before and one after, no PDL):
- no flag exchange at all: a 64-bit store reaches the peer whole, so a word that carries this call's
  number is this call's data (NCCL's LL protocol does the same). The flag of an earlier version cost a
  release fence (a round trip over NVLink for the data to land) and a second one-way trip for the flag;
- calls alternate between two halves of the buffers, so a rank writes a peer's half again only two
  calls later: by then the peer has finished reading it (it pushed the call in between only after it
  finished the call before, and this rank waited for that push);
- no reads over NVLink: the writes to the peers are posted, the sum reads local memory;
- launched with programmatic dependent launch like the step's other kernels, so neither its launch
  nor the next GEMV's is a gap in the step.

Call numbers count per program, in device memory the kernel itself advances: nothing is reset, so CUDA
graph replays need no host work. A broadcast is the same call with every rank's output rank 0's words;
the other ranks still push theirs, which tells rank 0 they have finished reading the call before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import ACT_DTYPES, is_interpreter, pdl_args, pdl_enter, require

BLOCK = 512  # 32-bit words a program moves: 2 KiB, pushed as 4 KiB of (word, call) pairs, on 4 warps
_FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _halves_to_float(word, IS_BF16: tl.constexpr):
    """A word's two 16-bit floats (the low one first) in fp32."""
    if IS_BF16:
        low = (word << 16).to(tl.float32, bitcast=True)
        high = (word & -65536).to(tl.float32, bitcast=True)
    else:
        low = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _float_to_half_bits(v, IS_BF16: tl.constexpr):
    """fp32 v rounded to the 16-bit float (to nearest even), its bits in the low half of an int32.

    NOTE: bf16 rounds on the bits: the interpreter's bf16 casts and bitcasts are unreliable."""
    if IS_BF16:
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16) & 0xFFFF
    else:
        return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _wait_for_words(ptr, mask, call, flag):
    """(the low words of the pairs at ptr once every one carries `call` (masked lanes: `flag`), the lowest call
    number among them: `call`)."""
    pairs = tl.load(ptr, mask=mask, other=flag, volatile=True)
    while tl.sum(((pairs >> 32).to(tl.int32) != call).to(tl.int32)) > 0:
        pairs = tl.load(ptr, mask=mask, other=flag, volatile=True)
    return pairs.to(tl.int32), tl.min((pairs >> 32).to(tl.int32))


@triton.jit
def _one_shot_kernel(
    x_ptr,  # [N] int32: this rank's addend (all-reduce), or its tensor (broadcast), as words
    y_ptr,  # [N] int32: the sum, or rank 0's words
    data_ptrs,  # [WORLD] int64: each rank's buffer, int64 [2 halves, WORLD slots, slot_words]
    calls_ptr,  # [num_programs] int32: this rank's calls so far, per program
    N,
    slot_words,
    rank,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_BROADCAST: tl.constexpr,  # every rank's y is rank 0's words; else the sum of every rank's x
    FLOAT_KIND: tl.constexpr,  # what a word holds when summed: 0 one fp32, 1 two bf16, 2 two fp16
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    pdl_enter(USE_PDL)
    call = tl.load(calls_ptr + pid) + 1
    half = (call % 2) * WORLD
    flag = call.to(tl.int64) << 32
    words = tl.load(x_ptr + offs, mask=mask, other=0)
    # Pushed, not pulled: stores to a peer are posted, and each rank then reads its own memory; reading
    # the peers' buffers instead would add a round trip over NVLink.
    pairs = flag | words.to(tl.uint32).to(tl.int64)  # zero-extended: the high half is the call number
    for peer in tl.static_range(WORLD):
        if peer != rank:
            peer_data = tl.multiple_of(tl.load(data_ptrs + peer).to(tl.pointer_type(tl.int64)), 16)
            tl.store(peer_data + (half + rank) * slot_words + offs, pairs, mask=mask)
    own_data = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(tl.int64)), 16)
    if IS_BROADCAST:
        # Rank 0 waits for the others' words too: they have finished reading the call before.
        received = words
        seen = call
        for source in tl.static_range(WORLD):
            if source != rank:
                source_words, source_call = _wait_for_words(own_data + (half + source) * slot_words + offs, mask,
                                                            call, flag)
                received = source_words if source == 0 else received
                seen = tl.minimum(seen, source_call)
        tl.store(y_ptr + offs, received, mask=mask)
        # NOTE: every thread has read the call count before one thread advances it (the waits' sums are barriers).
        tl.debug_barrier()
        tl.store(calls_ptr + pid, seen)  # = call: what the waits returned, so that they are not dead code
    elif FLOAT_KIND == 0:
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for source in tl.static_range(WORLD):
            if source == rank:
                total += words.to(tl.float32, bitcast=True)
            else:
                source_words, _ = _wait_for_words(own_data + (half + source) * slot_words + offs, mask, call, flag)
                total += source_words.to(tl.float32, bitcast=True)
        tl.store(y_ptr + offs, total.to(tl.int32, bitcast=True), mask=mask)
        tl.debug_barrier()
        tl.store(calls_ptr + pid, call)
    else:
        total_low = tl.zeros((BLOCK,), dtype=tl.float32)
        total_high = tl.zeros((BLOCK,), dtype=tl.float32)
        for source in tl.static_range(WORLD):
            if source == rank:
                low, high = _halves_to_float(words, FLOAT_KIND == 1)
            else:
                source_words, _ = _wait_for_words(own_data + (half + source) * slot_words + offs, mask, call, flag)
                low, high = _halves_to_float(source_words, FLOAT_KIND == 1)
            total_low += low
            total_high += high
        out = (_float_to_half_bits(total_high, FLOAT_KIND == 1) << 16) | _float_to_half_bits(total_low, FLOAT_KIND == 1)
        tl.store(y_ptr + offs, out, mask=mask)
        tl.debug_barrier()
        tl.store(calls_ptr + pid, call)


class OneShotCollectives:
    """All-reduces (`__call__`) and broadcasts from rank 0 (`broadcast`) of small tensors. The kernel's state
    on one rank: a device tensor of every rank's buffer address, and this rank's call counts. Every rank
    builds it with the same `max_bytes` and calls it with the same tensors' sizes in the same order (as any
    collective)."""

    def __init__(self, rank: int, world_size: int, data_ptrs: list[int], max_bytes: int, device: torch.device):
        require(len(data_ptrs) == world_size and 0 <= rank < world_size,
                lambda: f"rank {rank} of {world_size} with {len(data_ptrs)} buffers")
        require(max_bytes % 4 == 0, lambda: f"max_bytes {max_bytes}: whole 32-bit words expected")
        self.rank, self.world_size, self.max_bytes = rank, world_size, max_bytes
        self.data_ptrs = torch.tensor(data_ptrs, dtype=torch.int64, device=device)
        self.calls = torch.zeros(self.max_programs(max_bytes), dtype=torch.int32, device=device)

    @staticmethod
    def max_programs(max_bytes: int) -> int:
        return triton.cdiv(max_bytes // 4, BLOCK)

    @staticmethod
    def buffer_bytes(max_bytes: int, world_size: int) -> int:
        """Bytes of the buffer every rank maps, zeroed on every rank before any rank's first call: two halves
        of one slot a rank, each 32-bit word of `max_bytes` paired with a call number."""
        return 2 * world_size * (max_bytes // 4) * 8

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum over ranks of `x` (contiguous, whole 32-bit words, at most `max_bytes`), in `out` or a new
        tensor."""
        num_bytes = x.numel() * x.element_size()
        require(x.is_contiguous() and x.dtype in ACT_DTYPES and num_bytes % 4 == 0 and num_bytes <= self.max_bytes,
                lambda: f"x: contiguous 16- or 32-bit floats, whole 32-bit words, at most {self.max_bytes} bytes; "
                        f"got {tuple(x.shape)} {x.dtype}")
        out = torch.empty_like(x) if out is None else out
        self._launch(x.view(-1).view(torch.int32), out.view(-1).view(torch.int32), _FLOAT_KINDS[x.dtype],
                     is_broadcast=False)
        return out

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype: contiguous, a whole number of 32-bit
        words, at most `max_bytes`), in place; returns it."""
        num_bytes = tensor.numel() * tensor.element_size()
        require(tensor.is_contiguous() and num_bytes % 4 == 0 and num_bytes <= self.max_bytes,
                lambda: f"tensor: contiguous, whole 32-bit words, at most {self.max_bytes} bytes; got "
                        f"{tuple(tensor.shape)} {tensor.dtype}")
        words = tensor.view(-1).view(torch.int32)  # any dtype: moved as words
        self._launch(words, words, float_kind=0, is_broadcast=True)
        return tensor

    def _launch(self, words: torch.Tensor, out: torch.Tensor, float_kind: int, is_broadcast: bool) -> None:
        num_words = words.numel()
        if num_words == 0:
            return  # no programs, on every rank alike
        opts = {} if is_interpreter() else {"num_warps": 4}
        _one_shot_kernel[(triton.cdiv(num_words, BLOCK),)](
            words, out, self.data_ptrs, self.calls, num_words, self.max_bytes // 4, self.rank,
            WORLD=self.world_size, BLOCK=BLOCK, IS_BROADCAST=is_broadcast, FLOAT_KIND=float_kind, **opts,
            **pdl_args(words.device))
