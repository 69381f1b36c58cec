"""`--load-format dummy`: a real architecture from a `config.json`, with random weights.

For benchmarking without checkpoints (nothing can be downloaded on the benchmark machines). The
folder needs only `config.json`; `bench/configs/` ships Llama-3-8B, Qwen3-8B and Qwen2.5-0.5B.

Weights: every matrix ~ N(0, 0.02²) from seeded CPU generators (one per 16M values, drawn on all
cores), then copied to the device: the same seed gives the same weights on the CPU and on a GPU (so
the two engines can be compared on any architecture). Biases 0, RMSNorm weights 1. The logits of
such a model are near-uniform noise: useful for speed and for engine-vs-engine checks, not for text.

Tokenizer: the folder's own `tokenizer.json` when it has one, else a byte-level tokenizer with a
ChatML template: the 256 bytes, `<|begin_of_text|>` = 256 and `<|end_of_text|>` = 257 (the eos), and
up to the model's vocabulary size a made-up word per id (" ab", "ac", ...). It encodes any text one
byte a token, so requests work end to end, and every id the model samples decodes to text, as with
a real vocabulary: output processing costs in a benchmark what it costs with a real model.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from inference_service.attention.backend import get_attention_backend
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.decoder import DecoderModel
from inference_service.model.tokenizer import _BYTE_ENCODER, Tokenizer

DUMMY_WEIGHT_STD = 0.02
_DRAW_CHUNK = 1 << 24  # values a generator draws
BYTE_BOS, BYTE_EOS = "<|begin_of_text|>", "<|end_of_text|>"
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def read_dummy_config(path: str) -> ModelConfig:
    """The `ModelConfig` of a folder holding `config.json` (or of that file itself)."""
    config_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UnsupportedModelError(f"--load-format dummy needs a config.json; {path!r} has none")
    with open(config_file, encoding="utf-8") as f:
        return ModelConfig.from_hf_dict(json.load(f))


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = DUMMY_WEIGHT_STD) -> None:
    """Fill every parameter in place: norms 1, biases 0, matrices N(0, std²) drawn in fp32 on the CPU
    (device-independent) and cast to the parameter's dtype on its device.

    Each run of `_DRAW_CHUNK` values of a matrix has its own generator, seeded from (seed, parameter
    index, chunk index): the values do not depend on the thread count, and the chunks are drawn on
    every core at once (one generator draws serially: 8B values took about a minute)."""
    jobs = []
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):  # tied weights appear once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                flat = param.view(-1)
                for chunk, start in enumerate(range(0, flat.numel(), _DRAW_CHUNK)):
                    jobs.append((flat[start:start + _DRAW_CHUNK], (seed * 1_000_003 + index) * 65_537 + chunk))

    def draw(job: tuple[torch.Tensor, int]) -> None:
        out, chunk_seed = job
        generator = torch.Generator().manual_seed(chunk_seed)
        values = torch.empty(out.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        with torch.no_grad():
            out.copy_(values)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(draw, jobs))  # list(): re-raises a worker's exception


def _made_up_word(token_id: int) -> str:
    """A distinct word of two or more letters for each id from 258, every other one after a space
    ("Ġ" in byte-level BPE)."""
    n, letters = token_id - 258 + 26, ""
    while n:
        n, digit = divmod(n, 26)
        letters = chr(ord("a") + digit) + letters
    return ("\u0120" if token_id % 2 == 0 else "") + letters


def byte_tokenizer(vocab_size: int = 258) -> Tokenizer:
    """A byte-level tokenizer needing no files: one token per byte, bos and eos, then a made-up
    word for each further id below `vocab_size`. Encoding yields bytes only (there are no merges)."""
    vocab = {_BYTE_ENCODER[b]: b for b in range(256)}
    vocab.update({BYTE_BOS: 256, BYTE_EOS: 257})
    vocab.update({_made_up_word(i): i for i in range(258, vocab_size)})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tok, normalized=False, special=True) for tok in (BYTE_BOS, BYTE_EOS)])
    return Tokenizer(backend, bos_token=BYTE_BOS, eos_token=BYTE_EOS, chat_template=_CHATML)


def load_dummy_model(path: str, *, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                     attention_backend: str = "auto", config: ModelConfig | None = None,
                     keep_plain_weights: bool = False):
    """(config, model, tokenizer, name) of the architecture at `path` with random weights.
    `keep_plain_weights`: projections keep their [out, in] weight (not CPU-packed), to be re-quantized."""
    config = config or read_dummy_config(path)
    backend = get_attention_backend(device, attention_backend)
    linear_cls = None
    if keep_plain_weights:
        from inference_service.model.fused_stack import GemvLinear  # noqa: PLC0415 - a DenseLinear that never packs

        linear_cls = GemvLinear
    model = DecoderModel(config, device=device, dtype=dtype, attention_backend=backend, linear_cls=linear_cls)
    init_dummy_weights(model, seed)
    model.finish_loading()  # norm scales; on the CPU the oneDNN layout, as after a real load
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    has_tokenizer = os.path.isfile(os.path.join(folder, "tokenizer.json"))
    tokenizer = Tokenizer.from_hf_dir(folder) if has_tokenizer else byte_tokenizer(config.vocab_size)
    return config, model, tokenizer, os.path.basename(os.path.normpath(folder)) + "-dummy"
