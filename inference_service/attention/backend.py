"""The interface every attention backend implements (torch paged on CPU, Triton on GPU)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from inference_service.attention.metadata import AttentionMetadata


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged causal attention for one layer of one model step.

    `forward` first writes the step's new keys and values into the layer's cache at
    `metadata.slot_mapping` (rows whose slot is -1 are padding and are not written), then lets each
    sequence's queries attend causally over that sequence's whole context, found through
    `metadata.block_tables`: query j of a sequence with `query_len` new tokens and `seq_len` context
    tokens sits at position `seq_len - query_len + j` and sees keys 0..that position.

    Shapes: q [T, Hq, D], k and v [T, Hkv, D] with Hq a multiple of Hkv (grouped-query attention:
    query head h reads kv head h // (Hq // Hkv)); k_cache and v_cache
    [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D] in q's dtype. Rows of padding tokens
    (slot -1, outside every sequence's query range) come back unspecified.

    `sliding_window=W` lets query position i see keys i - W < j <= i only; `soft_cap=c` maps the
    scaled scores s to c * tanh(s / c) before masking and softmax (Gemma 2).
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor: ...


ATTENTION_BACKENDS = ("auto", "torch", "triton")


def get_attention_backend(device: torch.device | str, name: str = "auto") -> AttentionBackend:
    """The backend for a device: "auto" is Triton on CUDA and plain torch elsewhere; "torch" and
    "triton" force one ("triton" off CUDA needs TRITON_INTERPRET=1, for tests)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "triton":
        from inference_service.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention()
    from inference_service.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention()
