"""Decoder embeddings: pooled hidden states equal Hugging Face's, and embedding beside generation
changes neither (the scratch KV cache never touches the generation cache)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry

from inference_service.config import CacheConfig, EngineConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.embedding_engine import EmbedOptions, create_embedding_engine
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.sampling_params import SamplingParams
from inference_service.metrics import EngineMetrics
from inference_service.model.loader import load_model
from tests.model.tiny_models import make_hf_model, save_hf_model

CPU = torch.device("cpu")
# Lengths around the block size (16): one token (a decode-shaped row), whole blocks, partial blocks.
LENGTHS = [1, 5, 16, 17, 40, 3]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A random Qwen3 folder that also carries a sentence-transformers config (last token, normalized)."""
    path = str(tmp_path_factory.mktemp("qwen3_embed"))
    hf = make_hf_model("qwen3", seed=3)
    save_hf_model(hf, path)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
                  f)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}, f)
    return hf, load_model(path)


def hf_hidden(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0]  # [S, H], final-normed


def token_inputs(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in LENGTHS]


async def run_embed(engine, inputs, **options):
    engine.start()
    try:
        return await engine.embed(inputs, EmbedOptions(**options))
    finally:
        await engine.stop()


@pytest.mark.parametrize("mode", [None, "mean"])
async def test_decoder_pooling_matches_hf(tiny_qwen3, mode):
    hf, loaded = tiny_qwen3
    assert (loaded.pooling.mode, loaded.pooling.normalize) == ("last", True)
    engine = create_embedding_engine(loaded, device=CPU, dtype=torch.float32, pooling_mode=mode)
    inputs = token_inputs()
    result = await run_embed(engine, inputs)
    for i, ids in enumerate(inputs):
        hidden = hf_hidden(hf, ids)
        expected = F.normalize(hidden.mean(0) if mode == "mean" else hidden[-1], dim=0)
        torch.testing.assert_close(result.embeddings[i], expected, atol=1e-5, rtol=0)
    assert result.num_tokens == LENGTHS


async def test_decoder_batched_equals_one_by_one(tiny_qwen3):
    _, loaded = tiny_qwen3
    engine = create_embedding_engine(loaded, device=CPU, dtype=torch.float32)
    engine.start()
    try:
        inputs = token_inputs(seed=1)
        batched = await engine.embed(inputs, EmbedOptions())
        singles = [await engine.embed([ids], EmbedOptions()) for ids in inputs]
    finally:
        await engine.stop()
    torch.testing.assert_close(torch.cat([s.embeddings for s in singles]), batched.embeddings, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def smollm():
    return load_model(None)


async def generate_greedy(engine: AsyncEngine, llm: LLMEngine, prompts: list[str]) -> list[list[int]]:
    async def one(i: int, prompt: str) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        request = llm.input_processor.process(f"g{i}", prompt, params)
        return [t async for delta in engine.generate(request) for t in delta.token_ids]

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def test_embedding_beside_generation_changes_neither(smollm):
    prompts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    texts = ["Retrieval needs embeddings.", "Paris is the capital of France. " * 20, "x"]
    llm = LLMEngine(EngineConfig(cache=CacheConfig(kv_cache_memory_mib=32)), loaded=smollm,
                    metrics=EngineMetrics("test", registry=CollectorRegistry()))
    engine = AsyncEngine(llm)
    embedder = create_embedding_engine(smollm, device=CPU, dtype=torch.float32, max_model_len=llm.max_model_len,
                                       generation_engine=engine)
    engine.start()
    embedder.start()
    try:
        alone_tokens = await generate_greedy(engine, llm, prompts)
        alone_embeddings = (await embedder.embed(texts, EmbedOptions())).embeddings
        together = await asyncio.gather(generate_greedy(engine, llm, prompts),
                                        *(embedder.embed([t], EmbedOptions()) for t in texts * 3))
    finally:
        await embedder.stop()
        await engine.stop()
    assert together[0] == alone_tokens
    for i, result in enumerate(together[1:]):
        torch.testing.assert_close(result.embeddings[0], alone_embeddings[i % len(texts)], atol=1e-5, rtol=0)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert alone_embeddings.shape == (3, 576)
