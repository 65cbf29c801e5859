"""The router's ASGI entry: its own endpoints are called directly, the rest goes to FastAPI.

Every kvrouter endpoint is a plain ``Request -> Response`` coroutine that reads the raw
body itself, so FastAPI's middleware stack (server-error, telemetry, body-limit,
exception, exit-stack) and Starlette's route matching did nothing for it but cost time:
with a null engine behind it, a minimal uvicorn + aiohttp proxy added 0.3 ms per request
and the router's stack alone about as much again, on every request. :class:`Endpoints`
looks the (method, path) up in a dict and calls the endpoint; anything else (lifespan,
HEAD, a wrong method, an unknown path) goes to the FastAPI app, which also owns start-up
and shutdown and knows the same routes (so a wrong method is a 405 there).

Errors keep one shape: a :class:`~router.errors.RouterError` becomes its OpenAI error
(counted in ``kvrouter_rejected_total``), and an unexpected exception is logged and
answered 500 in the same shape instead of Starlette's plain-text page. A
``RecursionError`` is the request's doing, not a bug: a body nested a few hundred levels
deep decodes, then exhausts the stack wherever it is walked next (hashing the messages,
rendering the template). It is a 400 and one log line, not a 500 with a traceback that
any client could repeat to fill the log.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router import metrics
from router.errors import BadRequest, RouterError, error_response

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


def answer_error(exc: RouterError) -> Response:
    metrics.child(metrics.REJECTED, str(exc.status), exc.code).inc()
    return error_response(exc)


async def _on_router_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    return answer_error(exc)


class Endpoints:
    """ASGI app: ``routes[(method, path)]`` directly, ``fallback`` for everything else."""

    def __init__(self, fallback: Starlette) -> None:
        self.fallback = fallback
        self.routes: dict[tuple[str, str], Endpoint] = {}
        fallback.add_exception_handler(RouterError, _on_router_error)

    @property
    def state(self) -> Any:
        return self.fallback.state

    def add(self, method: str, path: str, endpoint: Endpoint) -> None:
        self.routes[(method, path)] = endpoint
        self.fallback.add_route(path, endpoint, methods=[method])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.routes.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        if endpoint is None:
            await self.fallback(scope, receive, send)
            return
        try:
            response = await endpoint(Request(scope, receive))
        except RouterError as exc:
            response = answer_error(exc)
        except RecursionError:
            log.warning("%s %s: request nested too deeply", scope["method"], scope["path"])
            response = answer_error(BadRequest("request body is nested too deeply", code="invalid_json"))
        except Exception:  # noqa: BLE001 - a bug must still get an OpenAI-shaped answer
            log.exception("%s %s failed", scope["method"], scope["path"])
            response = answer_error(RouterError("internal error in the router"))
        await response(scope, receive, send)
