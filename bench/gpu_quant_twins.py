"""`bench/gpu_quant.py --only twins`: tiny quantized checkpoints served against their dequantized twins."""

from __future__ import annotations

import os
import tempfile
import traceback


def section_twins(results: dict, device: str) -> None:
    """Model-level correctness on the device: each tiny quantized Llama (tests/quant/checkpoints.py: GPTQ,
    GPTQ act-order, AWQ, compressed-tensors w4a16 / fp8, fp8 block) served by the engine in bf16 (CUDA
    graphs, fused stack) against its dequantized twin, in float32 and in bfloat16: first greedy divergence
    per prompt (None: the same 32 tokens). fp8 formats also round activations to e4m3 (the twin does not),
    and bf16 rounds differently on the two paths, so only float32 int formats are expected to agree.)"""
    import gpu_common

    from inference_service.engine.sampling_params import SamplingParams
    from tests.quant.checkpoints import FORMATS, write_quantized

    gpu_common.DEVICE = device
    prompts = [[(7 * i + 13 * j) % 250 + 1 for j in range(8 + 5 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            rows[fmt] = {}
            try:
                folder, twin = write_quantized(fmt, os.path.join(tmp, fmt))
                for dtype in ("float32", "bfloat16"):
                    outputs = []
                    for path in (folder, twin):
                        engine = gpu_common.make_engine(path, device, dtype, kv_mib=64, max_cuda_graph_batch_size=8)
                        outputs.append(gpu_common.generate(engine, prompts, params))
                        del engine
                        gpu_common.free_device_memory()
                    rows[fmt][dtype] = [gpu_common.first_divergence(a, b) for a, b in zip(*outputs)]
            except Exception as exc:  # noqa: BLE001 - report and go on
                rows[fmt]["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            print(fmt, rows[fmt], flush=True)
    results["twins"] = rows
