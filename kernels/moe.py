"""Fused mixture-of-experts MLP: tokens sorted by expert, a grouped GEMM over the experts' weights with
the SiLU gate fused, then the down projection weighted by the router and combined per token.

    pairs      T * k (token, expert) pairs; pair p is token p // k's j-th choice (j = p % k)
    align      pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M:

                 sorted_pairs  [ e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e3 -- -- -- | .. ]   -- = padding (T * k)
                 block_expert  [     0       |      2      |      2      |      3      | E (unused) ]

    gemm 1     h[p] = silu(x[p // k] W_gate[e]^T) * (x[p // k] W_up[e]^T)      [T * k, I]
    gemm 2     y[p] = w[p] * (h[p] W_down[e]^T)                               [T * k, H]
    combine    out[t] = sum_j y[t * k + j]                                    [T, H]

Each program of a GEMM takes one BLOCK_M block of sorted pairs (one expert) and one BLOCK_N tile of
output columns, so every weight tile is read once per block of tokens that chose the expert. The
alignment is computed on the device with a fixed upper bound on its size (no host sync: CUDA-graph
capturable); blocks past the last expert's are marked with expert E and return at once.

Decode steps have few pairs, nearly all on different experts: there the alignment's small device ops and
BLOCK_M rows of mostly padding cost more than the weights they read. With at most `decode_max_pairs` pairs
both projections run as GEMVs instead, reading the experts' rows straight from `topk_ids` (no sort, no
padding): gate_up one program a (pair, BLOCK_N tile), down one a (token, BLOCK_N tile) that also
combines the token's k pairs (no y, no separate sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    cast,
    dot_precision,
    dot_upcast,
    is_interpreter,
    mma,
    next_pow2,
    pdl_args,
    pdl_enter,
    require,
    require_dtype,
    require_same_device,
    require_shape,
)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # GATED: x [T, K] (row = pair // TOP_K); else h [T * k, K] (row = pair)
    w_ptr,  # [E, N_W, K]: GATED: gate rows [0, N) then up rows [N, 2 N); else N_W = N
    out_ptr,  # [T * k, N]
    pair_weight_ptr,  # [T * k] float32 router weights (read when WEIGHTED)
    sorted_pairs_ptr,  # [max_padded] int32; padding = num_pairs
    block_expert_ptr,  # [max_blocks] int32; E past the last expert's blocks
    num_pairs,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_o,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    is_row = pairs < num_pairs
    rows = (pairs // TOP_K) if GATED else pairs
    rows = tl.where(is_row, rows, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + (k0 + offs_k)[None, :],
                    mask=is_row[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w_offs = offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None]  # [BK, BN]: W^T tile
        w_mask = n_mask[None, :] & k_mask[:, None]
        acc = mma(a, tl.load(w_base + w_offs, mask=w_mask, other=0.0), acc, DOT_PREC, UPCAST)
        if GATED:
            acc_up = mma(a, tl.load(w_base + N * stride_wn + w_offs, mask=w_mask, other=0.0), acc_up,
                         DOT_PREC, UPCAST)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(pair_weight_ptr + pairs, mask=is_row, other=0.0)[:, None]
    out_offs = tl.where(is_row, pairs, 0).to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(out_ptr + out_offs, cast(acc, out_ptr.dtype.element_ty), mask=is_row[:, None] & n_mask[None, :])


@triton.jit
def _moe_gate_up_gemv_kernel(
    x_ptr,  # [T, K]; pair p reads row p // TOP_K
    w_ptr,  # [E, 2 N, K]: gate rows then up rows
    out_ptr,  # [T * k, N]
    expert_ids_ptr,  # [T * k] the pairs' experts (topk_ids flattened)
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_o,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """h[p] = silu(x W_gate[e]^T) * (x W_up[e]^T) for one pair p and one BLOCK_N tile of h's columns."""
    pdl_enter(USE_PDL)
    pair = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(x_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]  # [1, BK]
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=w_mask, other=0.0)  # [BN, BK]
        acc += tl.sum(w.to(tl.float32) * a, axis=1)
        w_up = tl.load(w_rows + N * stride_wn + (k0 + offs_k)[None, :], mask=w_mask, other=0.0)
        acc_up += tl.sum(w_up.to(tl.float32) * a, axis=1)
    acc = acc * tl.sigmoid(acc) * acc_up
    tl.store(out_ptr + pair.to(tl.int64) * stride_o + offs_n, cast(acc, out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_down_combine_kernel(
    h_ptr,  # [T * k, K] the pairs' gated activations
    w_ptr,  # [E, N, K] down_proj
    out_ptr,  # [T, N]
    pair_weight_ptr,  # [T * k] float32 router weights
    expert_ids_ptr,  # [T * k]
    residual_ptr,  # [T, N] (HAS_RESIDUAL)
    N,
    K,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    stride_r,
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t] = sum_j round(w[t, j] * h[t k + j] W_down[e_j]^T) (+ residual[t]): the down GEMVs of one token's k
    pairs and their combine in one program (rounded per pair to out's dtype, summed in fp32, as y and torch.sum
    were).
    The k experts' tiles are loaded together, [BLOCK_J, BLOCK_N, BLOCK_K] a step, so a program keeps as
    many loads in flight as k programs of one pair each did."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J)
    j_mask = offs_j < TOP_K
    pairs = token * TOP_K + offs_j  # [BJ]
    experts = tl.load(expert_ids_ptr + pairs, mask=j_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = (w_ptr + experts[:, None, None] * stride_we
              + offs_n.to(tl.int64)[None, :, None] * stride_wn)  # [BJ, BN, 1]
    h_rows = h_ptr + pairs[:, None] * stride_h  # [BJ, 1]
    acc = tl.zeros((BLOCK_J, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(h_rows + (k0 + offs_k)[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)  # [BJ, BK]
        w = tl.load(w_rows + (k0 + offs_k)[None, None, :],
                    mask=j_mask[:, None, None] & n_mask[None, :, None] & k_mask[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)
    pair_weights = tl.load(pair_weight_ptr + pairs, mask=j_mask, other=0.0)  # [BJ]
    per_pair = cast(acc * pair_weights[:, None], out_ptr.dtype.element_ty).to(tl.float32)
    total = tl.sum(tl.where(j_mask[:, None], per_pair, 0.0), axis=0)
    if HAS_RESIDUAL:
        total += tl.load(residual_ptr + token * stride_r + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs_n, cast(total, out_ptr.dtype.element_ty), mask=n_mask)


# (BLOCK_N, BLOCK_K, num_warps) of the decode GEMVs; down's BLOCK_K is per expert (a step loads k of them)
# (H100, Qwen3-30B-A3B's shapes, one token: gate_up 32.8 us with the old down tiles against 34.6 for (16, 512, 8);
# down 30.4 us with the old gate_up tiles against 34.6 for (16, 64, 8): bench/moe_kernel_tune.py --decode)
DECODE_GATE_UP_TILES = (4, 1024, 4)
DECODE_DOWN_TILES = (2, 128, 8)


def decode_max_pairs(num_experts: int, top_k: int) -> int:
    """The most (token, expert) pairs `fused_moe` runs as GEMVs: while pairs are at most half the experts
    (or one token's), few experts get two, so reading an expert's rows once per pair costs little."""
    return max(num_experts // 2, top_k)


def align_pairs_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pairs [max_padded] int32, block_expert [max_padded // block_m] int32).

    The (token, choice) pairs grouped by expert, each run padded to a multiple of `block_m` (padding
    entries = T * k), and the expert of every block (`num_experts` for blocks past the last run).
    Sizes depend only on T, k, E and block_m: no host sync."""
    num_pairs = ids.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    flat = ids.reshape(-1)
    # NOTE: not torch.bincount, which reads the largest id back to the host (no CUDA-graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    expert_of = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=ids.device) - first_of_expert[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)  # E past the end
    return sorted_pairs, block_expert


def fused_moe(
    x: torch.Tensor,  # [T, H]
    gate_up_proj: torch.Tensor,  # [E, 2 I, H]: gate rows then up rows
    down_proj: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    use_gemv: bool | None = None,
    down_tiles: tuple[int, int, int] | None = None,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j] -> [T, H] in
    x's dtype, plus `residual` if given (the decoder's residual add). The intermediate activations are rounded
    to x's dtype (as the per-expert loop in that dtype rounds them); accumulation is fp32. The block sizes default by the number of pairs; `use_gemv`
    (default: at most `decode_max_pairs` pairs) runs the per-pair GEMVs instead of the grouped GEMMs; there
    `block_n`, `block_k`, `num_warps` are gate_up's tiles and `down_tiles` (block_n, block_k of one expert,
    num_warps) the down projection's."""
    require(x.dim() == 2, lambda: f"x: expected [T, H], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    require(gate_up_proj.dim() == 3 and gate_up_proj.shape[1] % 2 == 0,
            lambda: f"gate_up_proj: expected [E, 2 I, H], got {tuple(gate_up_proj.shape)}")
    num_experts, two_i, _ = gate_up_proj.shape
    intermediate = two_i // 2
    require_shape("gate_up_proj", gate_up_proj, (num_experts, two_i, hidden))
    require_shape("down_proj", down_proj, (num_experts, hidden, intermediate))
    require(topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens,
            lambda: f"topk_ids: expected [{num_tokens}, k], got {tuple(topk_ids.shape)}")
    require_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    for name, t in (("x", x), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        require_dtype(name, t, ACT_DTYPES)
        require(t.dtype == x.dtype, lambda name=name, t=t: f"{name}: dtype {t.dtype} differs from x's {x.dtype}")
        require(t.stride(-1) == 1 and (t.dim() < 3 or t.stride(1) == t.shape[2]),
                lambda name=name: f"{name}: rows must be contiguous")
    require_same_device(x=x, gate_up_proj=gate_up_proj, down_proj=down_proj, topk_ids=topk_ids,
                        topk_weights=topk_weights)
    require(residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1),
            lambda: f"residual: expected x's shape {tuple(x.shape)} and dtype, got {tuple(residual.shape)} "
                    f"{residual.dtype}")
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    pair_weights = topk_weights.reshape(-1).to(torch.float32)
    h = torch.empty((num_pairs, intermediate), dtype=x.dtype, device=x.device)
    if use_gemv if use_gemv is not None else num_pairs <= decode_max_pairs(num_experts, top_k):
        _gemv_pairs(x, gate_up_proj, down_proj, h, out, pair_weights, topk_ids, top_k, (block_n, block_k, num_warps),
                    down_tiles, residual)
        return out
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    # NOTE: few pairs per expert at decode: a small BLOCK_M wastes less of each block on padding.
    block_m = block_m or (16 if num_pairs <= 4 * num_experts else 32)
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, num_experts, block_m)
    common = dict(NUM_EXPERTS=num_experts, TOP_K=top_k, BLOCK_M=block_m, DOT_PREC=dot_precision(x.dtype),
                  UPCAST=dot_upcast(), **({} if is_interpreter() else {"num_warps": num_warps or 4}))
    if is_interpreter():
        block_n, block_k = block_n or 32, block_k or 32
    else:
        # NOTE: few pairs (decode): narrow column tiles spread the experts' weights over more programs.
        # Chosen by bench/moe_kernel_tune.py on an H100 at Qwen3-30B-A3B's shapes.
        block_n, block_k = block_n or (32 if block_m == 16 else 128), block_k or 128
        if x.dtype == torch.float32:  # 4-byte tiles: 128 x 128 of gate and up outgrow shared memory (288 KB)
            block_n, block_k = min(block_n, 64), min(block_k, 64)
    for a, w, o, n, k, gated in ((x, gate_up_proj, h, intermediate, hidden, True),
                                 (h, down_proj, y, hidden, intermediate, False)):
        grid = (block_expert.shape[0], triton.cdiv(n, block_n))
        _moe_gemm_kernel[grid](a, w, o, pair_weights, sorted_pairs, block_expert, num_pairs, n, k,
                               a.stride(0), w.stride(0), w.stride(1), o.stride(0),
                               GATED=gated, WEIGHTED=not gated, BLOCK_N=block_n, BLOCK_K=block_k, **common)
    torch.sum(y.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out if residual is None else out.add_(residual)


def _gemv_pairs(x, gate_up_proj, down_proj, h, out, pair_weights, topk_ids, top_k, gate_up_tiles, down_tiles,
                residual) -> None:
    """h = the gated MLP input of every pair (one program a (pair, tile)), then out = each token's weighted
    down projections summed (one program a (token, tile), its k pairs together)."""
    ids = topk_ids.reshape(-1)
    intermediate, hidden = h.shape[1], out.shape[1]
    gu_default, down_default = ((16, 32, 4), (16, 16, 4)) if is_interpreter() else (DECODE_GATE_UP_TILES,
                                                                                    DECODE_DOWN_TILES)
    gu_n, gu_k, gu_warps = (given or default for given, default in zip(gate_up_tiles, gu_default, strict=True))
    down_n, down_k, down_warps = down_tiles or down_default
    gu_extra, down_extra = ({}, {}) if is_interpreter() else ({"num_warps": gu_warps}, {"num_warps": down_warps})
    _moe_gate_up_gemv_kernel[(ids.shape[0], triton.cdiv(intermediate, gu_n))](
        x, gate_up_proj, h, ids, intermediate, hidden, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1),
        h.stride(0), TOP_K=top_k, BLOCK_N=gu_n, BLOCK_K=gu_k, **gu_extra, **pdl_args(x.device))
    _moe_down_combine_kernel[(out.shape[0], triton.cdiv(hidden, down_n))](
        h, down_proj, out, pair_weights, ids, residual if residual is not None else out, hidden, intermediate,
        h.stride(0), down_proj.stride(0), down_proj.stride(1), out.stride(0),
        residual.stride(0) if residual is not None else 0, TOP_K=top_k, BLOCK_J=next_pow2(top_k), BLOCK_N=down_n,
        BLOCK_K=down_k, HAS_RESIDUAL=residual is not None, **down_extra, **pdl_args(x.device))


def fused_moe_ref(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """float64 per-expert loop: for each expert, its tokens' gated MLP, weighted, added per token."""
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    intermediate = down_proj.shape[2]
    for expert in range(gate_up_proj.shape[0]):
        tokens, choice = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        gate_up = x64[tokens] @ gate_up_proj[expert].double().T
        h = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out.index_add_(0, tokens, (h @ down_proj[expert].double().T) * topk_weights[tokens, choice, None].double())
    return out
