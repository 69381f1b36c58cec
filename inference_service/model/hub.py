"""`--model org/name[@revision][:QUANT]`: a Hugging Face Hub model, downloaded into the hub's own cache.

`huggingface_hub` does the transfer, so its environment applies as everywhere else: `HF_TOKEN` (private and
gated repos), `HF_HUB_OFFLINE=1` (cache only), `HF_HOME`/`HF_HUB_CACHE` (where), `HF_ENDPOINT` (a mirror),
its progress bars, and resuming a file whose download was interrupted. What comes back is a local path the
ordinary loader reads: the snapshot folder of a safetensors checkpoint, or one `.gguf` file of a GGUF repo
(chosen by `--gguf-file NAME`, or by a quantization hint such as `org/name:Q4_K_M`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A repo id is `namespace/name` (letters, digits, `-`, `_`, `.`); then `@revision` and/or `:QUANT`.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+?))?(?::(?P<quant>[\w.-]+))?$")
# What a safetensors checkpoint needs, and nothing of the other formats a repo may also carry (.bin, .onnx).
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


class HubError(ValueError):
    """A hub model that cannot be had: unknown repo or revision, offline without it cached, no usable file."""


@dataclass(frozen=True, slots=True)
class HubModel:
    """A parsed `--model` hub id."""

    repo_id: str
    revision: str = "main"
    quant: str | None = None  # quantization hint picking a GGUF file, e.g. "Q4_K_M"


def parse_hub_id(model: str | None, revision: str | None = None) -> HubModel | None:
    """The hub model `model` names, or None when it is no hub id: unset, an existing path, or a short name.

    `revision` (`--revision`) applies where the id carries no `@revision`; both given is an error."""
    if not model or os.path.exists(model):
        return None
    match = _HUB_ID.match(model)
    if match is None:
        return None
    if match["revision"] and revision and match["revision"] != revision:
        raise HubError(f"--model {model!r} names revision {match['revision']!r} and --revision {revision!r}: give one")
    return HubModel(match["repo"], match["revision"] or revision or "main", match["quant"])


def pick_gguf(files: list[str], gguf_file: str | None, quant: str | None, repo_id: str) -> str | None:
    """The GGUF file of `files` to load: `gguf_file` by name, else the one `quant` names, else the only one;
    None when the repo has safetensors weights instead (and no GGUF was asked for)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if gguf_file is not None:
        if gguf_file in files:
            return gguf_file
        by_basename = [f for f in ggufs if f.rsplit("/", 1)[-1] == gguf_file]
        if len(by_basename) == 1:
            return by_basename[0]
        raise HubError(f"--gguf-file {gguf_file!r}: {repo_id} has no such file; its GGUF files: {_listing(ggufs)}")
    if quant is not None:
        bounded = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
        matches = [f for f in ggufs if bounded.search(f.rsplit("/", 1)[-1])]
        if len(matches) == 1:
            return matches[0]
        what = "no GGUF file" if not matches else "several GGUF files"
        raise HubError(f"quantization {quant!r}: {repo_id} has {what} of that type; "
                       f"its GGUF files: {_listing(matches or ggufs)} (pick one with --gguf-file)")
    if any(f.endswith(".safetensors") for f in files) and "config.json" in files:
        return None
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise HubError(f"{repo_id} has {len(ggufs)} GGUF files: pick one with --gguf-file NAME or "
                       f"--model {repo_id}:QUANT (e.g. :Q4_K_M); files: {_listing(ggufs)}")
    raise HubError(f"{repo_id} has neither safetensors weights with a config.json nor a GGUF file; "
                   f"files: {_listing(sorted(files))}")


def download_model(model: HubModel, gguf_file: str | None = None) -> str:
    """Local path of `model` after fetching what is missing from the cache (no network with HF_HUB_OFFLINE=1):
    a snapshot folder or a `.gguf` file. Raises `HubError` saying what is wrong."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{model.repo_id}@{model.revision}"
    try:
        files = _cached_files(model) if constants.HF_HUB_OFFLINE else _remote_files(model)
        chosen = pick_gguf(files, gguf_file, model.quant, model.repo_id)
        logger.info("model %s: %s from %s (cache %s)", where, chosen or "safetensors checkpoint",
                    "the cache" if constants.HF_HUB_OFFLINE else constants.ENDPOINT, constants.HF_HUB_CACHE)
        if chosen is not None:
            return hf_hub_download(model.repo_id, chosen, revision=model.revision)
        return snapshot_download(model.repo_id, revision=model.revision, allow_patterns=CHECKPOINT_PATTERNS)
    except GatedRepoError as e:
        raise HubError(f"model {model.repo_id} is gated: accept its terms on the hub and set HF_TOKEN ({e})") from None
    except RepositoryNotFoundError:
        raise HubError(f"model {model.repo_id!r}: no such repository on {constants.ENDPOINT} and no such local "
                       f"path (a private repo needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"model {model.repo_id}: no revision {model.revision!r} on {constants.ENDPOINT}") from None
    except LocalEntryNotFoundError:
        raise _not_cached(model) from None
    except HfHubHTTPError as e:
        raise HubError(f"model {where}: the hub at {constants.ENDPOINT} answered {e}") from None
    except OSError as e:  # connection refused, DNS, disk full
        raise HubError(f"model {where}: cannot download from {constants.ENDPOINT}: {e} "
                       f"(HF_HUB_OFFLINE=1 serves a model already in the cache)") from None


def _remote_files(model: HubModel) -> list[str]:
    from huggingface_hub import HfApi

    info = HfApi().model_info(model.repo_id, revision=model.revision)
    return [s.rfilename for s in info.siblings or []]


def _cached_files(model: HubModel) -> list[str]:
    """Files of `model`'s cached snapshot (offline); `HubError` when the cache has none."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=model.repo_id, repo_type="model"))
    commit = model.revision
    ref = os.path.join(storage, "refs", model.revision)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(storage, "snapshots", commit)
    if not os.path.isdir(snapshot):
        raise _not_cached(model)
    return [os.path.relpath(os.path.join(root, name), snapshot).replace(os.sep, "/")
            for root, _, names in os.walk(snapshot) for name in names]


def _not_cached(model: HubModel) -> HubError:
    from huggingface_hub import constants

    return HubError(f"model {model.repo_id}@{model.revision} is not in the cache {constants.HF_HUB_CACHE} and "
                    f"HF_HUB_OFFLINE=1 forbids downloading it: run once online (or unset HF_HUB_OFFLINE)")


def _listing(files: list[str], limit: int = 12) -> str:
    shown = ", ".join(files[:limit]) or "none"
    return shown + (f" and {len(files) - limit} more" if len(files) > limit else "")
