"""One quantized linear layer of a safetensors checkpoint -> the packed form the kernels take.

Documented layouts (all [out N, in K] layers; int32 words hold 8 nibbles, nibble i at bits 4i):

- GPTQ: `qweight` [K/8, N] (nibble i of word r: input row 8r + i), `qzeros` [K/G, N/8] (nibble i of word
  c: column 8c + i; v1 stores zero - 1), `scales` [K/G, N], `g_idx` [K] (desc_act: the group of each
  input row). w = scales[g] * (q - zero).
- AWQ (GEMM): `qweight` [K, N/8] and `qzeros` [K/G, N/8], nibble i of word c holding column
  8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; `scales` [K/G, N]. w = scales * (q - zero).
- compressed-tensors pack-quantized: `weight_packed` [N, K*bits/32] (4 bits: nibble i of word c is
  column 8c + i, stored q + 8; 8 bits: byte i of word c is column 4c + i, stored q + 128),
  `weight_scale` [N, K/G], `weight_shape` [2]. w = weight_scale * q.
- fp8: `weight` e4m3 [N, K] and `weight_scale` (per tensor / channel) or `weight_scale_inv`
  ([ceil(N/bn), ceil(K/bk)], a multiplier despite the name).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from inference_service.model.quant.config import (
    QuantizationConfigError,
    QuantMethod,
    QuantSpec,
)
from kernels import FP8_DTYPE
from kernels.fp8_gemm import Fp8Weight
from kernels.quant_layout import IntPackedWeight, pack_int

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
_SHIFTS = torch.arange(8, dtype=torch.int32) * 4


def unpack_int32_nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles each (nibble i at bits 4i), expanding `dim` 8x; int32 0..15."""
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0x0F  # [..., 8]
    if dim in (0, -words.dim()):
        return nibbles.movedim(-1, 1).reshape(words.shape[0] * 8, *words.shape[1:])
    return nibbles.reshape(*words.shape[:-1], words.shape[-1] * 8)


def pack_checkpoint_linear(spec: QuantSpec, prefix: str, tensors: Mapping[str, torch.Tensor]
                           ) -> IntPackedWeight | Fp8Weight:
    """The layer `prefix` (e.g. "model.layers.0.mlp.down_proj") from its checkpoint tensors, keyed by
    suffix ("qweight", "scales", ...); a missing or misshapen tensor is a `QuantizationConfigError`."""

    def get(suffix: str, optional: bool = False) -> torch.Tensor | None:
        if suffix not in tensors:
            if optional:
                return None
            raise QuantizationConfigError(f"{prefix}.{suffix}", "missing from the checkpoint")
        return tensors[suffix]

    match spec.method:
        case QuantMethod.GPTQ:
            return _gptq(spec, prefix, get("qweight"), get("qzeros"), get("scales"), get("g_idx", True))
        case QuantMethod.AWQ:
            return _awq(spec, prefix, get("qweight"), get("qzeros"), get("scales"))
        case QuantMethod.PACKED_INT:
            return _packed_int(spec, prefix, get("weight_packed"), get("weight_scale"), get("weight_shape", True))
        case QuantMethod.FP8:
            return _fp8(spec, prefix, get("weight"), get(spec.fp8_scale_name))
    raise AssertionError(spec.method)


def _expect(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise QuantizationConfigError(name, message)


def _int_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
                perm: torch.Tensor | None = None) -> IntPackedWeight:
    """Codes [N, K], scales / zeros [N, K/G]: zeros that are one value everywhere (symmetric
    checkpoints) become the constant `zero`, so the kernels read no zeros plane. Scales keep their
    dtype (an fp32 scale rounded to fp16 would change the numbers)."""
    scales = scales.contiguous()
    if zeros is not None and bool((zeros == zeros.flatten()[0]).all()) and 0 <= int(zeros.flatten()[0]) < 16:
        return pack_int(codes, 4, group, scales, zero=int(zeros.flatten()[0]), perm=perm)
    return pack_int(codes, 4, group, scales, zeros=zeros, perm=perm)


def _gptq(spec: QuantSpec, prefix: str, qweight, qzeros, scales, g_idx) -> IntPackedWeight:
    _expect(qweight.dtype == torch.int32 and qweight.dim() == 2, f"{prefix}.qweight", f"expected int32 [K/8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = spec.group_size or k
    _expect(k % group == 0, f"{prefix}.qweight", f"K={k} is not a multiple of group_size {group}")
    _expect(tuple(scales.shape) == (k // group, n), f"{prefix}.scales", f"expected [{k // group}, {n}], got {tuple(scales.shape)}")
    _expect(tuple(qzeros.shape) == (k // group, n // 8) and qzeros.dtype == torch.int32, f"{prefix}.qzeros",
            f"expected int32 [{k // group}, {n // 8}], got {qzeros.dtype} {tuple(qzeros.shape)}")
    codes = unpack_int32_nibbles(qweight, 0).T  # [N, K]
    zeros = (unpack_int32_nibbles(qzeros, 1) + spec.zero_offset).T  # [N, K/G]
    perm = None
    if g_idx is not None:
        _expect(tuple(g_idx.shape) == (k,), f"{prefix}.g_idx", f"expected [{k}], got {tuple(g_idx.shape)}")
        in_order = torch.arange(k, device=g_idx.device) // group
        if not torch.equal(g_idx.long(), in_order):
            # act-order: sort input rows by group so every group is contiguous; x is gathered by perm
            perm = torch.argsort(g_idx.long(), stable=True)
            _expect(torch.equal(g_idx.long()[perm], in_order), f"{prefix}.g_idx",
                    f"every group must hold exactly group_size={group} input rows")
            codes = codes[:, perm]
    return _int_weight(codes, scales.T, zeros, group, perm)


def _awq(spec: QuantSpec, prefix: str, qweight, qzeros, scales) -> IntPackedWeight:
    _expect(qweight.dtype == torch.int32 and qweight.dim() == 2, f"{prefix}.qweight", f"expected int32 [K, N/8], got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = spec.group_size or k
    _expect(k % group == 0, f"{prefix}.qweight", f"K={k} is not a multiple of group_size {group}")
    _expect(tuple(scales.shape) == (k // group, n), f"{prefix}.scales", f"expected [{k // group}, {n}], got {tuple(scales.shape)}")
    _expect(tuple(qzeros.shape) == (k // group, n // 8) and qzeros.dtype == torch.int32, f"{prefix}.qzeros",
            f"expected int32 [{k // group}, {n // 8}], got {qzeros.dtype} {tuple(qzeros.shape)}")

    def columns(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] words -> [R, N] in column order
        nibbles = unpack_int32_nibbles(words, 1).view(words.shape[0], -1, 8)
        out = torch.empty_like(nibbles)
        out[:, :, list(AWQ_ORDER)] = nibbles
        return out.reshape(words.shape[0], -1)

    return _int_weight(columns(qweight).T, scales.T, columns(qzeros).T, group)


def _packed_int(spec: QuantSpec, prefix: str, packed, scale, shape) -> IntPackedWeight:
    per_word = 32 // spec.bits
    _expect(packed.dtype == torch.int32 and packed.dim() == 2, f"{prefix}.weight_packed",
            f"expected int32 [N, K/{per_word}], got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * per_word
    if shape is not None:
        _expect(tuple(int(v) for v in shape.flatten()) == (n, k), f"{prefix}.weight_shape",
                f"{shape.tolist()} does not match weight_packed's [{n}, {k}]")
    group = spec.group_size or k
    _expect(k % group == 0, f"{prefix}.weight_packed", f"K={k} is not a multiple of group_size {group}")
    _expect(tuple(scale.shape) == (n, k // group), f"{prefix}.weight_scale", f"expected [{n}, {k // group}], got {tuple(scale.shape)}")
    scale = scale.contiguous()
    if spec.bits == 8:  # byte i (bits 8i) of word c is column 4c + i
        shifts = torch.arange(4, dtype=torch.int32, device=packed.device) * 8
        codes = ((packed.unsqueeze(-1) >> shifts) & 0xFF).reshape(n, k)
        return pack_int(codes, 8, group, scale, zero=128)
    return pack_int(unpack_int32_nibbles(packed, 1), 4, group, scale, zero=8)


def _fp8(spec: QuantSpec, prefix: str, weight, scale) -> Fp8Weight:
    scale_name = f"{prefix}.{spec.fp8_scale_name}"
    _expect(weight.dtype == FP8_DTYPE and weight.dim() == 2, f"{prefix}.weight",
            f"expected {FP8_DTYPE} [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    scale = scale.to(torch.float32)
    if spec.fp8_block is not None:
        bn, bk = spec.fp8_block
        expected = (-(-n // bn), -(-k // bk))
        _expect(tuple(scale.shape) == expected, scale_name, f"expected {list(expected)} for blocks {list(spec.fp8_block)}, got {list(scale.shape)}")
        return Fp8Weight(weight, scale.contiguous(), bn, bk)
    if scale.numel() == 1:
        return Fp8Weight(weight, scale.reshape(1, 1), n, k)
    _expect(spec.fp8_per_tensor is False and scale.numel() == n, scale_name,
            f"expected one scale per output channel ({n}) or one in all, got {list(scale.shape)}")
    return Fp8Weight(weight, scale.reshape(n, 1).contiguous(), 1, k)
