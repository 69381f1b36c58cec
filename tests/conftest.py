"""Suite-wide setup: without a CUDA device the Triton kernels run in Triton's CPU interpreter.

NOTE: TRITON_INTERPRET is read when `triton.jit` decorates a function, and triton's own library
functions (`tl.sigmoid`, ...) are decorated when triton is first imported; so it must be set before
any test module imports triton (through `kernels` or `inference_service`). This conftest is the first
module pytest loads. Importing `kernels` afresh later instead would give two classes of every packed
weight type, and `isinstance` checks between the two copies fail."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
