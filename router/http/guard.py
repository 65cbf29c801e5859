"""Client connections the router can afford: a bound on how many, how slow and how large.

uvicorn's httptools protocol has a keep-alive timeout between requests and nothing else:
no limit on connections, on the time a client takes to send its headers or its body, or
on the headers' size. 250 silent, 250 slow-header and 250 slow-body connections were all
still open after 70 s, and under ``ulimit -n 1024`` 1,100 silent ones made ``/health``
fail with nothing logged. :func:`guarded` subclasses the protocol with what it lacks:

- **a connection limit** (the tuning's ``max_connections``, by default what the process's file
  descriptors allow). At the limit a new connection takes the place of the oldest one
  without a request under way (silent, slow to send its head, or idle between requests);
  when every connection is serving a request, the new one is closed at once;
- **a client timeout** (the tuning's ``client_timeout_s``, 30 s): a request's head must arrive within
  it of the connection opening (or of the previous answer, on a kept-alive connection),
  and its body may pause no longer than it; past it the connection is closed, and a
  handler waiting for the body sees the client gone (499);
- **a head size limit** (:data:`MAX_HEAD_BYTES`): a larger head is answered 431 and closed.

Each refusal is counted in ``kvrouter_connections_refused_total{reason}`` and logged, at
most once per reason every :data:`LOG_EVERY_S`. Written here because uvicorn offers no
hook for these; the subclass only wraps the parser callbacks it already has.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from indexer.breaker import Throttle
from router import metrics

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes of request line and headers a request may have (nginx's default allows 32 KiB)."""
LOG_EVERY_S = 10.0
RESERVED_FDS = 256
"""File descriptors kept for everything but clients: engines' connections, ZMQ, files."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_connections: int
    client_timeout_s: float


def raise_fd_limit() -> int:
    """Raise the soft file-descriptor limit to the hard one (what ``ulimit -n`` allows without
    privileges); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("cannot raise the file-descriptor limit from %d to %d: %s", soft, hard, e)
    return soft


def default_max_connections(fd_limit: int) -> int:
    """Half the descriptors left after :data:`RESERVED_FDS`: a proxied request holds two, its
    client's and its engine's (an engine connection that cannot open ejects the backend)."""
    return max(64, (fd_limit - RESERVED_FDS) // 2)


class _Refusals:
    """Counts refusals by reason; logs each reason at most once per :data:`LOG_EVERY_S`."""

    def __init__(self) -> None:
        self._logs: dict[str, Throttle] = {}

    def count(self, reason: str, detail: str) -> None:
        metrics.child(metrics.CONNECTIONS_REFUSED, reason).inc()
        throttle = self._logs.get(reason)
        if throttle is None:
            throttle = self._logs[reason] = Throttle(LOG_EVERY_S)
        more = throttle.due()
        if more is not None:
            log.warning("client connection closed: %s%s", detail, more)


def guarded(limits: Limits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits`` (see the module docstring): pass it as
    ``uvicorn.Config(http=...)``. One class per server: it holds the server's waiting list."""

    waiting: OrderedDict[int, GuardedProtocol] = OrderedDict()
    """Connections whose request head has not fully arrived, oldest first."""
    refusals = _Refusals()

    class GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._head_bytes = 0
            """Bytes received while a head is incomplete (a line that never ends is bounded too)."""
            self._parsed = 0
            """The head's request line and headers, as parsed."""
            self._in_head = False
            self._refused = False

        # -- the connection -----------------------------------------------------------------

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                if waiting:
                    _, oldest = waiting.popitem(last=False)
                    oldest._close("evicted", f"the oldest of {limits.max_connections} connections without a "
                                  "request under way made room for a new one")
                else:
                    self._refused = True
                    refusals.count("limit", f"{limits.max_connections} connections serve requests")
                    transport.close()
                    return
            super().connection_made(transport)
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            waiting.pop(id(self), None)
            if self._refused and self.transport is None:
                return  # refused before uvicorn knew of it
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            """Counts a request head's bytes as they arrive: httptools hands a header over only
            once its line is complete, so a line that never ends is bounded here."""
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self._refused:
                self._too_large()

        # -- the parser's and the cycle's callbacks -------------------------------------------

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._await_head()
            self._head_bytes = self._parsed = 0

        def on_url(self, url: bytes) -> None:
            self._parsed += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parsed += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            if self._parsed > MAX_HEAD_BYTES:  # it came whole, in one read
                self._too_large()
                return
            self._in_head = False
            waiting.pop(id(self), None)
            self._restart("body_timeout")
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                self._restart("body_timeout")
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            self._cancel()
            super().on_message_complete()
            if self.cycle is not None and self.cycle.response_complete and not self.pipeline:
                self._await_head()  # answered before its body ended (a 401, a 413): idle now

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline and not (self.cycle and self.cycle.more_body):
                self._await_head()  # idle until its next request: timed, and first to make room

        # -- internals ------------------------------------------------------------------------

        def _await_head(self) -> None:
            waiting[id(self)] = self
            waiting.move_to_end(id(self))
            self._in_head = True
            self._restart("header_timeout")

        def _too_large(self) -> None:
            self._refused = True
            self._cancel()
            waiting.pop(id(self), None)
            refusals.count("head_too_large", f"a request head over {MAX_HEAD_BYTES} bytes (431)")
            body = b"request head too large"
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
                                 b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.transport.close()

        def _restart(self, reason: str) -> None:
            self._cancel()
            self._timer = self.loop.call_later(limits.client_timeout_s, self._expire, reason)

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self, reason: str) -> None:
            self._timer = None
            if reason == "body_timeout" and (self.pipeline or (self.flow is not None and self.flow.read_paused)):
                self._restart(reason)  # the router, not the client, is not reading: wait on
                return
            self._close(reason, f"no request head, or no body byte, within {limits.client_timeout_s:g} s")

        def _close(self, reason: str, detail: str) -> None:
            self._cancel()
            waiting.pop(id(self), None)
            if self.transport is not None and not self.transport.is_closing():
                refusals.count(reason, detail)
                self.transport.close()

    return GuardedProtocol
