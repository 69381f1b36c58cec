"""Tiny quantized Llama checkpoints written in each format's documented layout, and their dequantized twins.

`write_quantized(fmt, folder)` quantizes a tiny random Llama's decoder projections (round to nearest;
the numbers need not be good, only stored as the format stores them) and writes two folders: the
quantized checkpoint (config.json with its `quantization_config`) and the twin, a plain float32
checkpoint whose projections are exactly the quantized weights dequantized. Layouts as in
`inference_service/model/quant/checkpoint.py`'s docstring (GPTQ, AWQ GEMM, compressed-tensors, fp8).
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import torch
from safetensors.torch import save_file

from tests.model.tiny_models import make_hf_model, save_hf_model

# hidden 128, intermediate 256: K is 128 or 256, so groups of 32..128 fit; head_dim 64 (the GPU attention
# kernels' smallest, for bench/gpu_quant.py's twins section).
TINY_LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] codes 0..15 -> [...] int32 words, nibble i at bits 4i (two's complement above 2^31)."""
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (nibbles.to(torch.int64) << shifts).sum(-1)
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def gptq(w: torch.Tensor, group: int | None, desc_act: bool, seed: int):
    """GPTQ v1 (stored zero - 1), symmetric, fp16 scales; desc_act: a random group for each input row,
    drawn from `seed` (projections of one input, q/k/v or gate/up, share it, as GPTQ's Hessian order)."""
    n, k = w.shape
    g = group or k
    if desc_act:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))] = (torch.arange(k) // g).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // g).to(torch.int32)
    amax = torch.stack([w[:, g_idx == group].abs().amax(1) for group in range(k // g)])  # [K/G, N]
    scales = (amax / 7).clamp(min=1e-4).to(torch.float16)  # [K/G, N]
    s = scales.float()[g_idx.long()]  # [K, N]
    q = (torch.round(w.T / s) + 8).clamp(0, 15)  # [K, N]
    tensors = {"qweight": _words(q.view(k // 8, 8, n).transpose(1, 2)),  # [K/8, N]
               "qzeros": _words(torch.full((k // g, n // 8, 8), 7)),
               "scales": scales, "g_idx": g_idx}
    return tensors, (s * (q - 8)).T.contiguous()


def awq(w: torch.Tensor, group: int):
    """AWQ GEMM: asymmetric with zero points, fp16 scales, columns in AWQ's nibble order."""
    n, k = w.shape
    groups = w.T.reshape(k // group, group, n)
    lo, hi = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).to(torch.float16)  # [K/G, N]
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)  # [K/G, N]
    s, z = scales.float().repeat_interleave(group, 0), zeros.repeat_interleave(group, 0)  # [K, N]
    q = (torch.round(w.T / s) + z).clamp(0, 15)

    def pack(cols: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        return _words(cols.view(cols.shape[0], n // 8, 8)[:, :, list(AWQ_ORDER)])

    tensors = {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales}
    return tensors, (s * (q - z)).T.contiguous()


def ct_int4(w: torch.Tensor, group: int):
    """compressed-tensors pack-quantized w4a16: symmetric, stored q + 8, nibble i of word c = column 8c + i."""
    n, k = w.shape
    scale = (w.view(n, k // group, group).abs().amax(-1) / 7).clamp(min=1e-4).to(torch.float16)  # [N, K/G]
    s = scale.float().repeat_interleave(group, 1)
    q = torch.round(w / s).clamp(-8, 7)
    tensors = {"weight_packed": _words((q + 8).view(n, k // 8, 8)), "weight_scale": scale,
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    return tensors, s * q


def fp8(w: torch.Tensor, block: tuple[int, int] | None, scale_name: str):
    """e4m3 with one float32 multiplier per output channel ([N, 1]) or per block."""
    n, k = w.shape
    bn, bk = block or (1, k)
    tiles = w.view(n // bn, bn, k // bk, bk)
    scale = (tiles.abs().amax((1, 3)) / 448).clamp(min=1e-8)  # [N/bn, K/bk]
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, scale_name: scale}, q.float() * full


FORMATS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False},
    "gptq-desc-act": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True},
    "gptq-channel": {"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True, "desc_act": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "ct-w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                     "type": "int", "num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 64}}}},
    "ct-fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "type": "float", "num_bits": 8, "symmetric": True, "strategy": "channel"}}}},
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [64, 64]},
}


def quantize(fmt: str, w: torch.Tensor, seed: int):
    cfg = FORMATS[fmt]
    if fmt.startswith("gptq"):
        return gptq(w, None if cfg["group_size"] == -1 else cfg["group_size"], cfg["desc_act"], seed)
    if fmt == "awq":
        return awq(w, cfg["group_size"])
    if fmt == "ct-w4a16":
        return ct_int4(w, 64)
    if fmt == "ct-fp8":
        return fp8(w, None, "weight_scale")
    return fp8(w, (64, 64), "weight_scale_inv")


def write_quantized(fmt: str, folder: str, seed: int = 0, attention_bias: bool = False) -> tuple[str, str]:
    """(quantized checkpoint folder, dequantized float32 twin folder) of one tiny Llama; with
    `attention_bias`, q/k/v/o biases of random values (plain tensors beside the packed weights)."""
    model = make_hf_model("llama", seed=seed, **TINY_LLAMA, attention_bias=attention_bias)
    if attention_bias:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    quantized: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in list(state):
            prefix, _, kind = name.rpartition(".")
            if kind != "weight" or prefix.rpartition(".")[2] not in PROJECTIONS:
                quantized[name] = state[name]
                continue
            # One act-order per input: the module (self_attn, mlp) and K.
            tensors, dequantized = quantize(fmt, state[name], zlib.crc32(f"{prefix.rpartition('.')[0]} {state[name].shape[1]}".encode()))
            quantized.update({f"{prefix}.{suffix}": t.contiguous() for suffix, t in tensors.items()})
            model.get_parameter(name).copy_(dequantized)
    twin = save_hf_model(model, os.path.join(folder, "twin"))
    packed = save_hf_model(model, os.path.join(folder, fmt))
    os.remove(os.path.join(packed, "model.safetensors"))
    save_file(quantized, os.path.join(packed, "model.safetensors"))
    set_quantization_config(packed, FORMATS[fmt])
    return packed, twin


def set_quantization_config(folder: str, quantization_config: dict | None) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    if quantization_config is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)
