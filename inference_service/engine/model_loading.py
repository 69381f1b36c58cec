"""One way from an `EngineConfig` to a model on its device: device, dtype and weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_service.config import EngineConfig
from inference_service.model.loader import LoadedModel, load_model


def resolve_device(name: str) -> torch.device:
    """`auto` is the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU and float32 on a CPU; `fp32`/`bf16`/`fp16` are aliases."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    name = aliases.get(name, name)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass(frozen=True, slots=True)
class ModelOnDevice:
    """A loaded model and the device and dtype it was loaded for."""

    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype


def load_model_for(config: EngineConfig) -> ModelOnDevice:
    """Loads `config.model` the way the engine serves it (device, dtype, format, quantization). With
    `tensor_parallel_size` > 1 this is rank 0's shard, the other ranks' processes started beside it
    (`distributed/workers.py`); the device is rank 0's."""
    if config.tensor_parallel_size > 1:
        from inference_service.distributed.workers import start_tensor_parallel, tensor_parallel_devices

        devices = tensor_parallel_devices(config.device, config.tensor_parallel_size)
        dtype = resolve_dtype(config.dtype, devices[0])
        return ModelOnDevice(start_tensor_parallel(config, devices, dtype), devices[0], dtype)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    loaded = load_model(config.model, device=device, dtype=dtype, yarn_scaling_factor=config.yarn_scaling_factor,
                        load_format=config.load_format, attention_backend=config.attention_backend,
                        seed=config.seed, quantized_weights=not config.dequantize,
                        quantization=config.quantization)
    return ModelOnDevice(loaded, device, dtype)
