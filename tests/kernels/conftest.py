"""Kernel tests run compiled on a CUDA device when there is one, else in Triton's CPU interpreter.

NOTE: TRITON_INTERPRET must be set before `kernels` (and so triton.jit) is imported; conftest.py
is imported before the test modules of this folder, so it is set here.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # A module collected earlier may have imported `kernels` compiled-mode: import it afresh.
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        del sys.modules[name]

try:
    import kernels  # noqa: F401
except ImportError:  # plain `pytest` run from elsewhere: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
