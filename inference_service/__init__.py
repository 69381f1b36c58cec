"""Continuous-batching LLM inference engine served over gRPC."""

import importlib.metadata

try:
    ENGINE_VERSION = importlib.metadata.version("inference-service")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    ENGINE_VERSION = "0.0.0+unknown"
