"""The router's ASGI entry: its own endpoints are called directly, the rest goes to FastAPI.

Every kvrouter endpoint is a plain ``Request -> Response`` coroutine that reads the raw
body itself, so FastAPI's middleware stack (server-error, telemetry, body-limit,
exception, exit-stack) and Starlette's route matching did nothing for it but cost time:
with a null engine behind it, a minimal uvicorn + aiohttp proxy added 0.3 ms per request
and the router's stack alone about as much again, on every request. :class:`Endpoints`
looks the (method, path) up in a dict and calls the endpoint; anything else (lifespan,
HEAD, a wrong method, an unknown path) goes to the FastAPI app, which also owns start-up
and shutdown and knows the same routes (so a wrong method is a 405 there). Every request,
either way, is :class:`~router.http.observe.Observed`: its id, TTFT, duration, tokens and
access-log line (and, with tracing on, its spans; probes and scrapes are never traced).

Errors keep one shape: a :class:`~router.http.errors.RouterError` becomes its OpenAI error
(counted in ``kvrouter_rejected_total``), and an unexpected exception is logged and
answered 500 in the same shape instead of Starlette's plain-text page, on either path
(the fallback calls the endpoints through the same guard). Starlette's own answers, an
unknown path (404) or a method the path does not take (405), are OpenAI-shaped too. A
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
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router import metrics
from router.http.errors import BadRequest, RouterError, error_body, error_response
from router.http.observe import Observed, access_log_on

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]
UNLOGGED_PATHS = frozenset(("/health", "/livez", "/readyz", "/metrics"))
"""Probes and scrapes: every request gets its id, but these get no access-log line (they would drown it)."""


def answer_error(exc: RouterError) -> Response:
    metrics.child(metrics.REJECTED, str(exc.status), exc.code).inc()
    return error_response(exc)


async def _on_router_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    return answer_error(exc)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _on_http_error(_: Request, exc: Exception) -> Response:
    """Starlette's answers (no such path, a method the path does not take) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "invalid_request")
    metrics.child(metrics.REJECTED, str(exc.status_code), code).inc()
    return Response(error_body(exc.detail, "invalid_request_error", code), status_code=exc.status_code,
                    headers=exc.headers, media_type="application/json")


async def answer(endpoint: Endpoint, request: Request) -> Response:
    """``endpoint(request)``, with every exception it raises turned into an OpenAI error."""
    try:
        return await endpoint(request)
    except RouterError as exc:
        return answer_error(exc)
    except RecursionError:
        log.warning("%s %s: request nested too deeply", request.scope["method"], request.scope["path"])
        return answer_error(BadRequest("request body is nested too deeply", code="invalid_json"))
    except Exception:  # noqa: BLE001 - a bug must still get an OpenAI-shaped answer
        log.exception("%s %s failed", request.scope["method"], request.scope["path"])
        return answer_error(RouterError("internal error in the router"))


class Endpoints:
    """ASGI app: ``routes[(method, path)]`` directly, ``fallback`` for everything else."""

    def __init__(self, fallback: Starlette, observer: type[Observed] = Observed) -> None:
        self.fallback = fallback
        self.access_log = access_log_on()
        self.observer = observer
        """What each request but a probe is observed as: :class:`Observed`, or with tracing on
        its subclass that also makes the request's spans (chosen once, so tracing off costs
        nothing per request)."""
        self.routes: dict[tuple[str, str], Endpoint] = {}
        fallback.add_exception_handler(RouterError, _on_router_error)
        fallback.add_exception_handler(HTTPException, _on_http_error)

    @property
    def state(self) -> Any:
        return self.fallback.state

    def add(self, method: str, path: str, endpoint: Endpoint) -> None:
        self.routes[(method, path)] = endpoint

        async def guarded(request: Request) -> Response:
            return await answer(endpoint, request)

        self.fallback.add_route(path, guarded, methods=[method])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)
            return
        if scope["path"] in UNLOGGED_PATHS:
            observed = Observed(scope, send, False)
        else:
            observed = self.observer(scope, send, self.access_log)
        try:
            endpoint = self.routes.get((scope["method"], scope["path"]))
            if endpoint is None:
                await self.fallback(scope, receive, observed.send)
                return
            response = await answer(endpoint, Request(scope, receive))
            await response(scope, receive, observed.send)
        finally:
            observed.finish()
