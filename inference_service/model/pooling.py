"""Pooling token states into one embedding per sequence, configured like sentence-transformers.

A sentence-transformers folder lists its modules in `modules.json`: a `Pooling` module whose
`config.json` picks the mode (`pooling_mode_mean_tokens`, `pooling_mode_cls_token`,
`pooling_mode_lasttoken`, ...), and optionally a `Normalize` module (L2 normalization). The
maximum input length comes from `sentence_bert_config.json` (`max_seq_length`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference_service.errors import UnsupportedModelError

POOLING_MODES = ("mean", "cls", "last", "max")
# sentence-transformers Pooling config key -> our mode.
_ST_MODE_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": None,  # not supported
    "pooling_mode_weightedmean_tokens": None,
}


@dataclass(slots=True)
class PoolingConfig:
    """How token states become an embedding: `mode`, then L2 `normalize` by default."""

    mode: str = "mean"
    normalize: bool = True
    # Longest input in tokens the model was trained for (sentence-transformers' max_seq_length); None = no
    # limit besides the model's position embeddings.
    max_seq_length: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise UnsupportedModelError(f"unsupported pooling mode {self.mode!r}; supported: {list(POOLING_MODES)}")

    @classmethod
    def from_model_dir(cls, path: str) -> PoolingConfig | None:
        """The folder's sentence-transformers configuration, or None when it has no `modules.json`."""
        modules_file = os.path.join(path, "modules.json")
        if not os.path.isfile(modules_file):
            return None
        with open(modules_file, encoding="utf-8") as f:
            modules = json.load(f)
        pooling_dir = next((m.get("path", "") for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
        mode = "mean"  # sentence-transformers' default when a folder has no Pooling module
        if pooling_dir is not None:
            with open(os.path.join(path, pooling_dir, "config.json"), encoding="utf-8") as f:
                mode = _mode_from_st_config(json.load(f))
        max_seq_length = None
        st_config = os.path.join(path, "sentence_bert_config.json")
        if os.path.isfile(st_config):
            with open(st_config, encoding="utf-8") as f:
                max_seq_length = json.load(f).get("max_seq_length")
        return cls(mode=mode, normalize=normalize, max_seq_length=max_seq_length)


def _mode_from_st_config(raw: dict) -> str:
    chosen = [key for key in _ST_MODE_KEYS if raw.get(key)]
    if "pooling_mode" in raw and not chosen:  # newer configs may name the mode directly
        name = {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}.get(raw["pooling_mode"],
                                                                                    raw["pooling_mode"])
        return PoolingConfig(mode=name).mode
    if len(chosen) != 1 or _ST_MODE_KEYS[chosen[0]] is None:
        raise UnsupportedModelError(
            f"unsupported sentence-transformers pooling {chosen or 'none'}; one of mean, cls, last token or max "
            f"is supported")
    if raw.get("include_prompt") is False:
        raise UnsupportedModelError("pooling with include_prompt=false is not supported")
    return _ST_MODE_KEYS[chosen[0]]


def pool(hidden: torch.Tensor, cu_seqlens: list[int], mode: str) -> torch.Tensor:
    """hidden [T, H] of packed sequences (sequence i = rows cu_seqlens[i]:cu_seqlens[i+1]) -> [B, H] float32."""
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    if mode == "cls":
        return hidden[starts].float()
    if mode == "last":
        return hidden[[end - 1 for end in ends]].float()
    lengths = torch.tensor([e - s for s, e in zip(starts, ends)], device=hidden.device)
    if mode == "max":
        return torch.segment_reduce(hidden.float(), "max", lengths=lengths)
    seq_of_row = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), lengths)  # [T]
    sums = torch.zeros(len(starts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq_of_row, hidden.float())
    return sums / lengths[:, None].float()


def finish_embeddings(pooled: torch.Tensor, normalize: bool, dimensions: int = 0) -> torch.Tensor:
    """Matryoshka truncation to the first `dimensions` values (0 keeps all), then L2 normalization.

    pooled [N, H] -> [N, dimensions or H]. Normalizing after truncation is what makes a truncated
    Matryoshka embedding a unit vector again."""
    if dimensions:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, p=2, dim=1) if normalize else pooled
