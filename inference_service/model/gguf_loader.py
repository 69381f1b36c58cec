"""Reading GGUF files: metadata, and tensors under Hugging Face names, dequantized to float or kept in
their blocks (`QuantizedWeight`) for the CPU kernels that execute them in place."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from inference_service.cpu_kernels.quant import QuantizedWeight, QuantType
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts (Qwen3-MoE, Mixtral): the router and every expert's rows stacked [E, rows, cols].
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp's per-frequency rope divisors: part of the config here, not a weight.
ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF parameter name; `UnsupportedModelError` for tensors we have no use for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    raise UnsupportedModelError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for llama-architecture models.

    llama.cpp's converter reorders each head's rows from HF's "halves" RoPE layout (first half of the
    head, then second half) to interleaved pairs (row 2i from the first half, 2i+1 from the second),
    matching its own RoPE kernel. Our RoPE is HF's, so the rows go back: within each head, view the
    rows as [head_dim // 2, 2] and transpose to [2, head_dim // 2]."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def open_gguf_reader(path: str):
    """`gguf.GGUFReader(path)`, reading through a plain array view of the file's mapping
    (`plain_array_reader_class`)."""
    return plain_array_reader_class()(path)


@functools.cache
def plain_array_reader_class() -> type:
    """A `gguf.GGUFReader` that reads through a plain array view of the file's mapping.

    NOTE: the reader slices its `np.memmap` once or twice per metadata value, and a memmap's slicing runs in
    Python (`memmap.__getitem__`, `__array_finalize__`): the embedded SmolLM2's ~100k vocabulary strings took
    5.1 s to read, 1.6 s through an `ndarray` view of the same mapping (read-only as before). Built on first use:
    `gguf` is imported only where a GGUF file is read."""
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain_data = np.asarray(mapped)  # a base-class view; it keeps the mapping alive

    return PlainArrayReader


class GGUFCheckpoint:
    """An open GGUF file: `metadata` (key -> Python value), `config`, and `weights()`."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._reader = open_gguf_reader(path)
        except Exception as exc:  # the gguf package raises bare ValueErrors for bad magic etc.
            raise UnsupportedModelError(f"cannot read GGUF file {path!r}: {exc}") from exc
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        self.architecture: str = self.metadata.get("general.architecture", "")
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        for tensor in self._reader.tensors:
            if tensor.tensor_type.name not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; "
                    f"supported: {', '.join(SUPPORTED_TYPES)}")
        freq_factors = None
        if ROPE_FREQS in self._tensors:
            freq_factors = self._dequantize(self._tensors[ROPE_FREQS]).reshape(-1).tolist()
        self.config = ModelConfig.from_gguf_metadata(self.metadata, set(self._tensors), freq_factors)

    @property
    def model_name(self) -> str | None:
        return self.metadata.get("general.name")

    def weights(self, dtype: torch.dtype = torch.float32, *, keep_quantized: bool = False,
                gpu_packed: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield (HF name, tensor in `dtype`) one at a time, so memory stays one tensor deep.

        With `keep_quantized`, matrices of the types the CPU kernels execute (`QuantType`) come as
        `QuantizedWeight`s in their blocks instead of dequantized. With `gpu_packed`, decoder-block
        projections of the types the GPU kernels run (`GGUF_PACKED_TYPES`) come repacked
        (`IntPackedWeight`, CPU memory); other types are dequantized, and logged once per type."""
        if gpu_packed:
            yield from self._gpu_packed_weights(dtype)
            return
        config = self.config
        permuted = self.architecture == "llama"
        for name, tensor in self._tensors.items():
            if name == ROPE_FREQS:
                continue
            hf_name = hf_tensor_name(name)
            num_heads = None
            if permuted and ".self_attn.q_proj." in hf_name:
                num_heads = config.num_attention_heads
            elif permuted and ".self_attn.k_proj." in hf_name:
                num_heads = config.num_key_value_heads
            kind = tensor.tensor_type.name
            if keep_quantized and kind in QuantType.__members__ and len(tensor.shape) == 2:
                rows = int(tensor.shape[1])
                weight = QuantizedWeight.from_gguf_blocks(np.asarray(tensor.data).reshape(rows, -1), QuantType[kind])
                if num_heads is not None:
                    weight = weight.select_rows(unpermute_rope_rows(np.arange(rows), num_heads))
                yield hf_name, weight
                continue
            array = self._dequantize(tensor)
            if num_heads is not None:
                array = unpermute_rope_rows(array, num_heads)
            if not array.flags.writeable:  # F32 tensors are views of the read-only file mapping
                array = array.copy()
            yield hf_name, torch.from_numpy(np.ascontiguousarray(array)).to(dtype)

    def _gpu_packed_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
        from inference_service.model.quant.gguf_types import (
            GGUF_PACKED_TYPES,
            repack_reader_tensor,
        )
        from inference_service.model.quant.loading import IN_SITU_PROJECTIONS
        from inference_service.model.quant.rows import select_rows

        packed = {name: tensor for name, tensor in self._tensors.items()
                  if tensor.tensor_type.name in GGUF_PACKED_TYPES and len(tensor.shape) == 2
                  and hf_tensor_name(name).split(".")[-2] in IN_SITU_PROJECTIONS}
        expanded = sorted({t.tensor_type.name for n, t in self._tensors.items() if n not in packed and len(t.shape) == 2
                           and hf_tensor_name(n).split(".")[-2] in IN_SITU_PROJECTIONS
                           and t.tensor_type.name not in ("F32", "F16", "BF16")})
        if expanded:
            logger.info("GGUF types %s have no GPU kernel: their projections are dequantized to %s at load",
                        ", ".join(expanded), dtype)
        for name, tensor in self._tensors.items():
            if name == ROPE_FREQS:
                continue
            hf_name = hf_tensor_name(name)
            num_heads = self._rope_heads(hf_name)
            if name in packed:
                weight = repack_reader_tensor(tensor)
                if num_heads is not None:
                    weight = select_rows(weight, unpermute_rope_rows(np.arange(weight.shape[0]), num_heads))
                yield hf_name, weight
                continue
            array = self._dequantize(tensor)
            if num_heads is not None:
                array = unpermute_rope_rows(array, num_heads)
            yield hf_name, torch.from_numpy(np.array(array)).to(dtype)  # a copy: F32 tensors map the file

    def _rope_heads(self, hf_name: str) -> int | None:
        if self.architecture != "llama":
            return None
        if ".self_attn.q_proj." in hf_name:
            return self.config.num_attention_heads
        if ".self_attn.k_proj." in hf_name:
            return self.config.num_key_value_heads
        return None

    @staticmethod
    def _dequantize(tensor) -> np.ndarray:
        import gguf

        kind = tensor.tensor_type.name
        if kind == "F32":
            array = np.asarray(tensor.data, dtype=np.float32)
        elif kind == "F16":
            array = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
        else:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy (and torch) want them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return array.reshape(shape)
