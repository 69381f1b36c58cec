"""vLLM's flag spellings, parsed into the same configs as ours (parse level: no model is loaded)."""

from __future__ import annotations

import pytest

from inference_service.cli import build_parser, configs_from_args


def configs(*flags: str):
    return configs_from_args(build_parser().parse_args(["serve", *flags]))


def test_vllm_spellings_give_our_configs():
    engine, _ = configs("--max-model-len", "4096", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
                        "--served-model-name", "my-model", "--dtype", "half", "--kv-cache-dtype", "fp8_e4m3",
                        "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.85",
                        "--tensor-parallel-size", "1")
    assert (engine.max_model_len, engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (
        4096, 32, 2048)
    assert (engine.served_model_name, engine.dtype, engine.tensor_parallel_size) == ("my-model", "float16", 1)
    assert (engine.cache.kv_cache_dtype, engine.cache.enable_prefix_caching) == ("fp8", False)
    assert (engine.cache.gpu_memory_utilization, engine.cache.gpu_memory_fraction) == (0.85, 0.9)
    assert configs("--dtype", "float")[0].dtype == "float32"
    assert configs("-tp", "1")[0].tensor_parallel_size == 1


def test_defaults_and_our_own_spellings_are_unchanged():
    engine, _ = configs()
    assert (engine.dtype, engine.cache.enable_prefix_caching, engine.cache.gpu_memory_fraction,
            engine.cache.gpu_memory_utilization, engine.tensor_parallel_size, engine.served_model_name) == (
        "auto", True, 0.9, None, 1, None)
    assert configs("--no-prefix-caching")[0].cache.enable_prefix_caching is False
    assert configs("--enable-prefix-caching")[0].cache.enable_prefix_caching is True
    assert configs("--gpu-memory-fraction", "0.5")[0].cache.gpu_memory_fraction == 0.5
    assert configs("--dtype", "bf16")[0].dtype == "bfloat16"


def test_a_hub_id_is_the_default_served_name():
    assert configs("--model", "org/name@v2:Q4_K_M")[0].served_model_name == "org/name"
    assert configs("--model", "org/name", "--served-model-name", "x")[0].served_model_name == "x"


@pytest.mark.parametrize("flags, message", [
    (("--tensor-parallel-size", "0"), "--tensor-parallel-size must be >= 1, got 0"),
    (("--tensor-parallel-size", "2", "--device", "cuda:1"), "--device cuda:1 names 1 GPUs for --tensor-parallel-size 2"),
    (("--device", "cuda:0,x"), "--device must be auto, cpu, cuda, cuda:N or cuda:N,M,..., got 'cuda:0,x'"),
    (("--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (("--gpu-memory-utilization", "0.8", "--gpu-memory-fraction", "0.8"),
     "--gpu-memory-fraction (of free memory) and --gpu-memory-utilization (of total memory, vLLM's meaning) "
     "are two ways to size the KV cache: give one"),
    (("--served-model-name", "a", "b"), "--served-model-name: one name only (aliases are not supported), "
                                        "got ['a', 'b']"),
    (("--gguf-file", "x.gguf",), "--revision and --gguf-file apply to a hub --model (org/name), not to a local path"),
    (("--model", "org/name@v1", "--revision", "v2"), "--model 'org/name@v1' names revision 'v1' and --revision "
                                                     "'v2': give one"),
])
def test_refused_with_the_flag_named(flags, message):
    with pytest.raises(ValueError) as err:
        configs(*flags)
    assert str(err.value) == message


@pytest.mark.parametrize("flag, value", [("--dtype", "fp64"), ("--kv-cache-dtype", "fp8_e5m2")])
def test_values_vllm_has_but_we_do_not_are_refused_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: invalid choice: '{value}'" in capsys.readouterr().err


def test_serve_defaults_are_the_configs_own():
    """The bench builds engines from the dataclasses' defaults; `serve` with no flags builds the same configs,
    so a number measured in-process is what the server ships (graphs up to --max-num-seqs included)."""
    from inference_service.config import EngineConfig, SchedulerConfig

    engine, _ = configs()
    assert engine.scheduler == SchedulerConfig()
    assert engine.max_cuda_graph_batch_size is EngineConfig().max_cuda_graph_batch_size is None
    assert engine.cuda_graph_batch_size == 256
    assert configs("--max-num-seqs", "384")[0].cuda_graph_batch_size == 384
    assert configs("--max-num-seqs", "384", "--max-cuda-graph-batch-size", "64")[0].cuda_graph_batch_size == 64
