"""Domain exceptions of the router and their one mapping to OpenAI-shaped errors.

Errors are raised where they happen (parsing, tokenization, routing, upstream calls)
and turned into ``{"error": {"message", "type", "code"}}`` responses in exactly one
place, :func:`error_response`, so every path answers the same shape and status.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response


class RouterError(Exception):
    """Base of every error the router answers itself. Subclasses fix status/type/code."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    headers: dict[str, str] | None = None
    """Headers the answer carries (``Retry-After``)."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadRequest(RouterError):
    """Malformed JSON, non-UTF-8 bytes, missing or mistyped fields, or a prompt vLLM rejects."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class PromptTooLong(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(RouterError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(RouterError):
    """An admin endpoint while only the client key is configured (no admin key to open it)."""

    status = 403
    type = "invalid_request_error"
    code = "admin_disabled"


class UnknownModel(RouterError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class BodyTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class NoHealthyBackend(RouterError):
    status = 503
    type = "server_error"
    code = "no_healthy_backend"


class ShuttingDown(RouterError):
    """The router is draining (SIGTERM): it takes no new request, and one still running at
    the drain deadline is ended with this error."""

    status = 503
    type = "server_error"
    code = "shutting_down"


class Overloaded(RouterError):
    """The router's admission queue is full, or a request waited in it past its deadline
    (:mod:`router.admission`): try again after ``Retry-After`` seconds."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.headers = {"Retry-After": str(retry_after_s)}


class RateLimited(Overloaded):
    """A tenant went over one of its own limits (``router.tenants.<name>``): try again after
    ``Retry-After`` seconds."""

    code = "rate_limit_exceeded"


class ClientClosed(RouterError):
    """The client went away before the router sent its request on (nginx's 499): the
    answer reaches nobody, and nothing is logged as an error."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class UpstreamError(RouterError):
    """Every backend tried failed before answering (connect error, reset, 502/503).

    ``backend`` names the last backend tried, for the request metric's label. The message
    goes to the client: it names the backend as configured, never its address or the
    underlying exception (those go to the log and to ``/debug/backends``)."""

    status = 502
    type = "server_error"
    code = "upstream_error"

    def __init__(self, message: str, *, backend: str | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.backend = backend


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


_encoder = msgspec.json.Encoder()


def error_body(message: str, type_: str, code: str | int | None) -> bytes:
    return _encoder.encode({"error": {"message": message, "type": type_, "code": code}})


def error_response(exc: RouterError, headers: dict[str, str] | None = None) -> Response:
    """The single mapping from a domain exception to an HTTP answer."""
    return Response(
        error_body(exc.message, exc.type, exc.code),
        status_code=exc.status,
        media_type="application/json",
        headers={**(exc.headers or {}), **(headers or {})} or None,
    )
