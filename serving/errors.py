"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status OpenAI uses, and the mapping from polyengine's typed errors.

The server raises :class:`APIError` wherever a request goes wrong; one exception
handler turns it into the response. This module imports nothing from the web stack.
"""

from __future__ import annotations

from typing import Any, Callable

from polyengine.errors import (
    ContextLengthExceeded, EngineClosed, EngineDead, InvalidRequest, QueueFull, UnsupportedFeature,
)

__all__ = ["APIError", "from_polyengine", "RETRY_AFTER_S"]

# A full queue drains as fast as requests finish; one second is a polite first retry.
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error response: status, OpenAI error type, the parameter at fault, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_polyengine(exc: BaseException, *, param_of: Callable[[str | None], str | None]) -> APIError:
    """The response for an error the driver raised.

    ``param_of`` maps the field the error names (``exc.field``: a SamplingParams field,
    ``"prompt"``, ``"messages"``) to the request parameter that set it (``top_logprobs``
    is ``logprobs`` on /v1/completions, ``prompt`` is ``messages`` on chat). The core
    decides what is wrong and with which field; the server only renames.
    """
    field = getattr(exc, "field", None)
    if isinstance(exc, QueueFull):
        return APIError(429, f"the server is at capacity: {exc}", type="rate_limit_error",
                        code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, UnsupportedFeature):
        return APIError(400, str(exc), param=param_of(field), code="unsupported_parameter")
    if isinstance(exc, ContextLengthExceeded):
        return APIError(400, str(exc), param=param_of(field), code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=param_of(field))
    if isinstance(exc, EngineDead):
        return APIError(503, f"the engine has failed and serves no more requests ({exc}); retry on another "
                             f"replica or after a restart", type="server_error", code="engine_dead")
    if isinstance(exc, EngineClosed):
        return APIError(503, "the server is shutting down; retry on another replica or later",
                        type="server_error", code="server_shutting_down")
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", type="server_error", code="engine_error")
