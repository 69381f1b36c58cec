"""Building and loading the CPU kernels' C++ extension (the sources beside this file).

The extension is compiled by the project's install step (`python -m inference_service.cpu_kernels.quant`,
run by `make`) with the machine's gcc, never downloaded; `load_extension()` compiles it on first use
otherwise, and returns None where that fails (callers then keep weights dequantized).

NOTE: why not `torch.utils.cpp_extension.load` alone: it builds in one shared folder per module name under a
file lock, and rebuilds whenever the sources' paths differ (two checkouts of the same code, a test clone). A
builder killed mid-build leaves the lock behind and every later start waits on it forever; two checkouts
rebuild each other's module in turn. Here the module's name is a digest of what it is built from (sources,
flags, torch and Python versions), a finished module is imported straight from its file with no lock, and a
build happens in a folder of its own whose result is moved into place atomically.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name) for name in (
    "quant_matmul.cpp", "quant_avx512.cpp", "quant_amx.cpp", "norm_rope.cpp", "decode_attention.cpp",
    "decode_attention_avx512.cpp", "decoder_layer.cpp", "argmax.cpp", "worker_pool.cpp", "bindings.cpp")]
_HEADERS = [os.path.join(_HERE, name) for name in ("ops.h", "quant_blocks.h", "worker_pool.h", "decoder_layer.h",
                                                   "attention_pair.h")]
_CFLAGS = ["-O3", "-fopenmp-simd"]  # `omp simd` loops only: threads come from worker_pool.cpp
_STALE_BUILD_S = 3600  # build folders older than this were left by builders that died

_lock = threading.Lock()
_extension = None
_load_failed = False


def extension_name() -> str:
    """The module's name: a digest of its sources, flags and the torch and Python it is built against, so
    checkouts with different sources (or an upgrade) never load or overwrite each other's build."""
    digest = hashlib.sha256(" ".join([*_CFLAGS, torch.__version__, sys.version]).encode())
    for path in [*_SOURCES, *_HEADERS]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"inference_service_cpu_kernels_{digest.hexdigest()[:16]}"


def _cache_dir() -> str:
    from torch.utils import cpp_extension  # noqa: PLC0415 - pulls in setuptools; only when building or loading

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return os.path.join(root, "inference_service")


def _import_module(name: str, path: str):
    spec = importlib.util.spec_from_loader(name, importlib.machinery.ExtensionFileLoader(name, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, cache_dir: str) -> str:
    """Compile the module in a fresh folder and move it to `cache_dir/<name>.so`; returns that path."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    for stale in glob.glob(os.path.join(cache_dir, "build-*")):
        if time.time() - os.path.getmtime(stale) > _STALE_BUILD_S:
            shutil.rmtree(stale, ignore_errors=True)
    build_dir = tempfile.mkdtemp(prefix="build-", dir=cache_dir)
    try:
        cpp_extension.load(name=name, sources=_SOURCES, extra_cflags=_CFLAGS, build_directory=build_dir,
                           verbose=False)
        target = os.path.join(cache_dir, f"{name}.so")
        staged = os.path.join(build_dir, f"{name}.staged")
        shutil.copyfile(os.path.join(build_dir, f"{name}.so"), staged)
        os.replace(staged, target)  # atomic: a concurrent loader sees the whole file or none
        return target
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def load_extension():
    """The compiled extension, building it on first use; None if this machine cannot build it."""
    global _extension, _load_failed
    with _lock:
        if _extension is None and not _load_failed:
            try:
                name, cache_dir = extension_name(), _cache_dir()
                os.makedirs(cache_dir, exist_ok=True)
                path = os.path.join(cache_dir, f"{name}.so")
                if not os.path.exists(path):
                    logger.info("compiling the CPU kernels (once per source version; `make` does it at install)")
                    path = _build(name, cache_dir)
                _extension = _import_module(name, path)
            except Exception as exc:  # no compiler, no headers: serve dequantized instead
                logger.warning("cannot build the CPU kernels extension (%s); GGUF weights will be "
                               "dequantized at load", exc)
                _load_failed = True
        return _extension


def cpu_ops_for(tensor: torch.Tensor):
    """The extension, for a layer whose float32 CPU tensors its norm and rotary ops take; else None."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        return None
    return load_extension()
