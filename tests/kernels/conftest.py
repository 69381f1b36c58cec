"""Kernel tests run compiled on a CUDA device when there is one, else in Triton's CPU interpreter
(set up by tests/conftest.py, before anything imports triton)."""

import sys
from pathlib import Path

try:
    import kernels  # noqa: F401
except ImportError:  # plain `pytest` run from elsewhere: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
