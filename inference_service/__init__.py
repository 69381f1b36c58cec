"""Continuous-batching LLM inference engine served over gRPC."""
