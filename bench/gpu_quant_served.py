"""`bench/gpu_quant.py --only served`: the engine's own batch-1 decode with bf16 and in-situ quantized weights."""

from __future__ import annotations

import dataclasses
import time
import traceback

import torch


def _ttft_ms(engine, prompt_len: int, reps: int = 3) -> float:
    """Median ms from adding a fresh prompt of `prompt_len` tokens (a new one each time: no prefix hit) to its
    first token, the engine otherwise idle."""
    from inference_service.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for rep in range(reps):
        prompt = torch.randint(0, 128000, (prompt_len,), generator=torch.Generator().manual_seed(rep + 1)).tolist()
        t0 = time.perf_counter()
        engine.add_request(engine.input_processor.process(f"ttft{rep}", prompt, params))
        while engine.has_unfinished:
            engine.step()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1e3, 1)


def batch1_decode_tok_s(engine, prompt_len: int = 128, new_tokens: int = 512, request_id: str = "bench") -> float:
    """Output tok/s of one greedy request alone in the engine (ignore_eos), timed from its second token on: the
    decode steps only, as `--only served` reports them."""
    from inference_service.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompt = torch.randint(0, 128000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request(engine.input_processor.process(request_id, prompt, params))
    stamps = [time.perf_counter()]
    while engine.has_unfinished:
        engine.step()
        stamps.append(time.perf_counter())
    return (new_tokens - 1) / (stamps[-1] - stamps[1])


def section_served(results: dict, device: str, methods: list[str]) -> None:
    """The engine's own decode (LLMEngine.step, CUDA graphs, 128-token prompt, 512 new tokens, batch 1, the
    second of two rounds) with bf16 weights and each `--quantization` (in-situ quantized from the same random bf16 weights),
    as bench/gpu_perf.py measures bf16, and the time to first token of a 2000-token prompt. Roofline: copy
    bandwidth / the bytes of weights a step reads (`gpu_common.stored_bytes_per_step`: the embedding table,
    of which a step reads one row, left out; `weight_gb` is the weights' memory, the table included)."""
    import gpu_common
    import gpu_perf

    from inference_service.model.quantization import (
        quantize_loaded_model,
        summarize_model,
    )

    gpu_common.DEVICE = device
    copy_gbs = results.get("ceilings", {}).get("copy_gbs")
    dense, load_s = gpu_perf.load_llama()
    rows = {"load_bf16_s": round(load_s, 1)}
    targets = {"int4": 400, "fp8": 300, "q4_k": 380}  # q4_k: the layout a GGUF Q4_K loads into
    for method in methods:
        engine = None
        try:
            t0 = time.perf_counter()
            if method == "bf16":
                loaded = dense
            else:
                model = quantize_loaded_model(dense.model, method, release=False)
                loaded = dataclasses.replace(dense, model=model, quantization=summarize_model(model, f"in-situ {method}"))
            quantize_s = time.perf_counter() - t0
            weight_bytes = loaded.model.num_weight_bytes
            step_bytes = gpu_common.stored_bytes_per_step(loaded.model)
            engine = gpu_common.make_engine(loaded.model_path, device, "bfloat16", load_format="dummy",
                                            loaded=loaded, max_cuda_graph_batch_size=8)  # batch 1 only
            # NOTE: two rounds, the second reported: the first of a machine just started measured 211.8 against
            # 248.2 tok/s (bf16, H200, 2026-11-28), whatever the tree
            first_s = batch1_decode_tok_s(engine, request_id="warm-up")
            tok_s = batch1_decode_tok_s(engine)
            row = {"decode_tok_s": round(tok_s, 1), "first_round_tok_s": round(first_s, 1),
                   "ttft_2k_ms": _ttft_ms(engine, 2000),
                   "weight_gb": round(weight_bytes / 1e9, 3), "step_gb": round(step_bytes / 1e9, 3),
                   "quantize_s": round(quantize_s, 1)}
            if copy_gbs:
                roofline = copy_gbs * 1e9 / step_bytes
                row.update(roofline_tok_s=round(roofline, 1), ratio_to_roofline=round(tok_s / roofline, 3))
            if method in targets:
                row["target_tok_s"] = targets[method]
            rows[method] = row
        except Exception as exc:  # noqa: BLE001 - report and go on with the next method
            rows[method] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        print(method, rows[method], flush=True)
        del engine
        loaded = model = None
        gpu_common.free_device_memory()
    results["served"] = rows
