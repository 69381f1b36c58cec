"""A BERT-family encoder (BertModel) for embeddings: packed tokens in, contextual hidden states out.

Parameters keep Hugging Face's names (`embeddings.word_embeddings.weight`,
`encoder.layer.3.attention.self.query.weight`, ...), so loading is a lookup. Like the decoder, the
forward pass works on a flat batch: every token-wise op (embeddings, projections, MLP, LayerNorm)
runs over the concatenated tokens [T, H] with no padding; only attention scatters them into a
padded [B, S] layout, because each sequence attends bidirectionally over itself alone::

    packed rows:  [ seq0 tok0..tok3 | seq1 tok0..tok1 | seq2 tok0..tok2 ]      T = 9
    padded rows:  seq0: t t t t   seq1: t t . .   seq2: t t t .             B = 3, S = 4
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.errors import UnsupportedModelError

# HF architecture names whose checkpoint holds a BertModel (possibly under a `bert.` prefix).
BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification")
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(slots=True)
class BertConfig:
    """The encoder's hyper-parameters, under Hugging Face's names."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    model_type: str = "bert"
    architecture: str = "BertModel"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(f"model config {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise UnsupportedModelError(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads})")
        if self.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"unsupported hidden_act {self.hidden_act!r} for BERT; supported: {sorted(_ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> BertConfig:
        """Build from a parsed HF `config.json` of model_type "bert"."""
        if raw.get("model_type") != "bert":
            raise UnsupportedModelError(f"not a BERT config (model_type {raw.get('model_type')!r})")
        architecture = (raw.get("architectures") or ["BertModel"])[0]
        if architecture not in BERT_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported encoder architecture {architecture!r}; supported: {list(BERT_ARCHITECTURES)}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"BERT with position_embedding_type={raw['position_embedding_type']!r} is not supported")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 512),
            type_vocab_size=raw.get("type_vocab_size", 2),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=raw.get("hidden_act", "gelu"),
            architecture=architecture,
        )


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _linear(in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    module = nn.Module()
    module.weight = _param(out_features, in_features, dtype=dtype, device=device)
    module.bias = _param(out_features, dtype=dtype, device=device)
    return module


def _layer_norm(dim: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    module = nn.Module()
    module.weight = _param(dim, dtype=dtype, device=device)
    module.bias = _param(dim, dtype=dtype, device=device)
    return module


@dataclass
class PackedBatch:
    """Where each sequence's tokens sit in the packed rows and in the padded attention layout."""

    cu_seqlens: list[int]  # [B + 1] cumulative lengths: sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1]
    pad_index: torch.Tensor  # [T] int64, row of each packed token in the [B * S] padded layout
    key_mask: torch.Tensor  # [B, 1, 1, S] bool, True = a real token
    max_len: int  # S

    @classmethod
    def build(cls, seq_lens: list[int], device: torch.device | str) -> PackedBatch:
        max_len = max(seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        cu = [0]
        for n in seq_lens:
            cu.append(cu[-1] + n)
        seq_of_row = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)  # [T]
        pos_of_row = torch.arange(cu[-1]) - torch.tensor(cu[:-1]).repeat_interleave(lens)  # [T]
        key_mask = torch.arange(max_len)[None, :] < lens[:, None]  # [B, S]
        return cls(cu, (seq_of_row * max_len + pos_of_row).to(device), key_mask[:, None, None, :].to(device), max_len)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """Position of each packed token within its sequence: [T] int64."""
        return torch.cat([torch.arange(self.cu_seqlens[i + 1] - self.cu_seqlens[i])
                          for i in range(self.num_seqs)]).to(device)


class BertLayer(nn.Module):
    """Post-norm transformer block: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, config: BertConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads, self.head_dim, self.eps = config.num_attention_heads, config.head_dim, eps
        self.act = _ACTIVATIONS[config.hidden_act]
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, _linear(h, h, dtype, device))
        self.attention.output = nn.Module()
        self.attention.output.dense = _linear(h, h, dtype, device)
        self.attention.output.LayerNorm = _layer_norm(h, dtype, device)
        self.intermediate = nn.Module()
        self.intermediate.dense = _linear(h, config.intermediate_size, dtype, device)
        self.output = nn.Module()
        self.output.dense = _linear(config.intermediate_size, h, dtype, device)
        self.output.LayerNorm = _layer_norm(h, dtype, device)

    def _attend(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Bidirectional attention of each sequence over itself: x [T, H] -> [T, H]."""
        num_tokens, hidden = x.shape
        attn = self.attention.self
        heads = []
        for proj in (attn.query, attn.key, attn.value):
            padded = x.new_zeros(batch.num_seqs * batch.max_len, hidden)  # [B * S, H]
            padded.index_copy_(0, batch.pad_index, F.linear(x, proj.weight, proj.bias))
            heads.append(padded.view(batch.num_seqs, batch.max_len, self.num_heads, self.head_dim).transpose(1, 2))
        # NOTE: padding queries see the real keys too (never an all-masked row, so never NaN); their
        # outputs are dropped by the gather below.
        out = F.scaled_dot_product_attention(*heads, attn_mask=batch.key_mask)  # [B, Hn, S, D]
        out = out.transpose(1, 2).reshape(batch.num_seqs * batch.max_len, hidden)
        return out.index_select(0, batch.pad_index)  # [T, H]

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        shape = x.shape[-1:]
        out, ln = self.attention.output.dense, self.attention.output.LayerNorm
        x = F.layer_norm(x + F.linear(self._attend(x, batch), out.weight, out.bias), shape, ln.weight, ln.bias,
                         self.eps)
        inter, out, ln = self.intermediate.dense, self.output.dense, self.output.LayerNorm
        h = self.act(F.linear(x, inter.weight, inter.bias))  # [T, I]
        return F.layer_norm(x + F.linear(h, out.weight, out.bias), shape, ln.weight, ln.bias, self.eps)


class BertModel(nn.Module):
    """`forward(input_ids [T], batch) -> hidden [T, hidden]`: last-layer states of packed sequences."""

    def __init__(self, config: BertConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        h = config.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Module()
        self.embeddings.word_embeddings.weight = _param(config.vocab_size, h, dtype=dtype, device=device)
        self.embeddings.position_embeddings = nn.Module()
        self.embeddings.position_embeddings.weight = _param(config.max_position_embeddings, h, dtype=dtype,
                                                            device=device)
        self.embeddings.token_type_embeddings = nn.Module()
        self.embeddings.token_type_embeddings.weight = _param(config.type_vocab_size, h, dtype=dtype, device=device)
        self.embeddings.LayerNorm = _layer_norm(h, dtype, device)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """input_ids [T] int64 (the sequences of `batch`, concatenated) -> hidden states [T, hidden]."""
        emb = self.embeddings
        positions = batch.positions(self.device)
        # Single-segment input: every token has token type 0.
        x = (emb.word_embeddings.weight.index_select(0, input_ids)
             + emb.position_embeddings.weight.index_select(0, positions)
             + emb.token_type_embeddings.weight[0])  # [T, H]
        x = F.layer_norm(x, x.shape[-1:], emb.LayerNorm.weight, emb.LayerNorm.bias, self.config.layer_norm_eps)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; the pooler and task heads are ignored.

        Every parameter must be covered; a wrong shape raises `UnsupportedModelError` naming the tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name not in params:
                continue  # pooler.*, cls.*, embeddings.position_ids: not used for embeddings
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise UnsupportedModelError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise UnsupportedModelError(f"checkpoint lacks weights: {', '.join(missing[:8])}")
