"""What the front end may know about the engine: plain data, no live objects.

The servicer reads the engine through these (and `AsyncEngine`'s methods) only, so the engine core can
move behind a socket (the process split) without the servicer changing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_service.engine.generation_config import GenerationDefaults
from inference_service.model.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model: names, family and where it runs."""

    name: str  # the served name (`--served-model-name`, else the model's own)
    family: str  # config model_type: llama, qwen2, bert, ...
    architecture: str
    vocab_size: int
    model_path: str
    dtype: str  # torch dtype without the prefix: bfloat16, float32, ...
    device: str
    quantization: str = "none"  # "none", "gptq", "awq", "compressed-tensors", "fp8", "gguf", "in-situ int4", ...
    quantization_bits: int = 16  # bits of the quantized projections' weights (16: none)
    weight_bytes: int = 0  # device memory of the weights

    @classmethod
    def of(cls, loaded: LoadedModel, served_name: str | None, device: torch.device, dtype: torch.dtype) -> ModelInfo:
        cfg = loaded.config
        return cls(name=served_name or loaded.model_name, family=cfg.model_type, architecture=cfg.architecture,
                   vocab_size=cfg.vocab_size, model_path=loaded.model_path,
                   dtype=str(dtype).removeprefix("torch."), device=str(device),
                   **({} if loaded.quantization is None else {
                       "quantization": loaded.quantization.quantization,
                       "quantization_bits": loaded.quantization.bits,
                       "weight_bytes": loaded.quantization.weight_bytes}))


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The generation engine's fixed sizes and limits, as built (after defaults and the memory budget)."""

    model: ModelInfo
    max_model_len: int  # context window: prompt + output
    max_seq_tokens: int  # the most tokens one sequence may hold in the KV cache
    block_size: int  # tokens a KV-cache block holds
    num_blocks: int  # KV-cache blocks
    enable_prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    is_async_scheduling: bool
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority"
    # Values of the sampling fields a request leaves unset (generation_config.json and overrides).
    generation_defaults: GenerationDefaults = GenerationDefaults()


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's queues and cache at one moment."""

    num_waiting: int  # sequences waiting to be admitted (new or preempted)
    num_running: int
    num_free_blocks: int
    num_blocks: int

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0
