"""Loading one tensor-parallel rank's shard of a model: its config, its slices, its wrapped modules."""

from __future__ import annotations

import os

import torch

from inference_service.attention.backend import get_attention_backend
from inference_service.distributed.group import TensorParallelGroup
from inference_service.distributed.shard_reader import ShardedSafetensors
from inference_service.distributed.sharding import ShardPlan
from inference_service.errors import UnsupportedModelError
from inference_service.model import loader
from inference_service.model.config import ModelConfig, with_yarn_scaling
from inference_service.model.decoder import DecoderModel
from inference_service.model.parallel_linear import parallelize


def read_full_config(path: str | None, load_format: str, yarn_scaling_factor: float | None) -> ModelConfig:
    """The whole model's config from a folder's config.json (reads no tensor)."""
    if not path or not os.path.isdir(path):
        raise UnsupportedModelError(f"tensor parallelism loads a Hugging Face safetensors folder (or a config.json "
                                    f"with --load-format dummy); {path!r} is not a folder (GGUF is not sharded yet)")
    if loader._is_bert_dir(path):
        raise UnsupportedModelError("tensor parallelism serves decoders; this folder holds an encoder (BERT)")
    from inference_service.model.dummy import read_dummy_config

    config = read_dummy_config(path)
    return with_yarn_scaling(config, yarn_scaling_factor) if yarn_scaling_factor else config


def load_model_shard(path: str | None, group: TensorParallelGroup, *, device: torch.device, dtype: torch.dtype,
                     load_format: str = "auto", attention_backend: str = "auto", seed: int = 0,
                     yarn_scaling_factor: float | None = None) -> loader.LoadedModel:
    """This rank's part of the model at `path` (a safetensors folder, or a config.json with
    `load_format="dummy"`). `LoadedModel.config` is the whole model's; `LoadedModel.model.config`
    the rank's (its heads, MLP and vocabulary rows). Each rank reads only its slices of the files."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedModelError(f"unsupported model dtype {dtype}")
    config = read_full_config(path, load_format, yarn_scaling_factor)
    if load_format == "dummy":
        from inference_service.model.dummy import byte_tokenizer, init_dummy_weights

        name = os.path.basename(os.path.normpath(path)) + "-dummy"
        has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))
        tokenizer = loader.Tokenizer.from_hf_dir(path) if has_tokenizer else byte_tokenizer(config.vocab_size)
        files = None
    else:
        _, _, tokenizer, name = loader._open_hf_dir(path, dtype)  # checks the dtypes; reads no tensor
        files = loader._safetensors_files(path)
    plan = ShardPlan(config, group.rank, group.world_size)
    model = DecoderModel(plan.local_config(), device=device, dtype=dtype,
                         attention_backend=get_attention_backend(device, attention_backend))
    if files is None:
        init_dummy_weights(model, seed + group.rank)
        model.finish_loading()
    else:
        model.load_weights(ShardedSafetensors(files, plan, dtype, loader._IGNORED_TENSOR_SUFFIXES))
    parallelize(model, group, plan)
    return loader.LoadedModel(config=config, model=model, tokenizer=tokenizer, model_path=os.path.abspath(path),
                              model_name=name, pooling=loader._decoder_pooling(path))
