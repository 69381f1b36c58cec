"""Continuous-batching LLM inference engine served over gRPC."""

import importlib.metadata
import os

# NOTE: torch's CPU ops run on libgomp, whose threads spin ~300,000 rounds after every parallel region
# before they sleep. A decode step on the CPU runs a few such ops (the sampler's argmax over the
# vocabulary) between the C++ kernels, whose own workers then share the cores with a spinning thread:
# the embedded model's batch-1 step took 11.4 ms instead of 7.7, 16 sequences 27 ms instead of 24, on
# the 2-core machine (2026-11-27). Set before torch loads libgomp (it reads this once); a value the
# user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

try:
    ENGINE_VERSION = importlib.metadata.version("inference-service")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    ENGINE_VERSION = "0.0.0+unknown"
