"""/v1/embeddings through the proxy in front of a real MiniLM engine, with the official `openai` SDK."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from openai import OpenAI

from rest_proxy.config import ProxyConfig
from tests.embeddings.emb_sentences import MINILM, SENTENCES, minilm_path
from tests.grpc_client import start_engine
from tests.proxy.servers import ProxyServer


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    log = tmp_path_factory.mktemp("emb_proxy") / "engine.log"
    engine = start_engine("--model", MINILM, log_path=str(log))
    server = ProxyServer(ProxyConfig(engines=[engine.target])).start()
    yield server
    server.stop()
    engine.stop()


@pytest.fixture(scope="module")
def client(proxy) -> OpenAI:
    return OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_list_input_matches_sentence_transformers_with_usage(client):
    from sentence_transformers import SentenceTransformer

    inputs = SENTENCES[6:16]
    expected = torch.from_numpy(SentenceTransformer(minilm_path(), device="cpu").encode(inputs))
    resp = client.embeddings.create(model=MINILM, input=inputs, encoding_format="float")
    assert resp.model == MINILM and [d.index for d in resp.data] == list(range(len(inputs)))
    got = torch.tensor([d.embedding for d in resp.data])
    assert F.cosine_similarity(got, expected, dim=1).min() >= 0.9999
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(inputs) * 2


def test_base64_decodes_to_the_float_result(client, proxy):
    floats = client.embeddings.create(model=MINILM, input=["base64 check", "é"], encoding_format="float")
    raw = httpx.post(proxy.url + "/v1/embeddings", json={"model": MINILM, "input": ["base64 check", "é"],
                                                         "encoding_format": "base64"}, timeout=30).json()
    for item, expected in zip(raw["data"], floats.data, strict=True):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert decoded.tolist() == expected.embedding  # float32 values, bit for bit
    # The SDK's default asks for base64 and decodes it itself.
    default = client.embeddings.create(model=MINILM, input=["base64 check", "é"])
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]


def test_token_ids_string_and_dimensions(client):
    text = client.embeddings.create(model=MINILM, input="hello", encoding_format="float").data[0].embedding
    ids = client.embeddings.create(model=MINILM, input=[101, 7592, 102], encoding_format="float").data[0].embedding
    nested = client.embeddings.create(model=MINILM, input=[[101, 7592, 102], [101, 102]], encoding_format="float")
    assert len(text) == 384 and np.allclose(text, ids, atol=1e-6)
    assert len(nested.data) == 2 and np.allclose(nested.data[0].embedding, text, atol=1e-6)
    short = client.embeddings.create(model=MINILM, input="hello", dimensions=48, encoding_format="float")
    vec = np.asarray(short.data[0].embedding)
    assert vec.shape == (48,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    assert np.allclose(vec, np.asarray(text[:48]) / np.linalg.norm(text[:48]), atol=1e-6)


def test_too_long_is_a_400_naming_the_limit(client, proxy):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MINILM, input=["short", "word " * 300])
    assert e.value.status_code == 400 and "limit of 256 tokens" in e.value.message
    # The proxy's `truncate` extension turns it into a truncated embedding instead.
    ok = httpx.post(proxy.url + "/v1/embeddings", json={"model": MINILM, "input": "word " * 300, "truncate": True},
                    timeout=30).json()
    assert ok["usage"]["prompt_tokens"] == 256


def test_routing_and_request_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MINILM, input=[])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MINILM, input="x", dimensions=385)
    assert [m.id for m in client.models.list().data] == [MINILM]


def test_score_and_rerank_are_the_cosine_similarity_sentence_transformers_gives(proxy):
    from sentence_transformers import SentenceTransformer, util

    query, docs = "A man is eating pasta.", SENTENCES[6:13]
    vectors = SentenceTransformer(minilm_path(), device="cpu").encode([query, *docs], convert_to_tensor=True)
    expected = util.cos_sim(vectors[:1], vectors[1:])[0].tolist()
    scored = httpx.post(proxy.url + "/score", json={"model": MINILM, "text_1": query, "text_2": docs}, timeout=30)
    body = scored.json()
    assert body["object"] == "list" and body["model"] == MINILM
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(len(docs))]
    assert np.allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(docs) * 2
    # Pair by pair: each text_1 against the text_2 at its index.
    pairs = httpx.post(proxy.url + "/v1/score", json={"model": MINILM, "text_1": [query, docs[0]],
                                                      "text_2": [docs[1], docs[1]]}, timeout=30).json()
    pair_expected = [expected[1], util.cos_sim(vectors[1:2], vectors[2:3]).item()]
    assert np.allclose([d["score"] for d in pairs["data"]], pair_expected, atol=1e-5)

    ranked = httpx.post(proxy.url + "/v1/rerank", json={"model": MINILM, "query": query, "documents": docs},
                        timeout=30).json()
    order = sorted(range(len(docs)), key=lambda i: -expected[i])
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["document"]["text"] for r in ranked["results"]] == [docs[i] for i in order]
    assert np.allclose([r["relevance_score"] for r in ranked["results"]], [expected[i] for i in order], atol=1e-5)
    assert ranked["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]  # the same texts, embedded once
    top = httpx.post(proxy.url + "/v2/rerank", json={"model": MINILM, "query": query, "documents": docs, "top_n": 2,
                                                     "return_documents": False}, timeout=30).json()
    assert [r["index"] for r in top["results"]] == order[:2] and "document" not in top["results"][0]


def test_score_and_rerank_errors_name_the_clients_field(proxy):
    def post(path, body):
        r = httpx.post(proxy.url + path, json={"model": MINILM, **body}, timeout=30)
        return r.status_code, r.json()["error"]

    status, error = post("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert status == 400 and error["param"] == "text_1" and "2 texts" in error["message"]
    status, error = post("/score", {"text_1": "a", "text_2": []})
    assert status == 400 and error["param"] == "text_2"
    status, error = post("/rerank", {"query": "a", "documents": ["short", "word " * 300]})
    assert status == 400 and error["param"] == "documents[1]" and "documents[1] has 302 tokens" in error["message"]
    status, error = post("/rerank", {"query": "a", "documents": []})
    assert status == 400 and error["param"] == "documents"
    status, error = post("/rerank", {"query": "a", "documents": ["b"], "model": "nope"})
    assert status == 404 and error["param"] == "model"
    ok = httpx.post(proxy.url + "/rerank", json={"model": MINILM, "query": "a", "documents": ["word " * 300],
                                                 "truncate": True}, timeout=30).json()
    assert ok["usage"]["total_tokens"] == 3 + 256  # [CLS] a [SEP], and the document cut to the model's limit
