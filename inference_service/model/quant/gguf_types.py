"""GGUF Q-type tensors repacked at load into the kernels' integer layout (`IntPackedWeight`).

| type | codes | group | scales | zero | offsets |
|---|---|---|---|---|---|
| Q4_0 | 4-bit | 32 | d (fp16) | 8 | - |
| Q4_1 | 4-bit | 32 | d (fp16) | 0 | m (fp16) |
| Q8_0 | 8-bit (int8 + 128) | 32 | d (fp16) | 128 | - |
| Q4_K | 4-bit | 32 | d * sc (fp32) | 0 | -dmin * m (fp32) |
| Q5_K | 5-bit, one a byte | 32 | d * sc (fp32) | 0 | -dmin * m (fp32) |
| Q6_K | 6-bit, one a byte | 16 | d * sc (fp32) | 32 | - |

The products are formed in fp32 as the `gguf` package forms them, so `dequantize_int` of the result is
bit-exact with `gguf.quants.dequantize`. Q5_K and Q6_K codes are held one a byte (the layout's 8-bit
codes), not in 4-bit planes plus high bits: gathering the high bits took the decode GEMV ~9x the time
(an H200, Llama-3-8B's projections at one row: Q6_K 33.2 -> 3.57 ms, Q5_K 32.6 -> 3.52; 1.25x the
memory of the 6-bit form, bench/results/h200-2026-11-29b). The block byte layouts are the `gguf`
package's (and, for Q4_0/Q4_1/Q8_0, the CPU kernels' `QuantizedWeight.from_gguf_blocks`): the K-quants'
codes are read by dequantizing a copy of the blocks whose scales are set to 1 and mins to 0, which yields
the codes exactly, so no bit layout is written twice.
"""

from __future__ import annotations

import numpy as np
import torch

from inference_service.cpu_kernels.quant import QuantizedWeight, QuantType
from kernels.quant_layout import IntPackedWeight, pack_int

GGUF_PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_SUPER = 256  # elements of a K-quant super-block
_K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_FP16_ONE = np.array([1.0], dtype=np.float16).view(np.uint8)
# get_scale_min's 12 bytes with every 6-bit scale 1 and every min 0
_UNIT_SCALES_MINS = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)


def repack_gguf(blocks: np.ndarray, type_name: str) -> IntPackedWeight:
    """`blocks` [rows, row_bytes] uint8, a GGUF tensor's raw data row by row -> the packed layout."""
    if type_name not in GGUF_PACKED_TYPES:
        raise ValueError(f"GGUF type {type_name} is not kept packed; packed: {', '.join(GGUF_PACKED_TYPES)}")
    if type_name in QuantType.__members__:
        return _repack_simple(QuantizedWeight.from_gguf_blocks(blocks, QuantType[type_name]))
    return _repack_k_quant(np.ascontiguousarray(blocks), type_name)


def _repack_simple(w: QuantizedWeight) -> IntPackedWeight:
    if w.qtype is QuantType.Q8_0:  # int8 codes as unsigned: q + 128
        return IntPackedWeight(8, 32, (w.qs ^ 0x80).contiguous(), w.scales, zero=128)
    offsets = w.mins if w.qtype is QuantType.Q4_1 else None
    # Q4_0 / Q4_1 store byte j of a block as columns j (low) and j + 16 (high): the layout's own order
    return IntPackedWeight(4, 32, w.qs, w.scales, zero=8 if w.qtype is QuantType.Q4_0 else 0, offsets=offsets)


def _repack_k_quant(blocks: np.ndarray, type_name: str) -> IntPackedWeight:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    rows = blocks.shape[0]
    grouped = blocks.reshape(rows, -1, _K_BLOCK_BYTES[type_name])  # [R, super-blocks, bytes]
    flat = grouped.reshape(-1, grouped.shape[-1])
    unit = flat.copy()
    if type_name == "Q6_K":  # ql 128 | qh 64 | scales int8 16 | d fp16
        d = flat[:, 208:210].copy().view(np.float16).astype(np.float32)  # [B, 1]
        scales = d * flat[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
        unit[:, 192:208] = 1
        unit[:, 208:210] = _FP16_ONE
        codes = gguf.quants.dequantize(unit, qtype) + 32
        group, zero, offsets = 16, 32, None
    else:  # d fp16 | dmin fp16 | scales 12 | (Q5_K: qh 32) | qs 128
        d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = gguf.quants.Q4_K.get_scale_min(flat[:, 4:16].copy())
        scales = d * sc.astype(np.float32)  # [B, 8]
        offsets = -(dmin * m.astype(np.float32))
        unit[:, 0:2] = _FP16_ONE
        unit[:, 2:4] = 0
        unit[:, 4:16] = _UNIT_SCALES_MINS
        codes = gguf.quants.dequantize(unit, qtype)
        group, zero = 32, 0
    cols = grouped.shape[1] * _SUPER

    def plane(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1)))

    bits = 4 if type_name == "Q4_K" else 8  # Q5_K / Q6_K: one code a byte (module docstring)
    return pack_int(plane(codes.astype(np.int32)).view(rows, cols), bits, group, plane(scales), zero=zero,
                    offsets=None if offsets is None else plane(offsets))


def repack_reader_tensor(tensor) -> IntPackedWeight:
    """A `gguf.GGUFReader` tensor ([rows, cols] matrix of a packed type) -> the packed layout."""
    rows = int(tensor.shape[1])  # GGUF lists dims fastest-first
    return repack_gguf(np.asarray(tensor.data).reshape(rows, -1), tensor.tensor_type.name)
