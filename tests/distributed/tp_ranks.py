"""What the spawned tensor-parallel ranks of the tests run (importable by name in the children)."""

from __future__ import annotations

import dataclasses
import socket

import torch
from harness import PagedHarness

from inference_service.distributed.group import destroy_group, init_group
from inference_service.distributed.loading import load_model_shard


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def teacher_forced_logits(model, prompts: list[list[int]], forced: list[list[int]], chunk: int) -> list[torch.Tensor]:
    """Logits [num_active, vocab] of each step: the prompts prefilled together in chunks of `chunk`
    tokens, then one decode step a token of `forced` (each sequence's next inputs)."""
    harness = PagedHarness(model)
    tables: list[list[int]] = [[] for _ in prompts]
    cached, pending, steps = [0] * len(prompts), [list(p) for p in prompts], []
    while any(pending):
        active = [i for i, p in enumerate(pending) if p]
        pieces = [pending[i][:chunk] for i in active]
        steps.append(harness.step(pieces, [cached[i] for i in active], [tables[i] for i in active]))
        for row, i in enumerate(active):
            cached[i] += len(pieces[row])
            pending[i] = pending[i][len(pieces[row]):]
    for t in range(len(forced[0])):
        steps.append(harness.step([[tokens[t]] for tokens in forced], cached, tables))
        cached = [n + 1 for n in cached]
    return steps


def fold_fp32_gemv() -> None:
    """Decoders built from here on run the fused stack (the GPU's), and its folded decode path (`kernels.gemv`
    with the norms, gate and residual adds in its prologue and epilogue) in fp32 too, which takes it only
    for bf16/fp16: under the Triton interpreter, so the CPU checks it within fp32 error."""
    import kernels
    from inference_service.model import fused_stack
    from inference_service.model.decoder import DecoderModel

    fused_stack.uses_gemv = lambda x, dtype: x.shape[0] <= kernels.MAX_GEMV_ROWS
    init = DecoderModel.__init__
    DecoderModel.__init__ = lambda self, config, **kw: init(self, config, **{**kw, "fused_kernels": True})


def run_rank(rank: int, world_size: int, port: int, jobs: list[tuple], out_file: str, folded: bool = False,
             quantization: str | None = None) -> None:
    """One rank: join the gloo group; for each (model path, prompts, forced tokens, chunk) job load its
    shard and run the steps; rank 0 saves the logits of every job and its shard's `QuantizationSummary`.
    `folded`: the fused stack's folded decode path (Triton, interpreted) instead of the torch stack;
    `quantization`: the shards quantized in situ."""
    if folded:
        fold_fp32_gemv()
    group = init_group(rank, world_size, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=60)
    try:
        results, summaries = [], []
        for path, prompts, forced, chunk in jobs:
            loaded = load_model_shard(path, group, device=torch.device("cpu"), dtype=torch.float32,
                                      attention_backend="triton" if folded else "auto", quantization=quantization)
            results.append(teacher_forced_logits(loaded.model, prompts, forced, chunk))
            summaries.append(dataclasses.astuple(loaded.quantization))  # plain values: torch.load's weights_only
        if rank == 0:
            torch.save({"logits": results, "summaries": summaries}, out_file)
    finally:
        destroy_group()
