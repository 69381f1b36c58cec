"""Loading one tensor-parallel rank's shard of a model: its config, its slices, its wrapped modules."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from inference_service.attention.backend import get_attention_backend
from inference_service.distributed.group import TensorParallelGroup
from inference_service.distributed.sharding import ShardPlan
from inference_service.errors import UnsupportedModelError
from inference_service.model import loader
from inference_service.model.config import ModelConfig, with_yarn_scaling
from inference_service.model.decoder import DecoderModel
from inference_service.model.parallel_linear import parallelize
from inference_service.model.quant.config import QuantSpec
from inference_service.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ShardSource:
    """A checkpoint opened for sharded reading: nothing but headers and metadata read yet.
    `shard_weights(plan, device, packed)` iterates the plan's slices; None: dummy weights."""

    config: ModelConfig
    tokenizer_factory: Callable[[], Tokenizer]
    name: str
    shard_weights: Callable[[ShardPlan, torch.device, bool], Iterable[tuple[str, object]]] | None
    quant_spec: QuantSpec | None = None  # a quantized checkpoint's: its layers come packed (`quant_shards.py`)
    is_gguf: bool = False  # `shard_weights(..., packed=True)` keeps its projections' blocks (`gguf_shards.py`)


def open_shard_source(path: str | None, load_format: str, dtype: torch.dtype,
                      yarn_scaling_factor: float | None = None) -> ShardSource:
    """A safetensors folder, a GGUF file, or a folder's config.json with `load_format="dummy"`."""
    if not path or not os.path.exists(path):
        raise UnsupportedModelError(f"tensor parallelism needs --model naming a safetensors folder or a .gguf file; "
                                    f"{path!r} does not exist")
    if os.path.isdir(path) and loader._is_bert_dir(path):
        raise UnsupportedModelError("tensor parallelism serves decoders; this folder holds an encoder (BERT)")
    if load_format == "dummy":
        from inference_service.model.dummy import byte_tokenizer, read_dummy_config

        config = read_dummy_config(path)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        has_tokenizer = os.path.isfile(os.path.join(folder, "tokenizer.json"))
        source = ShardSource(config, (lambda: Tokenizer.from_hf_dir(folder)) if has_tokenizer else
                             (lambda: byte_tokenizer(config.vocab_size)),
                             os.path.basename(os.path.normpath(folder)) + "-dummy", None)
    elif os.path.isdir(path):
        from inference_service.distributed.shard_reader import ShardedSafetensors

        # Checks the dtypes and the quantization config; reads no tensor.
        config, _, tokenizer, name, quant_spec = loader._open_hf_dir(path, dtype, "cpu", None)
        files = loader._safetensors_files(path)
        if quant_spec is None:
            source = ShardSource(config, lambda: tokenizer, name,
                                 lambda plan, device, packed: ShardedSafetensors(files, plan, dtype,
                                                                                 loader._IGNORED_TENSOR_SUFFIXES))
        else:
            source = ShardSource(config, lambda: tokenizer, name, _quantized_shards(files, quant_spec, dtype),
                                 quant_spec=quant_spec)
    elif path.endswith(".gguf"):
        from inference_service.distributed.gguf_shards import ShardedGGUF
        from inference_service.model.gguf_loader import GGUFCheckpoint

        checkpoint = GGUFCheckpoint(path)
        name = re.sub(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", "", os.path.basename(path)[: -len(".gguf")],
                      flags=re.IGNORECASE)
        source = ShardSource(checkpoint.config, lambda: Tokenizer.from_gguf_metadata(checkpoint.metadata), name,
                             lambda plan, device, packed: ShardedGGUF(checkpoint, plan, dtype, packed),
                             is_gguf=True)
    else:
        raise UnsupportedModelError(f"model path {path!r} is neither a .gguf file nor a folder")
    if yarn_scaling_factor:
        source.config = with_yarn_scaling(source.config, yarn_scaling_factor)
    return source


def load_model_shard(path: str | None, group: TensorParallelGroup, *, device: torch.device, dtype: torch.dtype,
                     load_format: str = "auto", attention_backend: str = "auto", seed: int = 0,
                     yarn_scaling_factor: float | None = None, quantization: str | None = None,
                     quantized_weights: bool = True) -> loader.LoadedModel:
    """This rank's part of the model at `path` (see `open_shard_source`). `LoadedModel.config` is the
    whole model's; `LoadedModel.model.config` the rank's (its heads, MLP and vocabulary rows). Each
    rank reads only its slices of the files. `quantization` (fp8, int8, int4) quantizes the rank's
    16-bit slices in situ as they load: each rank scales its own slice (a row-parallel projection's
    per-channel scales span its half of the inputs). A GGUF's projections stay in their blocks where the
    quantized kernels run (CUDA), as a single-process load keeps them, unless `quantized_weights` is False
    (`--dequantize`)."""
    from inference_service.model import quantization as quant  # here, not at the top: it imports Triton

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedModelError(f"unsupported model dtype {dtype}")
    quant.check_in_situ(quantization)
    source = open_shard_source(path, load_format, dtype, yarn_scaling_factor)
    if source.quant_spec is not None and quantization:
        raise UnsupportedModelError(f"--quantization {quantization}: the checkpoint is quantized already "
                                    f"({quant.spec_label(source.quant_spec)}); leave --quantization out")
    plan = ShardPlan(source.config, group.rank, group.world_size)
    is_dummy = source.shard_weights is None
    gguf_packed = source.is_gguf and quantization is None and quantized_weights and quant.runs_packed(device)
    linear_cls = None
    if quantization and is_dummy:
        from inference_service.model.fused_stack import GemvLinear  # plain [out, in] weights, re-quantized below

        linear_cls = GemvLinear
    elif quantization or source.quant_spec is not None or gguf_packed:
        linear_cls = quant.QuantizedLinear
    model = DecoderModel(plan.local_config(), device=device, dtype=dtype,
                         attention_backend=get_attention_backend(device, attention_backend), linear_cls=linear_cls)
    if is_dummy:
        from inference_service.model.dummy import init_dummy_weights

        init_dummy_weights(model, seed + group.rank)
        model.finish_loading()
        if quantization:
            model = quant.quantize_loaded_model(model, quantization)
    else:
        weights = source.shard_weights(plan, device, gguf_packed)
        model.load_weights(quant.in_situ_weights(weights, quantization, device) if quantization else weights)
    label = (quant.spec_label(source.quant_spec) if source.quant_spec is not None
             else f"in-situ {quantization}" if quantization else "gguf" if gguf_packed else "none")
    summary = quant.summarize_model(model, label)  # this rank's shard
    logger.info("rank %d: %s", group.rank, summary.log_line())
    parallelize(model, group, plan)
    pooling = loader._decoder_pooling(path) if os.path.isdir(path) else None
    return loader.LoadedModel(config=source.config, model=model, tokenizer=source.tokenizer_factory(),
                              model_path=os.path.abspath(path), model_name=source.name, pooling=pooling,
                              quantization=summary)


def _quantized_shards(files: list[str], spec: QuantSpec, dtype: torch.dtype):
    """`shard_weights` of a quantized checkpoint: the plan's part of every tensor, each layer packed on the device."""

    def shard_weights(plan: ShardPlan, device: torch.device, packed: bool):
        from inference_service.distributed.quant_shards import QuantizedShardReader
        from inference_service.model.quant.loading import quantized_safetensors_weights

        reader = QuantizedShardReader(plan, spec, dtype)
        return quantized_safetensors_weights(files, spec, dtype, device, read_plain=reader.read_plain,
                                             read_layer=reader.read_layer)

    return shard_weights
