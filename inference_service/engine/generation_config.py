"""Server-side sampling defaults: the checkpoint's `generation_config.json` and the operator's overrides.

As vLLM: a request field the client leaves unset takes the checkpoint's recommended value (Qwen3's
`temperature: 0.6, top_p: 0.95, top_k: 20`, ...) instead of the OpenAI default; a field the client sets
always wins. `--generation-config auto` reads the model folder's file (a GGUF: its `general.sampling.*`
metadata), a folder path reads that folder's file, `none` reads nothing; `--override-generation-config`
(a JSON object) is laid over whatever was read, and works with `none` too.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> our field (vLLM reads the same keys; max_new_tokens is the default max_tokens).
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# Overrides may set these too (vLLM passes any SamplingParams field through; these are the defaults we keep).
_OVERRIDE_KEYS = {**_HF_KEYS, "max_tokens": "max_tokens", "frequency_penalty": "frequency_penalty",
                  "presence_penalty": "presence_penalty"}
# A GGUF's `general.sampling.*` keys (written by llama.cpp's converter from generation_config.json).
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Values for the sampling fields a request leaves unset; None: the API's own default.

    Raises `ValueError` naming the key when a value is out of the range the request field allows."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 keeps all tokens
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        checks = {
            "temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1, "min_p": lambda v: 0 <= v <= 1,
            "repetition_penalty": lambda v: v > 0, "frequency_penalty": lambda v: -2 <= v <= 2,
            "presence_penalty": lambda v: -2 <= v <= 2,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and math.isfinite(value) and ok(value)):
                raise ValueError(f"generation config: {name} = {value!r} is out of range")
        if self.top_k is not None and not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"generation config: top_k = {self.top_k!r} must be an integer >= 0")
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"generation config: max_tokens = {self.max_tokens!r} must be an integer >= 1")

    def get(self, name: str, fallback: Any) -> Any:
        """The default of field `name`, else `fallback` (the API's own default)."""
        value = getattr(self, name)
        return fallback if value is None else value

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_override(text: str | None) -> dict[str, Any]:
    """`--override-generation-config`'s JSON object; `ValueError` for bad JSON or an unknown key."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--override-generation-config must be a JSON object, got {text!r}")
    unknown = sorted(set(value) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(_OVERRIDE_KEYS))}")
    return value


def read_checkpoint_defaults(source: str, model_path: str, gguf_metadata: dict[str, Any] | None = None
                             ) -> dict[str, Any]:
    """The sampling defaults `--generation-config source` names for the model at `model_path`, keyed by our
    field names: "none" -> {}; "auto" -> the model folder's `generation_config.json` (a GGUF: its
    `general.sampling.*` metadata, from `gguf_metadata` when the loader read it already: parsing a GGUF's
    vocabulary takes seconds); else `source` is a folder holding `generation_config.json`."""
    if source == "none":
        return {}
    if source != "auto":
        path = os.path.join(source, GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config {source!r}: no {GENERATION_CONFIG_FILE} in that folder")
        return _read_json(path)
    if os.path.isdir(model_path):
        path = os.path.join(model_path, GENERATION_CONFIG_FILE)
        return _read_json(path) if os.path.isfile(path) else {}
    if model_path.endswith(".gguf") and os.path.isfile(model_path):
        metadata = gguf_metadata if gguf_metadata is not None else _read_gguf(model_path)
        return {ours: metadata[key] for key, ours in _GGUF_KEYS.items() if key in metadata}
    return {}


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    # NOTE: transformers' `do_sample: false` means greedy, whatever temperature the file also lists.
    out = {_HF_KEYS[k]: v for k, v in raw.items() if k in _HF_KEYS and v is not None}
    if raw.get("do_sample") is False:
        out = {k: v for k, v in out.items() if k not in ("temperature", "top_p", "top_k", "min_p")}
    return out


def _read_gguf(path: str) -> dict[str, Any]:
    from inference_service.model.gguf_loader import open_gguf_reader

    reader = open_gguf_reader(path)
    return {key: reader.fields[key].contents() for key in _GGUF_KEYS if key in reader.fields}


def load_generation_defaults(source: str, model_path: str, override: dict[str, Any] | None = None,
                             gguf_metadata: dict[str, Any] | None = None) -> GenerationDefaults:
    """The defaults in force: the checkpoint's (per `source`) with `override` laid over them."""
    values = read_checkpoint_defaults(source, model_path, gguf_metadata)
    values.update({_OVERRIDE_KEYS[k]: v for k, v in (override or {}).items()})
    known = {f.name for f in fields(GenerationDefaults)}
    return GenerationDefaults(**{k: v for k, v in values.items() if k in known})
