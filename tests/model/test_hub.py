"""`--model org/name`: the engine downloads a Hugging Face Hub model through `huggingface_hub` from a local
server speaking the hub's file API (HF_ENDPOINT), into a cache made for the test; no test reaches the internet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from inference_service.api import pb, pb_grpc
from inference_service.model.hub import HubError, HubModel, parse_hub_id, pick_gguf
from tests.grpc_client import REPO_ROOT, GenerateStream, free_port, greedy, start_engine
from tests.model.fake_hub import FakeHub
from tests.model.tiny_models import make_hf_model, save_hf_model

PROMPT = [72, 101, 108, 108, 111]  # "Hello" in the byte vocabulary
NUM_TOKENS = 6
ENGINE_ARGS = ("--kv-cache-memory", "8", "--max-model-len", "128", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "128")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny llama's files, and the tokens HF transformers greedily continues PROMPT with."""
    model = make_hf_model("llama", seed=7)
    folder = Path(save_hf_model(model, str(tmp_path_factory.mktemp("tiny"))))
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                             do_sample=False)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    files["pytorch_model.bin"] = b"not a format the engine reads: never downloaded"
    return files, out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def hub(checkpoint):
    files, _ = checkpoint
    ggufs = {"tiny.Q4_K_M.gguf": b"q4" * 1000, "tiny.Q8_0.gguf": os.urandom(11 * 2**20), "README.md": b"# tiny"}
    server = FakeHub({"org/tiny": files, "org/tiny-gguf": ggufs}).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_home")


def hub_env(monkeypatch, endpoint: str, hf_home: Path, offline: bool = False) -> None:
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def generate(target: str) -> tuple[str, list[int]]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        name = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_name
        stream = GenerateStream(stub)
        stream.start("r", token_ids=pb.TokenIds(ids=PROMPT), **greedy(NUM_TOKENS, ignore_eos=True))
        stream.wait_done({"r"})
        stream.close()
        return name, stream.results["r"].tokens


def serve_exit(*args: str) -> subprocess.CompletedProcess:
    """Runs `inference-service serve` expecting it to refuse to start."""
    return subprocess.run([sys.executable, "-m", "inference_service.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_an_engine_serves_a_hub_model_then_the_cache_serves_it_offline(hub, hf_home, checkpoint, monkeypatch,
                                                                        tmp_path):
    _, expected = checkpoint
    hub_env(monkeypatch, hub.url, hf_home)
    engine = start_engine("--model", "org/tiny", *ENGINE_ARGS, log_path=str(tmp_path / "online.log"))
    try:
        assert generate(engine.target) == ("org/tiny", expected)
    finally:
        engine.stop()
    # The checkpoint's files only (no .bin), with the token, into the hub's standard cache layout.
    assert sorted(hub.downloads("org/tiny")) == sorted(n for n in checkpoint[0] if n != "pytorch_model.bin")
    assert {r.headers.get("authorization") for r in hub.requests} == {"Bearer hf_test_token"}
    snapshot = hf_home / "hub" / "models--org--tiny" / "snapshots" / FakeHub.commit("org/tiny")
    assert (snapshot / "model.safetensors").read_bytes() == checkpoint[0]["model.safetensors"]

    # Offline, with the hub gone (a port nobody listens on): the warm cache alone.
    num_requests = len(hub.requests)
    hub_env(monkeypatch, f"http://127.0.0.1:{free_port()}", hf_home, offline=True)
    engine = start_engine("--model", "org/tiny", "--served-model-name", "tiny", *ENGINE_ARGS,
                          log_path=str(tmp_path / "offline.log"))
    try:
        assert generate(engine.target) == ("tiny", expected)
    finally:
        engine.stop()
    assert len(hub.requests) == num_requests


def test_offline_with_a_cold_cache_refuses_to_start(hub, monkeypatch, tmp_path):
    hub_env(monkeypatch, hub.url, tmp_path / "cold", offline=True)
    num_requests = len(hub.requests)
    result = serve_exit("--model", "org/tiny")
    assert result.returncode == 2
    assert (f"cannot start: model org/tiny@main is not in the cache {tmp_path / 'cold' / 'hub'} and "
            f"HF_HUB_OFFLINE=1 forbids downloading it") in result.stderr
    assert len(hub.requests) == num_requests


def test_an_unknown_repo_or_revision_refuses_to_start(hub, monkeypatch, tmp_path):
    hub_env(monkeypatch, hub.url, tmp_path / "cache")
    result = serve_exit("--model", "org/missing")
    assert result.returncode == 2
    assert (f"cannot start: model 'org/missing': no such repository on {hub.url} and no such local path"
            in result.stderr)
    result = serve_exit("--model", "org/tiny@v9")
    assert result.returncode == 2
    assert f"cannot start: model org/tiny: no revision 'v9' on {hub.url}" in result.stderr
    assert not (tmp_path / "cache" / "hub" / "models--org--tiny" / "snapshots").exists()


def download(*spec: str) -> str:
    """`download_model(HubModel(*spec))` in a fresh interpreter, as `huggingface_hub` reads its environment
    at import: the path, or `HubError: ...`."""
    code = ("import sys\nfrom inference_service.model.hub import HubError, HubModel, download_model\n"
            "try:\n    print(download_model(HubModel(*sys.argv[1:])))\n"
            "except HubError as e:\n    print(f'HubError: {e}')\n")
    result = subprocess.run([sys.executable, "-c", code, *spec], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_quantization_hint_downloads_only_that_gguf_and_resumes_after_a_dropped_connection(hub, monkeypatch,
                                                                                               tmp_path):
    hub_env(monkeypatch, hub.url, tmp_path)
    data = hub.repos["org/tiny-gguf"]["tiny.Q8_0.gguf"]
    # The connection drops after 10.5 MiB: the first 10 MiB chunk is written, the download resumes from there.
    hub.cut_after["tiny.Q8_0.gguf"] = 21 * 2**19
    start = len(hub.requests)
    path = download("org/tiny-gguf", "main", "q8_0")
    assert path == str(tmp_path / "hub" / "models--org--tiny-gguf" / "snapshots" / FakeHub.commit("org/tiny-gguf")
                       / "tiny.Q8_0.gguf")
    assert Path(path).read_bytes() == data
    gets = [r for r in hub.requests[start:] if r.method == "GET" and "/resolve/" in r.path]
    assert [(r.path.rsplit("/", 1)[1], r.headers.get("range")) for r in gets] == [("tiny.Q8_0.gguf", None),
                                                                                   ("tiny.Q8_0.gguf", f"bytes={10 * 2**20}-")]
    assert download("org/tiny-gguf", "main", "Q5_K_M") == (
        "HubError: quantization 'Q5_K_M': org/tiny-gguf has no GGUF file of that type; "
        "its GGUF files: tiny.Q4_K_M.gguf, tiny.Q8_0.gguf (pick one with --gguf-file)")
    assert download("org/tiny-gguf").startswith(
        "HubError: org/tiny-gguf has 2 GGUF files: pick one with --gguf-file NAME or --model org/tiny-gguf:QUANT")


def test_hub_ids_are_told_apart_from_local_paths(tmp_path):
    assert parse_hub_id("Qwen/Qwen3-0.6B") == HubModel("Qwen/Qwen3-0.6B", "main", None)
    assert parse_hub_id("org/name@v1.0") == HubModel("org/name", "v1.0", None)
    assert parse_hub_id("org/name-GGUF:Q4_K_M") == HubModel("org/name-GGUF", "main", "Q4_K_M")
    assert parse_hub_id("org/name@abc123:Q8_0") == HubModel("org/name", "abc123", "Q8_0")
    assert parse_hub_id("org/name", revision="dev") == HubModel("org/name", "dev", None)
    with pytest.raises(HubError, match="names revision 'v1' and --revision 'v2': give one"):
        parse_hub_id("org/name@v1", revision="v2")
    (tmp_path / "org" / "name").mkdir(parents=True)
    os.chdir(tmp_path)
    try:
        assert parse_hub_id("org/name") is None  # an existing folder wins
    finally:
        os.chdir(REPO_ROOT)
    for local in (None, "", "all-minilm-l6-v2", "/abs/model.gguf", "./rel/folder", "model.gguf"):
        assert parse_hub_id(local) is None, local


def test_the_gguf_pick():
    files = ["README.md", "m.Q4_K_M.gguf", "m.Q4_K.gguf", "m.Q8_0.gguf", "sub/m.F16.gguf"]
    assert pick_gguf(files, None, "Q4_K", "o/m") == "m.Q4_K.gguf"  # not Q4_K_M: the type is matched whole
    assert pick_gguf(files, None, "q4_k_m", "o/m") == "m.Q4_K_M.gguf"
    assert pick_gguf(files, "m.F16.gguf", None, "o/m") == "sub/m.F16.gguf"
    assert pick_gguf(["config.json", "model.safetensors", "m.Q8_0.gguf"], None, None, "o/m") is None
    assert pick_gguf(["README.md", "only.gguf"], None, None, "o/m") == "only.gguf"
    with pytest.raises(HubError, match=r"--gguf-file 'x.gguf': o/m has no such file"):
        pick_gguf(files, "x.gguf", None, "o/m")
    with pytest.raises(HubError, match=r"o/m has neither safetensors weights with a config.json nor a GGUF file; "
                                       r"files: README.md, pytorch_model.bin"):
        pick_gguf(["pytorch_model.bin", "README.md"], None, None, "o/m")
