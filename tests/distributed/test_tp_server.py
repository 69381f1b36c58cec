"""`serve --tensor-parallel-size 2` on the CPU (gloo): the same greedy tokens as one process, also when
a cache too small for every request preempts some; a killed worker turns the server NOT_SERVING and makes it
exit non-zero; a size that does not divide the model is a clear startup error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import PagedHarness
from tiny_models import make_hf_model, save_hf_model

from inference_service.api import pb, pb_grpc
from inference_service.model.loader import load_model
from tests.grpc_client import REPO_ROOT, GenerateStream, start_engine
from tests.reliability.rel_helpers import engine_metrics

PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33] * 2, [256, 84, 80]]
NUM_NEW_TOKENS = 8
# Small steps: the long prompt prefills in chunks; a small cache.
ENGINE_ARGS = ("--device", "cpu", "--tensor-parallel-size", "2", "--kv-cache-memory", "16",
               "--max-num-batched-tokens", "16", "--max-num-seqs", "4")
# How long a dead worker may take to stop the server: the drain (no request in flight) and the
# gRPC server's one-second grace, with a wide margin for a loaded 2-core machine.
MAX_EXIT_S = 60


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_hf_model(make_hf_model("qwen3", seed=5), str(tmp_path_factory.mktemp("tp_qwen3")))


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _worker_pid(engine) -> int:
    """The spawned rank 1: the server's child running the multiprocessing spawn entry point."""
    for child in _children(engine.process.pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            return child
    raise AssertionError(f"no worker process among {_children(engine.process.pid)}")


def test_two_ranks_serve_the_tokens_of_one_process_and_die_with_a_worker(model_path, tmp_path):
    expected = PagedHarness(load_model(model_path).model).generate(PROMPTS, NUM_NEW_TOKENS)
    engine = start_engine("--model", model_path, *ENGINE_ARGS, log_path=str(tmp_path / "tp.log"))
    try:
        with grpc.insecure_channel(engine.target) as channel:
            stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
            for i, prompt in enumerate(PROMPTS):
                stream.start(f"r{i}", token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(temperature=0.0),
                             stopping=pb.StoppingCriteria(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
            stream.wait_done({"r0", "r1"})
            assert [stream.results[f"r{i}"].tokens for i in range(len(PROMPTS))] == expected
            # The first prompt again: its full blocks come from the prefix cache, on every rank alike.
            stream.start("again", token_ids=pb.TokenIds(ids=PROMPTS[0]), sampling=pb.SamplingParams(temperature=0.0),
                         stopping=pb.StoppingCriteria(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
            stream.wait_done({"again"})
            stream.close()
            assert stream.results["again"].tokens == expected[0]
            assert stream.results["again"].usage.cached_tokens == len(PROMPTS[0]) // 16 * 16

            # Watch health, then kill rank 1: NOT_SERVING arrives, then the server exits non-zero.
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=MAX_EXIT_S)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            os.kill(_worker_pid(engine), signal.SIGKILL)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert engine.process.wait(MAX_EXIT_S) == 1
        assert "tensor-parallel worker rank 1 (pid" in engine.log() and "exited with code -9" in engine.log()
    finally:
        engine.stop()


def test_preempted_requests_on_two_ranks_give_the_tokens_of_one_process(tmp_path):
    # 16 layers of 2 KV heads of 64 a rank: 16 KiB of fp32 K and V a token, so 1 MiB holds 64 tokens (4 blocks).
    # Three requests of 16 + 40 tokens (4 blocks each) overflow it; each alone fits.
    model = make_hf_model("llama", seed=7, hidden_size=256, intermediate_size=256, num_hidden_layers=16,
                          num_attention_heads=4, num_key_value_heads=4)
    path = save_hf_model(model, str(tmp_path / "llama16"))
    prompts = [[256, *range(10 + 20 * i, 25 + 20 * i)] for i in range(3)]
    expected = PagedHarness(load_model(path).model).generate(prompts, 40)
    engine = start_engine("--model", path, "--device", "cpu", "--tensor-parallel-size", "2", "--kv-cache-memory", "1",
                          "--max-model-len", "64", log_path=str(tmp_path / "tp.log"))
    try:
        with grpc.insecure_channel(engine.target) as channel:
            stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
            for i, prompt in enumerate(prompts):
                stream.start(f"r{i}", token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0.0),
                             stopping=pb.StoppingCriteria(max_tokens=40, ignore_eos=True))
            stream.wait_done({"r0", "r1", "r2"})
            stream.close()
        assert engine_metrics(engine)["inference_engine_preemptions_total"] >= 1
        assert [stream.results[f"r{i}"].tokens for i in range(len(prompts))] == expected
    finally:
        engine.stop()


def test_size_that_does_not_divide_the_heads_is_a_startup_error(model_path, tmp_path):
    cmd = [sys.executable, "-m", "inference_service.cli", "serve", "--model", model_path, "--device", "cpu",
           "--tensor-parallel-size", "3"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "cannot start: --tensor-parallel-size 3 does not divide the model's 4 attention heads" in done.stderr
