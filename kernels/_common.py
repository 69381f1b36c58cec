"""Small helpers shared by the kernel launchers: argument checks and device facts."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch), Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8_DTYPE)
ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (read at call time, not import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The interpreter runs a launch's programs one after another, every op a Python call on numpy arrays: a launch
# costs ~1 ms an op a program, nearly whatever the tile's size (the CPU suite's quantized model tests spent 2/3 of
# their time in GEMV launches of 16-256 programs of 2-16 columns).
INTERPRETED_BLOCK_N = 128


def interpreted_block_n(block_n: int, n: int) -> int:
    """A GEMV's column tile: `block_n`, or under Triton's interpreter up to INTERPRETED_BLOCK_N (all of n when it
    fits), so that a launch runs few programs. Only for kernels in which each output column is summed by one
    program in an order the column tile does not change: the results stay bit for bit those of `block_n`."""
    if not is_interpreter():
        return block_n
    return max(block_n, min(INTERPRETED_BLOCK_N, next_pow2(n)))


def require(cond: bool, msg: str | Callable[[], str]) -> None:
    """Raises ValueError(msg) unless `cond`. A message that formats values comes as a lambda: these checks run
    on every eager launch, and an f-string would be formatted each time, failing or not (~90 us a Triton
    launch of a 1k prefill step went to wrappers, the checks' messages first)."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def require_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype {t.dtype} not in {allowed}")


def require_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.shape != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {tuple(shape)}")


def require_same_device(**tensors: torch.Tensor) -> None:
    # get_device() is an int (-1 on the CPU): no torch.device built a tensor
    if len({t.get_device() for t in tensors.values()}) != 1:
        raise ValueError(f"tensors on different devices: { {k: str(v.device) for k, v in tensors.items()} }")


def require_inner_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride {t.stride(-1)})")


def dot_precision(dtype: torch.dtype) -> str:
    # NOTE: tl.dot on fp32 operands uses tf32 by default on the GPU (~3e-4 relative error); the
    # fp32 path is the reference-quality path, so it asks for full IEEE products.
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device; a nominal 132 (H100) elsewhere."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; cached (launchers ask on every call)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def is_hopper_or_later(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or more (228 KiB of shared memory a multiprocessor); cached."""
    return device.type == "cuda" and compute_capability(device) >= (9, 0)


def dot_upcast() -> bool:
    """Whether tl.dot operands must be upcast to fp32 first.

    NOTE: the Triton interpreter computes bf16 tl.dot wrongly (numpy has no bf16), so there
    operands are upcast; the values (and the fp32 accumulation) stay those of the GPU path."""
    return is_interpreter()


@triton.jit
def mma(a, b, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)


# NOTE: read once at import, like triton.jit itself reads TRITON_INTERPRET when it decorates.
_INTERPRETED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """x.to(DTYPE), rounding to nearest even.

    NOTE: the interpreter's fp32 -> bf16 cast truncates; there the rounding is done on the bits
    (finite values), so interpreted results round as the GPU's do."""
    if _INTERPRETED and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & -65536
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def fp16_operand(q, sm_scale):
    """q as fp16 for dots against an fp8 K/V cache, and the score scale that undoes its scaling.

    NOTE: e4m3 widens to fp16 in one instruction, to bf16 only through fp32 (a quarter-rate
    conversion that made fp8 decode slower than bf16), so fp8 K/V meet q in fp16. q is scaled
    so that its largest element is 2**14: fp16 cannot overflow, and keeps more bits than bf16."""
    q32 = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(q32), 1), 0)
    q_mul = tl.where(amax > 0.0, 16384.0 / amax, 1.0)
    return (q32 * q_mul).to(tl.float16), sm_scale / q_mul


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions  # noqa: PLC0415 - CUDA machines only

    return (gdc_wait is not None and "launch_pdl" in CUDAOptions.__dataclass_fields__
            and torch.cuda.get_device_capability(index) >= (9, 0))


def pdl_args(device: torch.device) -> dict:
    """Launch arguments for a kernel that starts with `pdl_enter(USE_PDL)`.

    On Hopper and later a kernel launched with programmatic dependent launch is scheduled while
    the previous kernel's last programs still run, and waits in `pdl_enter` for its results: a
    decode step's ~300 small kernels lose most of their launch gaps. `KERNELS_PDL=0` turns it off."""
    on = (device.type == "cuda" and not is_interpreter() and os.environ.get("KERNELS_PDL", "1") != "0"
          and _pdl_capable(device.index if device.index is not None else torch.cuda.current_device()))
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


# Element-wise kernels (norms, SiLU) launch with PDL up to this many rows, a decode step's, where the launch gap
# is most of a norm's cost (H200, fp8 weights, whose layers launch two norms and a SiLU each: batch-1 decode
# 288.3 -> 302.2 tok/s; offline 384 sequences 14,337 -> 14,388). Larger grids keep the plain launch, as the
# GEMMs do: a big dependent grid's waiting programs would hold multiprocessors the one before still needs.
PDL_MAX_ROWS = 512


def pdl_launch_args(device: torch.device, num_rows: int) -> dict:
    """`pdl_args` for an element-wise kernel over `num_rows` rows: PDL up to PDL_MAX_ROWS rows."""
    return pdl_args(device) if num_rows <= PDL_MAX_ROWS else {"USE_PDL": False}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """In a kernel launched with `pdl_args`, before its first read of anything the previous kernel
    writes and before its first write: wait for the previous kernel's results (and the end of its
    reads), then let the next kernel be scheduled. Reads of what no kernel of the step writes (weights,
    the host's block tables) may come first, overlapping the previous kernel's tail."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
