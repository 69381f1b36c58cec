"""OpenAI-compatible REST proxy in front of the engine's gRPC API (see docs/proxy.md)."""
