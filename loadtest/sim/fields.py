"""Request fields and errors as ``vllm serve`` checks and answers them, for every simulated endpoint.

Errors are OpenAI-shaped like vLLM's: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse


class ApiError(Exception):
    """A request vLLM refuses: answered with ``status`` in its error shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_json = msgspec.json.Encoder()


def _error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error(status, message, param), status_code=status)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return _json.encode(_error(status, message, param))


async def read_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"JSON decode error: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def int_field(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer", name)
    if value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}", name)
    return value


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return value
