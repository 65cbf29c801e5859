"""Stage 7 of the request path, *send*: the original bytes to an engine, its answer relayed to the client.

:class:`ProxyResponse` is an ASGI response that does the whole upstream exchange while
watching the client connection. Each try is an :class:`~router.attempt.Attempt`, which
owns what the try accounts for (the load ticket, the policy's commit, the backend's
health and failure metrics, the in-flight entry a dead backend or the drain deadline
aborts, the upstream connection); the proxy sends, relays bytes and frames SSE:

- it tries the decision's backends in order; a connect error, a connection closed
  before any response byte, or a 502/503 answer moves to the next backend (at most
  ``retries`` times). Nothing is retried once a response byte has been received, so a
  request is never generated twice for one client;
- the response is relayed chunk by chunk as it arrives (``iter_any``: whatever bytes
  the socket delivered, no buffering, no re-encoding) for streams, and in one piece for
  non-streamed answers;
- a client disconnect cancels the work: the attempt ends, its upstream response is
  closed, which closes its connection, which makes vLLM abort the request;
- a backend found dead (connection refused) aborts the requests waiting on it
  (:meth:`router.fleet.backends.BackendState.abort_in_flight`): 502, or a stream error event;
  the router's drain deadline (SIGTERM, ``router.drain_timeout_s``) ends what still runs
  the same way, with 503 or an error event coded ``shutting_down``.

A failure after the response started cannot change its status: an SSE stream gets a
final error event in its API's shape (``data: {"error": ...}``, what vLLM itself sends, or
Anthropic's ``event: error``) and is then closed. The stream is relayed whole events at a
time so that this event is one of its own, and one that ends without its API's last event
(``[DONE]``, or ``response.completed`` for the Responses API) gets it too, never a silent
200 (:mod:`router.http.sse`).

A request whose backend may not hold what it names (a ``/v1/responses`` follow-up whose
engine the router does not know: :mod:`router.http.responses`) moves on to the next backend
on a 404 as well (``Upstream.not_found_moves``), and its answer is read as it passes
(``Upstream.watch``) for the id of the response it creates.

Headers cross in both directions through allow-lists, so hop-by-hop headers
(``Connection``, ``Keep-Alive``, ``Transfer-Encoding``, ``TE``, ``Upgrade``,
``Proxy-Authorization`` ...) and anything a client sends as ``x-kvrouter-*`` never reach
an engine, and an engine's never reach the client; a header the other side's
``Connection`` names is hop-by-hop too (RFC 9110 §7.6.1) and is dropped. A client's
``Authorization`` reaches an engine only with ``router.forward_client_authorization``;
an engine's own key (``backends[].api_key``) is on its session. Error messages name
the backend as configured; addresses and exception details go to the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router import metrics
from router.attempt import BACKEND_DOWN, SHUTTING_DOWN, Attempt, Attempts
from router.fleet.backends import BackendPool
from router.http import observe
from router.http.errors import RouterError, ShuttingDown, UpstreamError, UpstreamTimeout, error_body, error_response
from router.http.sse import OPENAI, Dialect, EventCut
from router.fleet.load import LoadTracker

if TYPE_CHECKING:
    from router.http.responses import ResponseIds

log = logging.getLogger(__name__)

FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "x-request-id", "traceparent", "user-agent")
RELAYED_RESPONSE_HEADERS = frozenset((b"content-type", b"x-request-id", b"cache-control"))
BACKEND_HEADER = b"x-kvrouter-backend"
REASON_HEADER = b"x-kvrouter-reason"
_PLAIN_CONNECTION = frozenset(("keep-alive", "close", "Keep-Alive", "Close"))  # name no other header

_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
"""The backend could not be reached: nothing was sent, safe to try elsewhere."""
_NO_BYTE_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""The connection failed before any response byte arrived: safe to try elsewhere."""
_TIMEOUTS = (asyncio.TimeoutError, aiohttp.ServerTimeoutError)


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers an engine gets: the allow-list, less what ``Connection`` names
    (``Authorization`` is not on it: see :attr:`Upstream.client_authorization`). Values go as
    they are: uvicorn refuses a header with a control character or a folded line."""
    out = {k: v for k in FORWARDED_REQUEST_HEADERS if (v := headers.get(k)) is not None}
    connection = headers.get("connection")
    if connection is not None and connection not in _PLAIN_CONNECTION:
        for token in connection.lower().split(","):
            out.pop(token.strip(), None)
    out.setdefault("content-type", "application/json")
    return out


def relayed_headers(raw: Any) -> list[tuple[bytes, bytes]]:
    """An engine's response headers the client gets: the allow-list, less what the
    engine's ``Connection`` names (``raw``: aiohttp's ``raw_headers``)."""
    out: list[tuple[bytes, bytes]] = []
    connection: bytes | None = None
    for k, v in raw:
        k = k.lower()
        if k in RELAYED_RESPONSE_HEADERS:
            out.append((k, v))
        elif k == b"connection":
            connection = v.lower()
    if connection is not None and connection not in (b"keep-alive", b"close"):
        hop = {t.strip() for t in connection.split(b",")}
        out = [(k, v) for k, v in out if k not in hop]
    return out


@dataclass(frozen=True, slots=True)
class Upstreams:
    """Where proxied requests go: the backends' pools, their load accounting, the retry budget."""

    pool: BackendPool
    loads: LoadTracker
    retries: int


@dataclass(slots=True)
class Upstream:
    """One request as the proxy sends it: what to send, and in which backend order (what a
    passthrough's :class:`~router.attempt.Attempts` are made of)."""

    path: str
    body: bytes
    headers: dict[str, str]
    order: list[str]
    """Backends to try, best first (a retry takes the next routable one)."""
    model: str
    policy: str
    started: float
    """When the body was received: the overhead clock (``kvrouter_overhead_seconds``)."""
    stream: bool = False
    reason: str | None = None
    """The decision's reason, sent as ``x-kvrouter-reason``; None: not sent."""
    client_authorization: str | None = None
    """The client's ``Authorization``, for backends without a key of their own."""
    method: str = "POST"
    sse: Dialect = OPENAI
    """How the stream's API ends it and writes an error into it."""
    not_found_moves: bool = False
    """A 404 moves it to the next backend too (that backend may not hold what it names)."""
    watch: ResponseIds | None = None
    """Reads the answer as it passes, for the id of the response it creates."""


class ProxyResponse(Response):
    """Sends one request upstream and relays the answer (see the module docstring).

    ``attempts``: the request's tries, the first opened when the router decided; without
    them (a passthrough) each try opens its own, and nothing is committed."""

    def __init__(self, upstreams: Upstreams, request: Upstream, attempts: Attempts | None = None) -> None:
        self.status_code = 200
        self.background = None
        self._req = request
        if (note := observe.current()) is not None and note.model is None:
            note.model = request.model  # a passthrough (embeddings): no decision named it
        if attempts is None:
            attempts = Attempts(upstreams.pool, upstreams.loads, upstreams.retries, request.order, request.model,
                                request.policy, request.started)
        self._attempts = attempts
        self._client_gone = False
        self._response_started = False
        self._events: EventCut | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Runs the exchange in the request's own task (a watcher cancels it if the client
        goes away). Not in a task of its own: the upstream request is then written before
        this task first waits, so background work the endpoint scheduled (a deferred
        request's tokenization) starts only after the request is on its way."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(receive, task))
        status = 499
        try:
            status = await self._exchange(send)
        except asyncio.CancelledError:
            if not self._client_gone:
                raise
            _uncancel()
        finally:
            watcher.cancel()
            self._attempts.end(status)

    async def _cancel_on_disconnect(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone = True
        task.cancel()

    async def _exchange(self, send: Send) -> int:
        """Try the backends until one answers and relay its answer; the status the client got."""
        attempts = self._attempts
        while (attempt := attempts.next()) is not None:
            async with attempt:
                try:
                    status = await self._try(send, attempt)
                except asyncio.CancelledError as e:
                    return await self._cut(send, attempt, e)
                if status is not None:
                    return status
        try:
            return await self._answer(send, attempts.error or UpstreamError("no backend could be tried"))
        except asyncio.CancelledError as e:
            return await self._cut(send, None, e)

    async def _try(self, send: Send, attempt: Attempt) -> int | None:
        """One attempt: the status the client got, or None when the next backend is tried."""
        try:
            upstream = await self._request(attempt)
        except RouterError as e:
            return await self._answer(send, e)
        if upstream is None:
            return None
        self._attempts.counted_on = attempt.name
        headers = relayed_headers(upstream.raw_headers)
        headers.append((BACKEND_HEADER, attempt.name.encode()))
        if self._req.reason is not None:
            reason = "fallback" if self._attempts.tried > 1 else self._req.reason
            headers.append((REASON_HEADER, reason.encode()))
        if self._req.stream and upstream.status == 200:
            status = await self._relay_stream(send, attempt, upstream, headers)
        else:
            status = await self._relay_whole(send, attempt, upstream, headers)
        attempt.finished = status < 500 or status == upstream.status
        return status

    async def _request(self, attempt: Attempt) -> aiohttp.ClientResponse | None:
        """Send the request to the attempt's backend: its response, or None when it failed
        before any response byte (or answered 502/503 with another backend left) and the
        next backend may take it (``attempts.error`` says why the last one did not)."""
        req, backend, name = self._req, attempt.backend, attempt.name
        session = backend.session
        assert session is not None, "BackendPool.open() was not called"
        headers = req.headers
        if req.client_authorization is not None and backend.config.api_key is None:
            headers = {**headers, "authorization": req.client_authorization}
        try:
            upstream = await session.request(req.method, req.path, data=req.body, headers=headers)
        except (*_CONNECT_ERRORS, *_NO_BYTE_ERRORS) as e:
            kind = "connect" if isinstance(e, _CONNECT_ERRORS) else "reset"
            attempt.failed(kind, e)
            attempt.retried(kind)
            what = "could not be reached" if kind == "connect" else "closed the connection before answering"
            self._attempts.error = UpstreamError(f"backend {name} {what}", backend=name)
            return None
        except _TIMEOUTS as e:
            attempt.failed("timeout", e)
            raise UpstreamTimeout(f"backend {name} did not answer in time", backend=name) from e
        except aiohttp.ClientError as e:
            attempt.failed("error", e)
            raise UpstreamError(f"backend {name} failed before answering", backend=name) from e
        except asyncio.CancelledError:
            if attempt.aborted != BACKEND_DOWN:
                raise
            # The backend was found dead while we waited for its first byte: try another.
            _uncancel()
            attempt.went_down()
            attempt.retried(BACKEND_DOWN)
            self._attempts.error = UpstreamError(f"backend {name} went down before answering", backend=name)
            return None
        attempt.upstream = upstream
        if (upstream.status in (502, 503) or upstream.status == 404 and req.not_found_moves) and self._attempts.more():
            attempt.finished = True
            attempt.answered(upstream.status)
            attempt.retried(f"status_{upstream.status}")
            return None
        return upstream

    async def _cut(self, send: Send, attempt: Attempt | None, cancelled: asyncio.CancelledError) -> int:
        """The exchange was cancelled: by its backend's death or the router's drain deadline
        (answered here), or by the client leaving; any other cancellation is raised again."""
        aborted = attempt.aborted if attempt is not None else None
        if aborted == SHUTTING_DOWN:
            _uncancel()
            await self._answer_shutting_down(send)
            return 503
        if aborted == BACKEND_DOWN:
            assert attempt is not None
            _uncancel()
            await self._answer_backend_down(send, attempt)
            return 502
        if self._client_gone and attempt is not None and self._events is not None and self._events.complete:
            # The client hung up after [DONE] (most do) while the engine's end of the
            # response was awaited: it got the whole stream, not a 499.
            attempt.finished = True
            status = 200
        else:
            status = 499
            metrics.child(metrics.CLIENT_DISCONNECTS, self._attempts.counted_on).inc()
        if not self._client_gone:
            raise cancelled
        _uncancel()
        return status

    async def _answer(self, send: Send, error: RouterError) -> int:
        """Answer with ``error`` before any response byte went out."""
        if isinstance(error, UpstreamError) and error.backend is not None:
            self._attempts.counted_on = error.backend
        await error_response(error)({"type": "http"}, _no_receive, send)
        return error.status

    async def _answer_shutting_down(self, send: Send) -> None:
        """The drain deadline cut this request: a stream ends with an error event of its own
        (what it relayed so far stays whole events), anything else not yet answered gets 503."""
        metrics.DRAIN_CUT.inc()
        message = "the router is shutting down: the request did not finish within its drain deadline"
        if self._response_started:
            event = (self._events or EventCut(self._req.sse)).error_event(message, "shutting_down")
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:
            await error_response(ShuttingDown(message))({"type": "http"}, _no_receive, send)

    async def _answer_backend_down(self, send: Send, attempt: Attempt) -> None:
        attempt.went_down()
        message = f"backend {attempt.name} went down while serving the request"
        if self._response_started:
            event = (self._events or EventCut(self._req.sse)).error_event(message)
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:
            await error_response(UpstreamError(message))({"type": "http"}, _no_receive, send)

    async def _relay_whole(
        self, send: Send, attempt: Attempt, upstream: aiohttp.ClientResponse, headers: list[tuple[bytes, bytes]]
    ) -> int:
        name = attempt.name
        limit = 2 * attempt.backend.settings.max_body_bytes  # held whole: 3 answers of 200 MB took 738 MB
        if (upstream.content_length or 0) > limit:
            return await self._too_large(send, attempt, upstream.content_length)
        try:
            parts: list[bytes] = []
            size = 0
            while not upstream.content.at_eof():  # each read returns what has arrived
                more = await upstream.content.read(limit + 1 - size)
                if not more:
                    break
                parts.append(more)
                size += len(more)
                if size > limit:
                    return await self._too_large(send, attempt, None)
            body = b"".join(parts)
        except _TIMEOUTS as e:
            attempt.failed("timeout", e)
            return await self._answer(send, UpstreamTimeout(f"backend {name} did not finish in time"))
        except aiohttp.ClientError as e:
            attempt.failed("reset", e)
            return await self._answer(send, UpstreamError(f"backend {name} failed mid-response"))
        attempt.first_byte()
        status = upstream.status
        attempt.answered(status)
        if self._req.watch is not None:
            self._req.watch.whole(name, status, body)
        if status >= 500:
            # An engine's 5xx body can name internal hosts, paths or credentials (a Redis URL
            # with its password came through once): the client gets the status and a generic
            # error, the log gets the body.
            log.warning("backend %s answered %d: %r", name, status, body[:2000])
            body = error_body(f"backend {name} answered {status}", "server_error", "upstream_error")
            headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
            headers.append((b"content-type", b"application/json"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return status

    async def _too_large(self, send: Send, attempt: Attempt, size: int | None) -> int:
        """A non-streamed answer past twice ``router.max_body_bytes``: 502, the connection dropped."""
        limit = 2 * attempt.backend.settings.max_body_bytes
        log.warning("backend %s: an answer of %s bytes is over twice router.max_body_bytes (%d)",
                    attempt.name, size if size is not None else "more than that many", limit)
        metrics.child(metrics.UPSTREAM_FAILURES, attempt.name, "too_large").inc()
        return await self._answer(send, UpstreamError(f"backend {attempt.name} answered more than the router's "
                                                      f"{limit}-byte limit", code="response_too_large"))

    async def _relay_stream(
        self, send: Send, attempt: Attempt, upstream: aiohttp.ClientResponse, headers: list[tuple[bytes, bytes]]
    ) -> int:
        chunks = upstream.content.iter_any().__aiter__()
        cut = self._events = EventCut(self._req.sse) if upstream.content_type == "text/event-stream" else None
        watch = self._req.watch if cut is not None else None
        try:
            # The status line and headers go out with the first chunk, not before it: one
            # write to the client instead of two, which on a busy host is a wake-up saved on
            # the time to first token. Until then a failure can still be a proper 502.
            try:
                first: bytes = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            attempt.first_byte()
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            self._response_started = True
            if cut is not None:
                first = cut.feed(first)
                if watch is not None:
                    watch.events(attempt.name, first)
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in chunks:
                if cut is not None:
                    chunk = cut.feed(chunk)
                    if not chunk:
                        continue
                    if watch is not None and watch.looking:
                        watch.events(attempt.name, chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, *_TIMEOUTS) as e:
            kind = "timeout" if isinstance(e, _TIMEOUTS) else "reset"
            attempt.failed(kind, e, during="mid-stream")
            message = f"backend {attempt.name} failed mid-stream"
            if not self._response_started:
                return await self._answer(send, UpstreamTimeout(message) if kind == "timeout" else UpstreamError(message))
            event = (cut or EventCut(self._req.sse)).error_event(message)
            await send({"type": "http.response.body", "body": event, "more_body": False})
            return 502
        if cut is not None and not cut.complete:
            attempt.truncated(cut.held_bytes)
            event = cut.error_event(f"backend {attempt.name} ended the stream early")
            await send({"type": "http.response.body", "body": event, "more_body": False})
            return 502
        attempt.answered(200)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200


def _uncancel() -> None:
    """Forget a cancellation the proxy caused itself (Python >= 3.11 counts them)."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}
