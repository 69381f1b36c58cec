"""Quantized-model tests run the Triton kernels: compiled on a CUDA device, else in the interpreter.

NOTE: TRITON_INTERPRET must be set before `kernels` (and so triton.jit) is imported; this conftest
is imported before the test modules of this folder (as in tests/kernels/conftest.py)."""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        del sys.modules[name]
