"""Continuous-batching LLM inference engine served over gRPC."""

import importlib.metadata
import os

# NOTE: torch's CPU ops run on libgomp, whose threads spin ~300,000 rounds after every parallel region
# before they sleep, on the cores the C++ kernels' own workers compute on next. One such op a decode step
# (the sampler's max over the vocabulary, since moved into the C++ kernels) made the embedded model's
# batch-1 step 11.4 ms instead of 7.7 on the 2-core machine (2026-11-27); sampled rows and prefill still
# run torch ops. Set before torch loads libgomp (it reads this once); a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

try:
    ENGINE_VERSION = importlib.metadata.version("inference-service")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    ENGINE_VERSION = "0.0.0+unknown"
