"""Session-wide fixtures for model tests: the embedded SmolLM2 loaded once by us and once by HF."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # for `harness`

from inference_service.model.gguf_loader import plain_array_reader_class  # noqa: E402
from inference_service.model.loader import default_model_path, load_model  # noqa: E402

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Explain recursion in one sentence."}],
]
RAW_PROMPTS = [
    "def fibonacci(n):\n    ",
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "Les bases de données relationnelles",
]
NEW_TOKENS = 64


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """The model as served by default: its Q4_1 / Q8_0 weights run in their blocks on this CPU."""
    return load_model(smollm_path)


@pytest.fixture(scope="session")
def smollm_dequantized(smollm_path):
    """The same file expanded to float32 at load (`--dequantize`)."""
    return load_model(smollm_path, quantized_weights=False)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_path):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings(), hf_reads_gguf_fast():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(os.path.dirname(smollm_path),
                                                         gguf_file=os.path.basename(smollm_path))


@pytest.fixture(scope="session")
def smollm_prompts(smollm) -> list[list[int]]:
    """Token ids of the 8 reference prompts: 4 chat-templated, 4 raw text."""
    tok = smollm.tokenizer
    chats = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in CHAT_PROMPTS]
    return chats + [tok.encode(text) for text in RAW_PROMPTS]


@pytest.fixture(scope="session")
def hf_reference_tokens(smollm_path, smollm_prompts) -> list[list[int]]:
    """HF transformers' greedy continuation (fp32, CPU) of each prompt, all eight in one batch: a decode step
    reads the 135M weights once for eight (~15 s on this 2-core CPU against ~60 s one prompt at a time, which gave
    the same tokens for every prompt, 2026-11-29)."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings(), hf_reads_gguf_fast():
        warnings.simplefilter("ignore")
        transformers.utils.logging.disable_progress_bar()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        outputs = hf_greedy_batched(model, smollm_prompts, NEW_TOKENS)
    del model
    return outputs


@contextlib.contextmanager
def hf_reads_gguf_fast():
    """transformers reads a GGUF through gguf-py: ~35 s for the embedded model on this CPU, most of it the
    reader's `np.memmap` slicing and a tensor-name map built afresh per tensor. Here it reads the same bytes
    through the engine's plain-array reader and builds each map once (no effect where the names have moved)."""
    gguf = pytest.importorskip("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", plain_array_reader_class())
        if hasattr(gguf, "get_tensor_name_map"):
            patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """Plain argmax decoding with HF's KV cache: no logits processors, no stopping at EOS."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(num_tokens - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def hf_greedy_batched(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """`hf_greedy` of several prompts in one batch: left-padded, the padding masked out and each row's positions
    counted from its first real token."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])  # [B, W]
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])  # [B, W]
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, W]
    out = model(input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1)]  # [B] each
    for _ in range(num_tokens - 1):
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
        positions = positions[:, -1:] + 1
        out = model(tokens[-1][:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, 1).tolist()
