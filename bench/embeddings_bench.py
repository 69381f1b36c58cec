"""Embedding throughput of all-MiniLM-L6-v2 on this CPU: our engine against sentence-transformers.

One run measures, on the same sentences and machine, sentences per second at batch 1 (one
sentence per call, calls back to back) and batch 64 (64 sentences per call) for:
  * sentence-transformers `encode(..., batch_size=b)` (the reference, fp32);
  * our `EmbeddingEngine` in process (tokenize, batching thread, packed forward, pooling);
  * our engine over gRPC (a real `inference-service serve --model all-minilm-l6-v2` process).
Each figure is the best of `--repeats` passes over the sentences; the implementations take turns
within each repeat. The markdown table goes to stdout.

Usage: python bench/embeddings_bench.py [--num-sentences 256] [--repeats 3] [--threads 1] [--skip-grpc]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time

import grpc
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference_service.api import pb, pb_grpc  # noqa: E402
from inference_service.engine.embedding_engine import EmbedOptions, create_embedding_engine  # noqa: E402
from inference_service.model.loader import load_model, resolve_model_alias  # noqa: E402
from tests.grpc_client import start_engine  # noqa: E402

MODEL = "all-minilm-l6-v2"
_SUBJECTS = ["The committee", "A small robot", "My neighbour's cat", "The research team", "An old sailor",
             "The new policy", "Our database server", "A quiet library"]
_VERBS = ["reviewed", "discovered", "ignored", "painted", "rebuilt", "questioned", "celebrated", "measured"]
_OBJECTS = ["the quarterly budget report", "a hidden garden behind the station", "every unread message",
            "the oldest bridge in the city", "a surprising pattern in the data", "the rules of the game",
            "three different proposals for the festival", "the noise coming from the basement at night"]


def make_sentences(n: int) -> list[str]:
    """Deterministic, varied English sentences of roughly 8-20 tokens."""
    return [f"{_SUBJECTS[i % 8]} {_VERBS[(i // 8) % 8]} {_OBJECTS[(i // 64 + i) % 8]} on day {i}."
            for i in range(n)]


def chunks(items: list[str], size: int) -> list[list[str]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def grpc_pass(stub: pb_grpc.InferenceServiceStub, groups: list[list[str]]) -> None:
    """One client, one request at a time on one stream (the latency-bound way to call)."""
    done = threading.Event()

    def requests():
        for i, group in enumerate(groups):
            yield pb.EmbedRequest(request_id=str(i), inputs=[pb.EmbedInput(text=s) for s in group], truncate=True)
            done.wait()
            done.clear()

    for response in stub.Embed(requests(), timeout=600):
        assert not response.HasField("error"), response.error
        done.set()


async def measure(sentences: list[str], repeats: int, target: str | None) -> dict[str, dict[int, float]]:
    """Best sentences/s of each implementation; the implementations take turns within each repeat so
    that other load on the machine hits them alike."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(resolve_model_alias(MODEL), device="cpu")
    engine = create_embedding_engine(load_model(MODEL), device=torch.device("cpu"), dtype=torch.float32)
    engine.start()
    channel = grpc.insecure_channel(target) if target else None
    stub = pb_grpc.InferenceServiceStub(channel) if channel else None

    async def ours(groups: list[list[str]]) -> None:
        for group in groups:
            await engine.embed(group, EmbedOptions(truncate=True))

    async def st(groups: list[list[str]]) -> None:
        for group in groups:
            reference.encode(group, batch_size=len(group))

    async def over_grpc(groups: list[list[str]]) -> None:
        grpc_pass(stub, groups)

    impls = {"sentence-transformers": st, "ours, in process": ours}
    if stub is not None:
        impls["ours, over gRPC"] = over_grpc
    best = {name: {1: float("inf"), 64: float("inf")} for name in impls}
    try:
        for batch in (1, 64):
            groups = chunks(sentences, batch)
            for name, run in impls.items():
                await run(groups[:4])  # warm-up
            for _ in range(repeats):
                for name, run in impls.items():
                    start = time.perf_counter()
                    await run(groups)
                    best[name][batch] = min(best[name][batch], time.perf_counter() - start)
    finally:
        await engine.stop()
        if channel is not None:
            channel.close()
    return {name: {b: len(sentences) / t for b, t in times.items()} for name, times in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-sentences", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-grpc", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every implementation (engine process included); on a shared "
                             "machine, 1 avoids OpenMP spin-waits against other load")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the engine process started below
    sentences = make_sentences(args.num_sentences)
    with tempfile.TemporaryDirectory() as tmp:
        engine = None if args.skip_grpc else start_engine("--model", MODEL, log_path=os.path.join(tmp, "engine.log"))
        try:
            rows = asyncio.run(measure(sentences, args.repeats, engine.target if engine else None))
        finally:
            if engine is not None:
                engine.stop()
    print(f"all-MiniLM-L6-v2, fp32, {args.num_sentences} sentences, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}\n")
    print("| implementation | batch 1 (sentences/s) | batch 64 (sentences/s) |")
    print("|---|---:|---:|")
    for name, rates in rows.items():
        print(f"| {name} | {rates[1]:.0f} | {rates[64]:.0f} |")


if __name__ == "__main__":
    main()
