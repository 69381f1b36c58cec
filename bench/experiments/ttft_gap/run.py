"""Where the served 4k TTFT's extra ~3 ms inside the core comes from (bench/results/h200-2026-11-29d).

Every 4k TTFT sample (not the best of 4), in process after 1.0 / 1.25 / 2.0 s of idle GPU, then served (the
engine core in its own process, and in process with the gRPC server) with requests 1.25 s apart:

  python bench/experiments/ttft_gap/run.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import served_path  # noqa: E402

N, REPS = 4096, 6
VOCAB = 128000


def in_process(out: str) -> None:
    import gpu_common as common

    from inference_service.cli import build_parser, configs_from_args
    from inference_service.engine.gc_heap import freeze_startup_heap
    from inference_service.engine.llm_engine import LLMEngine
    from inference_service.engine.sampling_params import SamplingParams

    config, _ = configs_from_args(build_parser().parse_args(["serve", *served_path.serve_flags(served_path.GPU)]))
    engine = LLMEngine(config)
    freeze_startup_heap()
    common.DEVICE = "cuda"
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.generate([served_path._prompt(64, 7 + i, engine) for i in range(4)],
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    result = {}
    for rest_s in (1.0, 1.25, 2.0, 0.0):
        times = []
        for rep in range(REPS):
            prompt = served_path._prompt(N, int(rest_s * 1000) * 100 + rep, engine)
            common.sync()
            time.sleep(rest_s)
            t0 = time.perf_counter()
            engine.add_request(engine.input_processor.process(f"t{rest_s}-{rep}", prompt, one))
            engine.run_until_idle()
            times.append(round((time.perf_counter() - t0) * 1e3, 2))
        result[str(rest_s)] = times
        print("in process, rest", rest_s, times, flush=True)
    with open(out, "w") as f:
        json.dump(result, f)


def served(extra: list[str], log_path: str) -> dict:
    import grpc
    import torch

    from inference_service.api import pb, pb_grpc
    from tests.grpc_client import start_engine

    engine = start_engine(*served_path.serve_flags(served_path.GPU), *extra, log_path=log_path, timeout_s=400)
    client_ms = []
    try:
        with grpc.insecure_channel(engine.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            for rep in range(REPS + 1):  # the first compiles the shapes
                ids = torch.randint(0, VOCAB, (N,), generator=torch.Generator().manual_seed(777 + rep)).tolist()
                start = pb.StartGeneration(request_id=f"r{rep}", token_ids=pb.TokenIds(ids=ids),
                                           stopping=pb.StoppingCriteria(max_tokens=1, ignore_eos=True))
                time.sleep(1.25)
                t0 = time.perf_counter()
                first = None
                for response in stub.Generate(iter([pb.GenerateRequest(start=start)])):
                    first = first or time.perf_counter()
                    if response.error.message:
                        raise RuntimeError(response.error.message)
                client_ms.append(round((first - t0) * 1e3, 2))
    finally:
        engine.stop()
    with open(log_path) as f:
        core_ms = [float(m) * 1e3 for m in re.findall(rf"prompt_tokens={N} .*?ttft=([0-9.]+)s", f.read())]
    return {"client_ms": client_ms[1:], "log_ms": core_ms[1:]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--in-process-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process_child:
        in_process(args.in_process_child)
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "in_process.json")
    subprocess.run([sys.executable, __file__, "--out", args.out, "--in-process-child", path], check=True)
    with open(path) as f:
        results = {"in_process": json.load(f)}
    for name, extra in (("core_process", []), ("engine_in_process", ["--engine-in-process"])):
        results[name] = served(extra, os.path.join(args.out, f"{name}.log"))
        print(name, results[name], flush=True)
    with open(os.path.join(args.out, "ttft_gap.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
