"""Quantized checkpoints under tensor parallelism: each rank reads its part of every packed tensor (GPTQ's
qweight [K/8, N], AWQ's [K, N/8], group scales, FP8 blocks) and packs it as one process would. The codes
and scales a rank holds are one process's, so two ranks give one process's logits within fp32 rounding.
Except per-channel FP8 (w8a8): its activations are scaled per token on the fly, and on a row-parallel layer a
rank scales its half of the inputs, a finer grid: there the logits agree to fp8 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from harness import PagedHarness
from tp_ranks import free_port, run_rank, teacher_forced_logits

from inference_service.distributed.loading import open_shard_source
from inference_service.distributed.sharding import ShardPlan
from inference_service.errors import UnsupportedModelError
from inference_service.model.loader import load_model
from tests.quant.checkpoints import write_quantized

# "gptq-bias": q/k/v/o biases beside the packed weights (o_proj's is row-parallel: rank 0 adds it); the other
# int formats come without biases. NOTE: each int format costs ~25 s of Triton interpreter a side, so GPTQ
# group 128 is checked with biases only.
FORMATS = ("gptq-bias", "gptq-channel", "awq", "ct-w4a16", "ct-fp8", "fp8-block")
LABELS = {"gptq-channel": "gptq", "awq": "awq", "ct-w4a16": "compressed-tensors", "ct-fp8": "fp8",
          "fp8-block": "fp8", "gptq-bias": "gptq"}
PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32, 119], [256, 84, 80, 33]]
NUM_NEW_TOKENS = 3
CHUNK = 5


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_quantized")
    references, jobs = {}, []
    for fmt in FORMATS:
        biased = fmt.endswith("-bias")
        path, _ = write_quantized(fmt.removesuffix("-bias"), str(folder / fmt), seed=5, attention_bias=biased)
        reference = load_model(path, dtype=torch.float32).model
        generated = PagedHarness(reference).generate(PROMPTS, NUM_NEW_TOKENS, prefill_chunk=CHUNK)
        forced = [tokens[:-1] for tokens in generated]
        references[fmt] = (generated, teacher_forced_logits(reference, PROMPTS, forced, CHUNK))
        jobs.append((path, PROMPTS, forced, CHUNK))
    out_file = str(folder / "rank0.pt")
    mp.start_processes(run_rank, args=(2, free_port(), jobs, out_file), nprocs=2, join=True, start_method="spawn")
    saved = torch.load(out_file)
    return {fmt: (*references[fmt], saved["logits"][i], saved["summaries"][i]) for i, fmt in enumerate(FORMATS)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_ranks_match_one_process_on_a_quantized_checkpoint(fmt, two_rank_runs):
    generated, expected, got, summary = two_rank_runs[fmt]
    assert summary[:2] == (LABELS[fmt], 8 if "fp8" in fmt else 4)  # quantization, bits
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        if fmt == "ct-fp8":
            # Measured 0.094 at the first step; one process against its twin with unquantized activations
            # (the same weights) differs by 0.10-0.22 on this tiny model.
            error = ((g - e).abs().max() / e.abs().max()).item()
            assert error < 0.15, (step, error)
            continue
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
    if fmt == "ct-fp8":
        return
    decode_steps = got[len(got) - NUM_NEW_TOKENS + 1:]
    assert [[int(t[i].argmax()) for t in decode_steps] for i in range(len(PROMPTS))] == [g[1:] for g in generated]


def test_an_act_order_checkpoint_split_by_input_rows_is_refused_naming_the_tensor(tmp_path):
    path, _ = write_quantized("gptq-desc-act", str(tmp_path), seed=5)
    source = open_shard_source(path, "auto", torch.float32)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.\d\.(self_attn\.o_proj|mlp\.down_proj)\.g_idx: a desc_act"):
        list(source.shard_weights(ShardPlan(source.config, 1, 2), torch.device("cpu"), False))
