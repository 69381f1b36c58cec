"""EXPERIMENT (not shipped, not yet run on a GPU): the int4 decode GEMV in Gluon (Triton >= 3.6), y = x @ dequant(w).T
for 1..8 rows of x, 4-bit codes with a constant zero (GPTQ symmetric / in-situ int4), groups of 128.

What the Triton kernel (`kernels/quant_gemv_tc.py`) cannot express and this does:
- the codes never touch shared memory: at load they are repacked (`repack_thread_major`) so that each thread of the
  warpgroup reads its own 32 bytes of a 64 x 128 tile (two 16-byte loads) and widens them in registers straight into
  the wgmma A-operand layout (the conversion is asserted trivial at compile time);
- 71 registers a thread (the Triton kernel: 147), so several programs share a multiprocessor and hide each other's
  MMA waits (an MMA kept in flight while the next step widens is what ptxas will not do with register A: C7513);
- x^T for the program's whole K range is staged in shared memory once, by asynchronous copies all in flight together
  (8 columns: the MMA's N = 8), so the K loop has no barrier;
- the codes of the first STAGES steps are requested before the PDL wait (weights do not depend on earlier kernels).
Split K across programs as `kernels/split_k.py` does (fp32 partials, the last program to arrive sums in split order).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

BN = gl.constexpr(64)  # weight rows a program (one m64 wgmma tile, one warpgroup)
BK = gl.constexpr(128)  # K step (one group)
BM = gl.constexpr(8)  # x rows (the MMA's N)
TILE_WORDS = gl.constexpr(64 * 128 // 8)  # int32 words of one 64 x 128 tile

# one 32-bit word (bytes b0..b3, $8) -> 8 bf16 codes minus the zero: (lo b0, lo b1), (hi b0, hi b1), (lo b2, lo b3),
# (hi b2, hi b3); each nibble OR-ed into the mantissa of MAGIC (128.0), then MAGIC + zero ($9: two bf16) subtracted
# two at a time (exact: integers below 256)
WIDEN8 = gl.constexpr("""{
    .reg .b32 t, u, r0, r1, r2, r3;
    prmt.b32 t, $8, 0, 0x4140;
    lop3.b32 r0, t, 0x000F000F, 0x43004300, 0xEA;
    shr.u32 t, t, 4;
    lop3.b32 r1, t, 0x000F000F, 0x43004300, 0xEA;
    prmt.b32 u, $8, 0, 0x4342;
    lop3.b32 r2, u, 0x000F000F, 0x43004300, 0xEA;
    shr.u32 u, u, 4;
    lop3.b32 r3, u, 0x000F000F, 0x43004300, 0xEA;
    sub.bf16x2 r0, r0, $9;
    sub.bf16x2 r1, r1, $9;
    sub.bf16x2 r2, r2, $9;
    sub.bf16x2 r3, r3, $9;
    mov.b32 {$0, $1}, r0;
    mov.b32 {$2, $3}, r1;
    mov.b32 {$4, $5}, r2;
    mov.b32 {$6, $7}, r3;
    }""")
FENCE = gl.constexpr("fence.acq_rel.gpu;\nmov.u32 $0, $1;")
GDC_WAIT = gl.constexpr("griddepcontrol.wait;\nmov.u32 $0, $1;")
GDC_LAUNCH = gl.constexpr("griddepcontrol.launch_dependents;\nmov.u32 $0, $1;")


def repack_thread_major(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] uint8 (0..15; N % 64 == 0, K % 128 == 0) -> int32 [N/64, K/128, 128 threads, 8 words]: thread t
    of a tile holds, in word c (k16 chunk c), rows r0 = 16 (t // 32) + (t % 32) // 4 and r1 = r0 + 8 at columns
    k = 16 c + 2 (t % 4) + {0, 1, 8, 9}: byte b0 = (r0, k) | (r1, k) << 4, b1 = (r0, k+1) | (r1, k+1) << 4,
    b2 = (r0, k+8) | (r1, k+8) << 4, b3 = (r0, k+9) | (r1, k+9) << 4."""
    n, k = q.shape
    assert n % 64 == 0 and k % 128 == 0
    t = torch.arange(128, device=q.device)
    r0 = 16 * (t // 32) + (t % 32) // 4  # [128]
    r1 = r0 + 8
    c = torch.arange(8, device=q.device)
    kk = 16 * c[None, :] + 2 * (t % 4)[:, None]  # [128, 8]
    tiles = q.to(torch.int32).view(n // 64, 64, k // 128, 128).permute(0, 2, 1, 3)  # [NT, KT, 64, 128]

    def byte(col):  # [NT, KT, 128, 8]
        lo = tiles[:, :, r0[:, None].expand(128, 8), col]
        hi = tiles[:, :, r1[:, None].expand(128, 8), col]
        return lo | (hi << 4)

    words = byte(kk) | (byte(kk + 1) << 8) | (byte(kk + 8) << 16) | (byte(kk + 9) << 24)
    return words.contiguous()


@gluon.jit
def _widened_tile(words, zero_pair, a_layout: gl.constexpr):
    """words int32 [128 threads, 8] -> the [64, 128] bf16 A operand, code - zero, in a_layout (no data moved)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
        WIDEN8, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, zero_pair], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    a = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
    # [t, w, k0, n3, k3]; t = (n5 n4 n2 n1 n0 k2 k1) high to low, w = (k6 k5 k4)
    a = gl.reshape(a, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    a = gl.permute(a, [0, 1, 11, 2, 3, 4, 7, 8, 9, 12, 5, 6, 10])  # -> n5 n4 n3 n2 n1 n0 k6 k5 k4 k3 k2 k1 k0
    return gl.convert_layout(gl.reshape(a, [64, 128]), a_layout, assert_trivial=True)


@gluon.jit
def _token_asm(asm: gl.constexpr, token):
    return gl.inline_asm_elementwise(asm, "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def int4_gemv_kernel(x_ptr, q_ptr, s_ptr, r_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_xm, stride_s, stride_rm,
                     stride_ym, ZERO_PAIR: gl.constexpr, K_SPLIT: gl.constexpr, SPLIT_K: gl.constexpr,
                     RESIDUAL: gl.constexpr, USE_PDL: gl.constexpr,
                     DEPTH: gl.constexpr = 2):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    words_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    STEPS: gl.constexpr = K_SPLIT // BK
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    k_steps = K // BK
    t = gl.arange(0, 128, layout=gl.SliceLayout(1, words_layout))
    w = gl.arange(0, 8, layout=gl.SliceLayout(0, words_layout))
    # tile (pid_n, step) of this program's K range: TILE_WORDS words from q_at + step * TILE_WORDS
    q_at = q_ptr + (pid_n * k_steps + pid_k * STEPS).to(gl.int64) * TILE_WORDS + t[:, None] * 8 + w[None, :]
    rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    s_at = s_ptr + rows.to(gl.int64) * stride_s + pid_k * STEPS

    # the first steps' codes in flight before the wait: nothing earlier in the stream writes them
    words0 = gl.load(q_at)
    words1 = gl.load(q_at + TILE_WORDS)
    words2 = gl.load(q_at + 2 * TILE_WORDS, mask=DEPTH > 2 and 2 < STEPS)
    if USE_PDL:
        _token_asm(GDC_WAIT, pid_n)
        _token_asm(GDC_LAUNCH, pid_n)

    # x^T of the K range, 8 columns (rows of x past M are zeros), staged once: no barrier in the K loop
    # (rows of x, K contiguous: the MMA reads it as x^T, K-major)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STEPS, BM, BK], b_layout)
    xm = gl.arange(0, BM, layout=gl.SliceLayout(1, x_layout))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
    x_at = x_ptr + xm[:, None].to(gl.int64) * stride_xm + pid_k * K_SPLIT + xk[None, :]
    # NOTE: asynchronous copies, all in flight at once (stores from registers put a barrier and a load's latency
    # between every two steps); rows of x past M are filled with zeros
    for i in gl.static_range(STEPS):
        async_copy.async_copy_global_to_shared(x_smem.index(i), x_at + i * BK, mask=(xm < M)[:, None])
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    # MAGIC + zero, twice (bf16 bits: `_zero_pair`)
    zero_pair = gl.full([128, 8], ZERO_PAIR, gl.int32, layout=words_layout)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    zero_acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    # NOTE: each step's MMA waited at once. With register A, ptxas serializes every wgmma (C7513) when the next
    # step's A is widened while an MMA is in flight (tried: two in flight in turn): the overlap comes from the other
    # programs on the multiprocessor (71 registers a thread here)
    # the codes DEPTH steps ahead in flight (2 or 3: 64 or 96 bytes a thread)
    words = words0
    words_next = words1
    words_next2 = words2
    for step in range(STEPS):
        if DEPTH > 2:
            words_after = gl.load(q_at + (step + 3) * TILE_WORDS, mask=step + 3 < STEPS)
        else:
            words_after = gl.load(q_at + (step + 2) * TILE_WORDS, mask=step + 2 < STEPS)
        scale = gl.load(s_at + step).to(gl.float32)
        part = warpgroup_mma(_widened_tile(words, zero_pair, a_layout), x_smem.index(step).permute([1, 0]),
                             zero_acc)
        acc += part * scale[:, None]
        words = words_next
        if DEPTH > 2:
            words_next = words_next2
            words_next2 = words_after
        else:
            words_next = words_after

    ms = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    out_mask = (rows < N)[:, None] & (ms < M)[None, :]
    if SPLIT_K > 1:
        slab = BM * N
        ws_at = ws_ptr + ms[None, :] * N + rows[:, None]
        gl.store(ws_at + pid_k * slab, acc, mask=out_mask)
        _token_asm(FENCE, pid_n)
        gl.thread_barrier()
        arrived = gl.atomic_add(count_ptr + pid_n, 1, sem="relaxed", scope="gpu")
        if arrived == SPLIT_K - 1:
            gl.thread_barrier()
            _token_asm(FENCE, pid_n)
            acc = gl.zeros([BN, BM], gl.float32, layout=mma)
            for split in gl.static_range(SPLIT_K):
                acc += gl.load(ws_at + split * slab, mask=out_mask, other=0.0, cache_modifier=".cg")
            gl.store(count_ptr + pid_n, 0)
            _finish(acc, r_ptr, y_ptr, rows, ms, out_mask, stride_rm, stride_ym, RESIDUAL)
    else:
        _finish(acc, r_ptr, y_ptr, rows, ms, out_mask, stride_rm, stride_ym, RESIDUAL)


@gluon.jit
def _finish(acc, r_ptr, y_ptr, rows, ms, out_mask, stride_rm, stride_ym, RESIDUAL: gl.constexpr):
    if RESIDUAL:
        acc += gl.load(r_ptr + ms[None, :] * stride_rm + rows[:, None], mask=out_mask, other=0.0).to(gl.float32)
    gl.store(y_ptr + ms[None, :] * stride_ym + rows[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _zero_pair(zero: int) -> int:
    """Two bf16 (MAGIC + zero: the mantissa of 128.0 holds zero) in one int32 (0 <= zero < 16)."""
    assert 0 <= zero < 16
    half = 0x4300 | zero
    value = (half << 16) | half
    return value - (1 << 32) if value >= 1 << 31 else value


def int4_gemv(x, words, scales, n, k, zero=8, split_k=1, residual=None, out=None, use_pdl=False, depth=2):
    """x [M <= 8, K] bf16 @ dequant(w).T (+ residual) -> [M, N] bf16; words from `repack_thread_major`, scales [N,
    K / 128]."""
    m = x.shape[0]
    assert m <= 8 and k % (128 * split_k) == 0 and k // split_k >= 256 and n % 64 == 0
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    ws = torch.empty(split_k * 8 * n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    counts = torch.zeros(n // 64, dtype=torch.int32, device=x.device) if split_k > 1 else out
    r = residual if residual is not None else out
    int4_gemv_kernel[(n // 64, split_k)](
        x, words, scales, r, out, ws, counts, m, n, k, x.stride(0), scales.stride(0), r.stride(0), out.stride(0),
        ZERO_PAIR=_zero_pair(zero), K_SPLIT=k // split_k, SPLIT_K=split_k, RESIDUAL=residual is not None,
        USE_PDL=use_pdl, DEPTH=depth, num_warps=4, **({"launch_pdl": True} if use_pdl else {}))
    return out
