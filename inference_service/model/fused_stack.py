"""The fused decoder stack: the layers of `layers.py` run on the Triton kernels of `kernels/` (the GPU path).

Same parameters (and so the same weight loading) as the eager stack; only the forward differs. Per
layer, the element-wise work is four launches (five with Qwen3's q/k norm):

    fused_add_rms_norm   residual += hidden; hidden = rms_norm(residual)   (first layer: rms_norm only)
    apply_rotary         q and k in place, as views of the fused qkv output
    fused_add_rms_norm   residual += attention output; normed for the MLP
    silu_and_mul         silu(gate) * up

The residual stream is kept apart from the hidden states, as in vLLM: a layer takes and returns
(hidden, residual) inside this stack, and the stack adds the last layer's output into the stream.

Decode batches of up to `kernels.MAX_GEMV_ROWS` rows in bf16/fp16 take a shorter path: every
projection is `kernels.gemv`, with the RMSNorm computed in the qkv and gate_up projections' prologue,
the SiLU gate in the down projection's, and the residual adds in the o and down projections'
epilogues, and the rotary (with Qwen3's QK-norm) and the KV write happen inside the decode attention kernel
(`kernels/decode_prologue.py`). A layer then launches qkv, attention, o, gate_up and down; on
tensor-parallel shards, plus the o and down projections' all-reduces.
With quantized weights on one Hopper GPU, up to `MAX_PREFETCH_ROWS` rows, a kernel on a second stream runs
beside each layer's attention and brings the o and gate_up weights' first bytes into L2
(`kernels/l2_prefetch.py`); o waits for it.
Projections kept in the packed integer layout (int4 / int8: GPTQ, AWQ, compressed-tensors, GGUF,
in-situ) run `kernels.quant_matmul` there with the same options, on batches of up to
`gemv_faster_rows` rows (past those the tensor-core GEMM beats the quantized GEMV). The path is
taken only when every projection is one of those two (fp8 weights, and parts kept apart, run the
general path through their own `forward`). A mixture-of-experts layer folds its attention the same way;
its MLP is one RMSNorm launch, the router (`kernels.moe_route`) and `kernels.fused_moe`, which adds the
residual stream in its down projection (not on tensor-parallel shards: there MoE layers run the general path).

Every step is CUDA-graph capturable: no host syncs and no branches on tensor values. This module
imports Triton; `DecoderModel` imports it only when it picks this stack.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from inference_service.attention.backend import AttentionBackend
from inference_service.attention.metadata import AttentionMetadata
from inference_service.model.config import ModelConfig
from inference_service.model.layers import Attention, DecoderLayer
from inference_service.model.linear import DenseLinear
from inference_service.model.moe import SparseMoE, route
from inference_service.model.norms import RMSNorm
from inference_service.model.rope import kernel_cos_sin_cache
from kernels.l2_prefetch import MAX_PREFETCH_ROWS, PrefetchPlan, default_prefetch_bytes
from kernels.quant_gemv import gemv_faster_rows
from kernels.quant_layout import IntPackedWeight

KVCache = tuple[torch.Tensor, torch.Tensor]


def uses_gemv(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a projection of `x` [T, in] with weights of `dtype` runs `kernels.gemv`: a decode batch
    of a few rows in bf16/fp16, where it streams the weight faster than cuBLAS (bench/results) and
    takes the norm, gate and residual add along. fp32 keeps the library matmul and the separate
    element-wise kernels: it is the reference-precision path, compared token for token with the CPU engine."""
    return x.shape[0] <= kernels.MAX_GEMV_ROWS and dtype in (torch.bfloat16, torch.float16)


class GemvLinear(DenseLinear):
    """`DenseLinear` for the fused stack: a few bf16/fp16 rows through `kernels.gemv`, others through
    the library matmul; never packed (the kernels read `weight` in its plain layout)."""

    def finish_loading(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_gemv(x, self.weight.dtype):
            return kernels.gemv(x, self.weight, self.bias)
        return super().forward(x)


class FusedStack:
    """`forward(hidden, positions, kv_caches, metadata) -> hidden` over `layers`, and the final norm."""

    def __init__(self, config: ModelConfig, layers: nn.ModuleList, norm: RMSNorm, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device | str):
        self.layers, self.norm, self.backend, self.dtype = layers, norm, backend, dtype
        self.cos_sin_cache = kernel_cos_sin_cache(config, device)  # [P, D] float32
        # Whether decode batches take the folded path, and up to how many rows: planned at the first step,
        # once the weights are loaded (packed, quantized in situ, sharded).
        self.can_fold_gemv: bool | None = None
        self.max_fold_rows = 0
        # Per layer, the o and gate_up weights' first bytes brought into L2 during a small batch's attention
        # (`kernels/l2_prefetch.py`); planned with the folding. Empty where the device cannot prefetch and for
        # 16-bit or sharded weights.
        self.prefetch_plans: list[PrefetchPlan] = []
        self.prefetch_stream: torch.cuda.Stream | None = None

    def plan_folding(self) -> None:
        """Sets `can_fold_gemv` and `max_fold_rows` from the projections as loaded."""
        modules = [module for layer in self.layers
                   for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                  getattr(layer.mlp, "gate_up_proj", None), getattr(layer.mlp, "down_proj", None))
                   if module is not None]
        projections = [_local_linear(module) for module in modules]
        # NOTE: a mixture-of-experts layer folds its attention's projections only; its experts run fused_moe,
        # which has no tensor-parallel split
        is_sharded = any(getattr(module, "group", None) is not None for module in modules)
        self.can_fold_gemv = (not (is_sharded and any(isinstance(layer.mlp, SparseMoE) for layer in self.layers))
                              and all(isinstance(p, DenseLinear) or _int_packed(p) is not None for p in projections))
        # The quantized GEMV loses to the tensor-core GEMM past `gemv_faster_rows` (bench/gpu_quant.py): the
        # fold stops where the first projection leaves it
        packed = [w for w in map(_int_packed, projections) if w is not None]
        self.max_fold_rows = min(map(gemv_faster_rows, packed)) if packed else kernels.MAX_GEMV_ROWS
        # Measured (bench/results/h200-2026-11-28): quantized weights gain (int4 +2.5%, fp8 +0.9% at batch 1), 16-bit
        # ones do not (bf16 +0.15% on one GPU, -1.9% on two tensor-parallel ranks)
        is_quantized = any(not isinstance(p, DenseLinear) for p in projections)
        self.prefetch_plans = self._plan_prefetch() if is_quantized and not is_sharded else []
        device = self.cos_sin_cache.device
        if self.prefetch_plans and device.type == "cuda" and self.prefetch_stream is None:
            self.prefetch_stream = torch.cuda.Stream(device)

    def _plan_prefetch(self) -> list[PrefetchPlan]:
        """One plan a layer, launched beside its attention: its o projection's streamed weight, then its dense
        MLP's gate_up, up to `default_prefetch_bytes`. (Prefetching each projection's successor beside it as well
        measured slower: beside a GEMV the prefetch takes the bus the GEMV streams on.)"""
        max_bytes = default_prefetch_bytes(self.cos_sin_cache.device)
        if max_bytes <= 0:
            return []
        plans = []
        for layer in self.layers:
            modules = (layer.self_attn.o_proj, getattr(layer.mlp, "gate_up_proj", None))
            weights = [_streamed_weight(_local_linear(m)) for m in modules if m is not None]
            plans.append(PrefetchPlan([w for w in weights if w is not None], max_bytes))
        return plans

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [T, H] embeddings -> the residual stream after the last layer [T, H]."""
        residual = None
        if self.can_fold_gemv is None:
            self.plan_folding()
        folds = self.can_fold_gemv and uses_gemv(hidden, self.dtype) and hidden.shape[0] <= self.max_fold_rows
        prefetches = self.prefetch_plans if hidden.shape[0] <= MAX_PREFETCH_ROWS else []
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            prefetch = prefetches[index] if prefetches else None
            if folds:
                hidden, residual = None, self._layer_gemv(layer, hidden, residual, positions, kv_cache, metadata,
                                                          prefetch)
            else:
                hidden, residual = self._layer(layer, hidden, residual, positions, kv_cache, metadata, prefetch)
        if hidden is None or residual is None:
            return residual if hidden is None else hidden
        return residual.add_(hidden)  # rounded as `fused_add_rms_norm` rounds the stream

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final RMSNorm of the stream [T, H]."""
        return kernels.rms_norm(hidden, self.norm.weight, self.norm.eps)

    def _layer(self, layer: DecoderLayer, hidden: torch.Tensor, residual: torch.Tensor | None,
               positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
               prefetch: PrefetchPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, H] each -> this layer's MLP output and the residual before it is added."""
        attn = layer.self_attn
        qkv, residual = _normed_projection(layer.input_layernorm, attn.qkv_proj, hidden, residual)
        forked = self._fork_prefetch(prefetch)
        out = self._attend(attn, qkv, positions, kv_cache, metadata)
        self._join_prefetch(forked)
        hidden = attn.o_proj(out)
        if not isinstance(layer.mlp, SparseMoE):
            gate_up, residual = _normed_projection(layer.post_attention_layernorm, layer.mlp.gate_up_proj, hidden,
                                                   residual)
            return _gated_down(layer.mlp.down_proj, gate_up), residual  # [T, H]
        hidden, residual = _add_rms_norm(layer.post_attention_layernorm, hidden, residual)
        moe = layer.mlp
        # A decode batch routes in one kernel; prefill keeps the library ops (one program a token
        # would read the whole router each).
        weights, ids = (kernels.moe_route(hidden, moe.gate.weight, moe.top_k, moe.renormalize)
                        if hidden.shape[0] <= kernels.MAX_GEMV_ROWS else route(moe, hidden))
        return kernels.fused_moe(hidden, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids), residual

    def _layer_gemv(self, layer: DecoderLayer, hidden: torch.Tensor | None, residual: torch.Tensor | None,
                    positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                    prefetch: PrefetchPlan | None = None) -> torch.Tensor:
        """Four skinny matmuls carry the layer's element-wise work along (no norm or SiLU launches):
        qkv = norm(stream) Wqkv (+ b), stream += attn Wo, stream += silu_mul(norm(stream) Wgu) Wd; a
        mixture-of-experts layer: stream += fused_moe(norm(stream)), the add in its down projection.
        Returns the stream with the layer's output added."""
        if hidden is None:
            stream = residual  # [T, H], holding every earlier layer's output
        else:
            stream = hidden if residual is None else hidden + residual  # the first layer: the embeddings
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _skinny_matmul(_local_linear(attn.qkv_proj), stream, norm_weight=layer.input_layernorm.weight,
                             eps=layer.input_layernorm.eps)  # [T, q + 2 kv]
        forked = self._fork_prefetch(prefetch)
        out = self._attend(attn, qkv, positions, kv_cache, metadata)  # [T, q]
        self._join_prefetch(forked)
        stream = _gemv_into_stream(attn.o_proj, out, stream)
        if isinstance(mlp, SparseMoE):
            normed = kernels.rms_norm(stream, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            weights, ids = kernels.moe_route(normed, mlp.gate.weight, mlp.top_k, mlp.renormalize)
            return kernels.fused_moe(normed, mlp.experts.gate_up_proj, mlp.experts.down_proj, weights, ids,
                                     residual=stream)  # [T, H]
        gate_up = _skinny_matmul(_local_linear(mlp.gate_up_proj), stream,
                                 norm_weight=layer.post_attention_layernorm.weight,
                                 eps=layer.post_attention_layernorm.eps)  # [T, 2 I]
        return _gemv_into_stream(mlp.down_proj, gate_up, stream, gated=True)  # [T, H]

    def _fork_prefetch(self, plan: PrefetchPlan | None) -> bool:
        """Launches `plan` on the prefetch stream once the work queued so far (the qkv projection) is done,
        so that it runs beside the attention; True if it did."""
        if plan is None or self.prefetch_stream is None:
            return False
        self.prefetch_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.prefetch_stream):
            plan.launch()
        return True

    def _join_prefetch(self, forked: bool) -> None:
        """The next kernel on the current stream (the o projection) waits for the prefetch: a captured graph's
        branch must rejoin, and the o projection's weight is then in L2."""
        if forked:
            torch.cuda.current_stream().wait_stream(self.prefetch_stream)

    def _attend(self, attn: Attention, qkv: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        """qkv [T, q + 2 kv] (the fused projection's output) -> attention output [T, q], before o_proj."""
        num_tokens = qkv.shape[0]
        q_end, k_end = attn.q_size, attn.q_size + attn.kv_size
        qk_norm = {}
        if attn.q_norm is not None and not attn.q_norm.offset and self.cos_sin_cache.shape[1] == attn.head_dim \
                and attn.q_norm.eps == attn.k_norm.eps:
            # QK-norm folded into the rotary kernel, on the views
            qk_norm = {"q_norm_weight": attn.q_norm.weight, "k_norm_weight": attn.k_norm.weight,
                       "norm_eps": attn.q_norm.eps}
        if attn.q_norm is None or qk_norm:
            q = qkv[:, :q_end].view(num_tokens, attn.num_heads, attn.head_dim)  # views of qkv, rotated in place
            k = qkv[:, q_end:k_end].view(num_tokens, attn.num_kv_heads, attn.head_dim)
        else:
            # NOTE: the norm kernel takes rows of one stride, and a head-row of q inside qkv has two
            # (next head, next token), so q and k are copied out (a view when T == 1) and normed in place.
            q = qkv[:, :q_end].reshape(num_tokens * attn.num_heads, attn.head_dim)
            k = qkv[:, q_end:k_end].reshape(num_tokens * attn.num_kv_heads, attn.head_dim)
            kernels.rms_norm(q, attn.q_norm.weight, attn.q_norm.eps, out=q)
            kernels.rms_norm(k, attn.k_norm.weight, attn.k_norm.eps, out=k)
            q = q.view(num_tokens, attn.num_heads, attn.head_dim)
            k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)
        rotary = kernels.Rotary(positions, self.cos_sin_cache, **qk_norm)
        v = qkv[:, k_end:].view(num_tokens, attn.num_kv_heads, attn.head_dim)
        if hasattr(self.backend, "forward_unrotated"):  # the Triton backend: rotary folded into decode attention
            out = self.backend.forward_unrotated(q, k, v, kv_cache[0], kv_cache[1], metadata, attn.scale, rotary,
                                                 sliding_window=attn.sliding_window, soft_cap=attn.soft_cap)
        else:
            rotary.apply(q, k)
            out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, attn.scale,
                                       sliding_window=attn.sliding_window, soft_cap=attn.soft_cap)  # [T, Hq, D]
        return out.reshape(num_tokens, attn.q_size)


def _local_linear(module):
    """The Linear holding a projection's weight (a `DenseLinear` or a `QuantizedLinear`): the module, or
    on a tensor-parallel rank the shard its column- or row-parallel wrapper holds (`model/parallel_linear.py`)."""
    return getattr(module, "local", module)


def _streamed_weight(linear) -> torch.Tensor | None:
    """The tensor a projection's matmul streams most of its bytes from: a dense weight, an fp8 weight, or
    a packed weight's codes; None for a layout this does not know."""
    parts = linear.packed_parts() if hasattr(linear, "packed_parts") else []
    if len(parts) > 1:
        return None
    source = parts[0] if parts else linear
    for name in ("qs", "weight"):
        tensor = getattr(source, name, None)
        if isinstance(tensor, torch.Tensor):
            return tensor
    return None


def _int_packed(linear) -> IntPackedWeight | None:
    """The one packed integer weight a `QuantizedLinear` runs on, if that is what it runs on."""
    return _packed_as(linear, IntPackedWeight)


def _packed_as(linear, weight_cls: type):
    """The one packed weight of class `weight_cls` a `QuantizedLinear` runs on, if that is what it runs on.

    NOTE: asked through `packed_parts()`, not an isinstance check: `model/quantized_linear.py` imports
    this module (for `uses_gemv`), so importing it here would close an import cycle."""
    parts = linear.packed_parts() if hasattr(linear, "packed_parts") else []
    return parts[0] if len(parts) == 1 and isinstance(parts[0], weight_cls) else None


def _normed_projection(norm: RMSNorm, module, hidden: torch.Tensor, residual: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(module(norm(hidden)) [T, out], the residual stream), the residual added first as `_add_rms_norm` does: an
    fp8 weight takes its input quantized in the norm's launch (`kernels.fp8_normed_linear`). A column-parallel
    rank computes its own rows either way (no communication)."""
    linear = _local_linear(module)
    weight = _packed_as(linear, kernels.Fp8Weight)
    if weight is None:
        normed, residual = _add_rms_norm(norm, hidden, residual)
        return module(normed), residual
    out = kernels.fp8_normed_linear(hidden, residual, norm.weight, norm.eps, weight, linear.bias)
    return out, hidden if residual is None else residual


def _gated_down(module, gate_up: torch.Tensor) -> torch.Tensor:
    """The down projection of silu(gate) * up, gate_up [T, 2I]: an fp8 weight quantizes silu(gate) * up in the
    launch that computes it (`kernels.fp8_gated_linear`: in an offline fp8 mixed step of ~8k tokens that pass was
    ~7 ms of ~148, H100). On a tensor-parallel rank the partial sums are all-reduced, as `RowParallelLinear` does."""
    linear, group = _local_linear(module), getattr(module, "group", None)
    weight = _packed_as(linear, kernels.Fp8Weight)
    if weight is None:
        return module(kernels.silu_and_mul(gate_up))
    out = kernels.fp8_gated_linear(gate_up, weight, linear.bias)
    return out if group is None else group.all_reduce(out)


def _skinny_matmul(linear, x: torch.Tensor, **options) -> torch.Tensor:
    """x W^T (+ b) [T, out] for a decode batch, with the fused decoder's options (`norm_weight`/`eps`,
    `gated`, `residual`: see `kernels.gemv`) over a dense or an int-packed weight."""
    packed = _int_packed(linear)
    if packed is not None:
        return kernels.quant_matmul(x, packed, linear.bias, **options)
    return kernels.gemv(x, linear.weight, linear.bias, **options)


def _gemv_into_stream(module, x: torch.Tensor, stream: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """stream + x W^T (+ b) [T, H]: the o or down projection's output added into the residual stream.
    On a tensor-parallel rank each rank's partial sum is all-reduced, and only rank 0 adds the stream
    (and holds the bias) in its epilogue, so both are counted once in the sum."""
    linear, group = _local_linear(module), getattr(module, "group", None)
    if group is None:
        return _skinny_matmul(linear, x, gated=gated, residual=stream)
    partial = _skinny_matmul(linear, x, gated=gated, residual=stream if group.is_driver else None)
    return group.all_reduce(partial)


def _add_rms_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed [T, H], residual [T, H]). With no residual yet, `hidden` becomes the residual stream;
    otherwise `residual += hidden` in place and the normed rows are written over `hidden`."""
    if residual is None:
        return kernels.rms_norm(hidden, norm.weight, norm.eps), hidden
    return kernels.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps), residual
