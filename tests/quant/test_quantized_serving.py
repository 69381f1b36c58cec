"""A quantized checkpoint served for real: the engine on loopback reports its quantization (GetModelInfo,
the proxy's model card), generates the tokens the model gives in process, and refuses a malformed
quantization_config at startup (exit 2, the field named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc

from inference_service.api import pb, pb_grpc
from inference_service.model.loader import load_model
from rest_proxy.routes.models import model_card
from tests.grpc_client import REPO_ROOT, GenerateStream, free_port, greedy, start_engine
from tests.model.harness import PagedHarness
from tests.quant.checkpoints import write_quantized

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]
ENGINE_ARGS = ("--device", "cpu", "--max-model-len", "64", "--kv-cache-memory", "8", "--max-num-seqs", "4")


def test_the_engine_reports_and_serves_a_gptq_checkpoint(tmp_path):
    folder, _ = write_quantized("gptq-desc-act", str(tmp_path))
    loaded = load_model(folder, device="cpu")
    expected_tokens = PagedHarness(loaded.model).generate([PROMPT], 4)[0]
    engine = start_engine("--model", folder, *ENGINE_ARGS, log_path=str(tmp_path / "engine.log"))
    try:
        with grpc.insecure_channel(engine.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            stream = GenerateStream(stub)
            stream.start("q", token_ids=pb.TokenIds(ids=PROMPT), **greedy(4, ignore_eos=True))
            stream.wait_done({"q"})
            stream.drain()
    finally:
        engine.stop()
    assert (info.quantization, info.quantization_bits) == ("gptq", 4)
    assert info.weight_bytes == loaded.quantization.weight_bytes == loaded.model.num_weight_bytes
    assert model_card(info)["quantization"] == {"method": "gptq", "bits": 4, "weight_bytes": info.weight_bytes}
    assert stream.results["q"].tokens == expected_tokens
    saved = loaded.quantization.unquantized_bytes - loaded.quantization.weight_bytes
    assert (f"quantization gptq: 4-bit projections, weights {info.weight_bytes / 1e9:.2f} GB "
            f"({saved / 1e9:.2f} GB less than 16-bit)") in engine.log()


def test_a_malformed_quantization_config_stops_the_engine_naming_the_field(tmp_path):
    folder, _ = write_quantized("awq", str(tmp_path))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["zero_point"] = False
    with open(path, "w") as f:
        json.dump(config, f)
    result = subprocess.run([sys.executable, "-m", "inference_service.cli", "serve", "--port", str(free_port()),
                             "--model", folder, *ENGINE_ARGS], check=False, capture_output=True, text=True,
                            timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 2
    assert ("cannot start: quantization_config: zero_point: AWQ without zero points is not supported"
            in result.stderr)
