"""Engine exceptions. Each carries the gRPC status code it maps to; the servicer's one
exception-mapping place (`inference_service.server.status_for`) turns them into statuses."""

from __future__ import annotations

import grpc


class EngineError(Exception):
    """Base class: an error the engine reports to its client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequestError(EngineError, ValueError):
    """A request parameter is wrong; `field` names it (for example "sampling.top_p")."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhaustedError(EngineError):
    """The engine cannot take the request now (waiting queue full)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnimplementedError(EngineError):
    """The served model cannot do what was asked (for example embeddings from a generative model)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class ShuttingDownError(EngineError):
    """The engine is draining and takes no new requests."""

    code = grpc.StatusCode.UNAVAILABLE


class UnsupportedModelError(ValueError):
    """The model's architecture, quantization type or dtype is not supported; raised at startup."""
