"""all-MiniLM-L6-v2 through our BERT + pooling + EmbeddingEngine against sentence-transformers."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from inference_service.engine.embedding_engine import EmbedOptions, create_embedding_engine
from inference_service.errors import InvalidRequestError
from inference_service.model.loader import load_model
from inference_service.model.pooling import pool
from tests.embeddings.emb_sentences import MINILM, MINILM_LIMIT, SENTENCES, minilm_path


@pytest.fixture(scope="module")
def minilm():
    return load_model(MINILM)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_path(), device="cpu")
    assert model.max_seq_length == MINILM_LIMIT
    return model


def make_engine(loaded, **kwargs):
    return create_embedding_engine(loaded, device=torch.device("cpu"), dtype=torch.float32, **kwargs)


async def embed(engine, inputs, **options):
    engine.start()
    try:
        return await engine.embed(inputs, EmbedOptions(**options))
    finally:
        await engine.stop()


def test_loader_reads_sentence_transformers_config(minilm):
    assert minilm.is_encoder and minilm.model_name == MINILM
    assert (minilm.pooling.mode, minilm.pooling.normalize, minilm.pooling.max_seq_length) == ("mean", True, 256)
    assert (minilm.config.model_type, minilm.config.hidden_size) == ("bert", 384)


def test_token_ids_match_sentence_transformers(minilm, reference):
    tok = minilm.tokenizer
    expected = reference.tokenizer(SENTENCES, truncation=True, max_length=MINILM_LIMIT)["input_ids"]
    assert [tok.encode(s, max_length=MINILM_LIMIT) for s in SENTENCES] == expected
    # The long ones really are truncated, keeping [SEP] last ("x" * 5000 is one over-long word: [UNK]).
    assert sum(len(ids) == MINILM_LIMIT and ids[-1] == 102 for ids in expected) == 4
    assert expected[-1] == [101, 100, 102]


async def test_cosine_against_sentence_transformers(minilm, reference):
    expected = torch.from_numpy(reference.encode(SENTENCES, batch_size=64, convert_to_numpy=True))
    result = await embed(make_engine(minilm), SENTENCES, truncate=True)
    cosine = F.cosine_similarity(result.embeddings, expected.float(), dim=1)
    worst = int(cosine.argmin())
    assert cosine.min() >= 0.9999, (worst, SENTENCES[worst][:40], float(cosine[worst]))
    assert torch.allclose(result.embeddings.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)
    assert result.num_tokens == [min(len(minilm.tokenizer.encode(s)), MINILM_LIMIT) for s in SENTENCES]
    assert result.prompt_tokens == sum(result.num_tokens)


async def test_batched_equals_one_by_one(minilm):
    engine = make_engine(minilm)
    engine.start()
    try:
        batched = await engine.embed(SENTENCES, EmbedOptions(truncate=True))
        # Concurrent single-input requests: the engine batches them together in any grouping.
        singles = await asyncio.gather(*(engine.embed([s], EmbedOptions(truncate=True)) for s in SENTENCES))
        for s in SENTENCES[:5]:
            alone = await engine.embed([s], EmbedOptions(truncate=True))
            torch.testing.assert_close(alone.embeddings[0], batched.embeddings[SENTENCES.index(s)],
                                       atol=2e-6, rtol=0)
    finally:
        await engine.stop()
    torch.testing.assert_close(torch.cat([r.embeddings for r in singles]), batched.embeddings, atol=2e-6, rtol=0)


async def test_token_id_input_equals_text_input(minilm):
    text = "Token ids are used exactly as given."
    ids = minilm.tokenizer.encode(text)
    by_text, by_ids = (await embed(make_engine(minilm), [text, ids])).embeddings
    torch.testing.assert_close(by_text, by_ids, atol=1e-6, rtol=0)


async def test_dimensions_truncate_and_renormalize(minilm):
    full = (await embed(make_engine(minilm), ["Matryoshka embeddings"])).embeddings[0]
    short = (await embed(make_engine(minilm), ["Matryoshka embeddings"], dimensions=64)).embeddings[0]
    assert short.shape == (64,)
    torch.testing.assert_close(short, full[:64] / full[:64].norm(), atol=1e-6, rtol=0)


async def test_normalize_false_returns_the_mean_pooled_states(minilm):
    raw = (await embed(make_engine(minilm), ["not normalized"], normalize=False)).embeddings[0]
    ids = torch.tensor(minilm.tokenizer.encode("not normalized"))
    from inference_service.model.bert import PackedBatch

    batch = PackedBatch.build([len(ids)], "cpu")
    torch.testing.assert_close(raw, minilm.model(ids, batch).mean(dim=0), atol=1e-6, rtol=0)
    assert abs(float(raw.norm()) - 1.0) > 0.1


@pytest.mark.parametrize("inputs, truncate, field, words", [
    (["word " * 300], False, "inputs[0]", ["302 tokens", "limit of 256 tokens", "truncate"]),
    (["ok", list(range(1000, 1300))], False, "inputs[1]", ["300 tokens", "limit of 256 tokens"]),
    ([[5, 30522]], True, "inputs[0].token_ids", ["30522", "vocabulary (size 30522)"]),
    (["fine", []], False, "inputs[1]", ["0 tokens"]),
    ([], False, "inputs", ["must not be empty"]),
])
async def test_invalid_inputs_name_the_problem(minilm, inputs, truncate, field, words):
    with pytest.raises(InvalidRequestError) as e:
        await embed(make_engine(minilm), inputs, truncate=truncate)
    assert e.value.field == field
    for word in words:
        assert word in e.value.message


async def test_too_long_token_ids_are_cut_with_truncate(minilm):
    result = await embed(make_engine(minilm), [list(range(1000, 1300))], truncate=True)
    assert result.num_tokens == [MINILM_LIMIT]


async def test_dimensions_larger_than_the_model_fail(minilm):
    with pytest.raises(InvalidRequestError) as e:
        await embed(make_engine(minilm), ["x"], dimensions=385)
    assert e.value.field == "dimensions" and "384" in e.value.message


def _padded_reference(hidden: torch.Tensor, lens: list[int], mode: str) -> torch.Tensor:
    """Pooling written over a padded [B, S, H] batch with a mask, as sentence-transformers does."""
    rows, start = [], 0
    max_len = max(lens)
    padded = torch.zeros(len(lens), max_len, hidden.shape[1], dtype=torch.float64)
    mask = torch.zeros(len(lens), max_len, 1, dtype=torch.float64)
    for i, n in enumerate(lens):
        padded[i, :n], mask[i, :n] = hidden[start:start + n].double(), 1
        start += n
    if mode == "mean":
        return (padded * mask).sum(1) / mask.sum(1)
    if mode == "max":
        return padded.masked_fill(mask == 0, float("-inf")).max(1).values
    if mode == "cls":
        return padded[:, 0]
    for i, n in enumerate(lens):
        rows.append(padded[i, n - 1])
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "last"])
def test_pool_matches_padded_reference(mode):
    lens = [1, 7, 3, 16, 2]
    hidden = torch.randn(sum(lens), 24)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    torch.testing.assert_close(pool(hidden, cu, mode).double(), _padded_reference(hidden, lens, mode),
                               atol=1e-6, rtol=0)
