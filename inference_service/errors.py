"""Engine exceptions. Each carries the gRPC status code it maps to; the servicer's one
exception-mapping place (`inference_service.server.status_for`) turns them into statuses."""

from __future__ import annotations

import logging

import grpc

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """Base class: an error the engine reports to its client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def __reduce__(self):
        # NOTE: errors cross the engine core's process boundary pickled; the default keeps only `args`.
        return type(self), (self.message, self.field)


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


class EngineCoreDiedError(EngineError):
    """The engine core process ended; the server goes down with it (and is restarted)."""

    code = grpc.StatusCode.UNAVAILABLE


def as_engine_error(exc: BaseException) -> EngineError:
    """What the client is told about `exc`: an `EngineError` as it is; anything else is a bug, logged with
    its traceback and reported as INTERNAL."""
    if isinstance(exc, EngineError):
        return exc
    logger.error("unexpected error serving a request", exc_info=exc)
    return EngineError(f"internal error: {type(exc).__name__}: {exc}")


class UnsupportedModelError(ValueError):
    """The model's architecture, quantization type or dtype is not supported; raised at startup."""
