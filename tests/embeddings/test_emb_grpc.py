"""A real engine process serving all-MiniLM-L6-v2 over gRPC: Embed, GetModelInfo, Generate refused."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
import torch.nn.functional as F

from inference_service.api import pb, pb_grpc
from tests.embeddings.emb_sentences import MINILM, MINILM_LIMIT, SENTENCES, minilm_path
from tests.grpc_client import start_engine

INVALID_ARGUMENT, UNIMPLEMENTED = grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.UNIMPLEMENTED.value[0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    log = tmp_path_factory.mktemp("emb_grpc") / "engine.log"
    process = start_engine("--model", MINILM, log_path=str(log))
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def stub(engine):
    with grpc.insecure_channel(engine.target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


@pytest.fixture(scope="module")
def expected() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.from_numpy(SentenceTransformer(minilm_path(), device="cpu").encode(SENTENCES, batch_size=64))


def texts(items: list[str]) -> list[pb.EmbedInput]:
    return [pb.EmbedInput(text=t) for t in items]


def test_model_info_describes_an_encoder(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (info.model_name, info.family, info.architecture) == (MINILM, "bert", "BertModel")
    assert (info.supports_generate, info.supports_embed, info.embedding_dimensions) == (False, True, 384)
    assert (info.max_context_length, info.vocab_size) == (MINILM_LIMIT, 30522)
    assert not info.HasField("kv_cache") and info.model_path == minilm_path()


def test_multiplexed_requests_match_sentence_transformers(stub, expected):
    # Requests of 1..n inputs on one stream, answered by request id in whatever order they finish.
    chunks = {f"r{i}": list(range(start, min(start + i + 1, len(SENTENCES))))
              for i, start in enumerate(range(0, len(SENTENCES), 10))}
    requests = [pb.EmbedRequest(request_id=rid, inputs=texts([SENTENCES[j] for j in idx]), truncate=True)
                for rid, idx in chunks.items()]
    responses = {r.request_id: r for r in stub.Embed(iter(requests), timeout=60)}
    assert set(responses) == set(chunks)
    for rid, idx in chunks.items():
        r = responses[rid]
        assert not r.HasField("error") and len(r.embeddings) == len(idx)
        got = torch.tensor([list(e.values) for e in r.embeddings])
        assert F.cosine_similarity(got, expected[idx], dim=1).min() >= 0.9999
        assert r.prompt_tokens == sum(e.num_tokens for e in r.embeddings) > 0


def test_concurrent_streams_are_batched_and_exact(stub, expected):
    results: dict[int, torch.Tensor] = {}

    def run(k: int) -> None:
        requests = [pb.EmbedRequest(request_id=str(i), inputs=texts([SENTENCES[i]]), truncate=True)
                    for i in range(k, len(SENTENCES), 4)]
        for r in stub.Embed(iter(requests), timeout=60):
            results[int(r.request_id)] = torch.tensor(list(r.embeddings[0].values))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = torch.stack([results[i] for i in range(len(SENTENCES))])
    assert F.cosine_similarity(got, expected, dim=1).min() >= 0.9999


def test_errors_are_in_band_and_name_the_limit(stub):
    requests = [
        pb.EmbedRequest(request_id="long", inputs=texts(["ok", "word " * 300])),
        pb.EmbedRequest(request_id="fine", inputs=texts(["still served"])),
        pb.EmbedRequest(request_id="dims", inputs=texts(["x"]), dimensions=1000),
        pb.EmbedRequest(request_id="", inputs=texts(["x"])),
        pb.EmbedRequest(request_id="unset", inputs=[pb.EmbedInput()]),
    ]
    responses = {r.request_id: r for r in stub.Embed(iter(requests), timeout=30)}
    long = responses["long"]
    assert (long.error.code, long.error.field) == (INVALID_ARGUMENT, "inputs[1]") and not long.embeddings
    assert "302 tokens" in long.error.message and "limit of 256 tokens" in long.error.message
    assert len(responses["fine"].embeddings) == 1 and not responses["fine"].HasField("error")
    assert (responses["dims"].error.code, responses["dims"].error.field) == (INVALID_ARGUMENT, "dimensions")
    assert (responses[""].error.code, responses[""].error.field) == (INVALID_ARGUMENT, "request_id")
    assert (responses["unset"].error.code, responses["unset"].error.field) == (INVALID_ARGUMENT, "inputs[0]")


def test_options_dimensions_normalize_token_ids(stub):
    ids = list(stub.Tokenize(iter([pb.TokenizeRequest(request_id="t", tokenize=pb.TokenizeText(text="hello"))]),
                             timeout=5))[0].token_ids
    assert list(ids) == [101, 7592, 102]
    requests = [
        pb.EmbedRequest(request_id="full", inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=ids))]),
        pb.EmbedRequest(request_id="short", inputs=texts(["hello"]), dimensions=32),
        pb.EmbedRequest(request_id="raw", inputs=texts(["hello"]), normalize=False),
    ]
    r = {x.request_id: torch.tensor(list(x.embeddings[0].values)) for x in stub.Embed(iter(requests), timeout=30)}
    assert r["short"].shape == (32,)
    torch.testing.assert_close(r["short"], F.normalize(r["full"][:32], dim=0), atol=1e-6, rtol=0)
    torch.testing.assert_close(F.normalize(r["raw"], dim=0), r["full"], atol=1e-6, rtol=0)
    assert abs(float(r["raw"].norm()) - 1) > 0.1


def test_generate_is_refused_in_band(stub):
    call = stub.Generate(iter([pb.GenerateRequest(start=pb.StartGeneration(request_id="g", text="hi"))]), timeout=10)
    [response] = list(call)
    assert response.request_id == "g" and response.finish_reason == pb.FINISH_REASON_ERROR
    assert response.error.code == UNIMPLEMENTED and "encoder" in response.error.message
