"""Part of stage 7 of the request path, *send*: the tries of one request, each on one backend.

An :class:`Attempt` is one try, and everything that try accounts for is its own:

- the backend's load :class:`~router.fleet.load.Ticket`, taken when the attempt is opened and
  released when its ``async with`` ends. :meth:`Attempt.close` is the one place a ticket
  is released, so the invariant of :mod:`router.fleet.load` (every ticket released exactly once,
  on every path: success, upstream error, timeout, client disconnect, retry, drain cut,
  backend death) holds by construction: the proxy enters every attempt it tries, and an
  attempt opened but never tried is closed by :class:`Attempts`;
- the decision's commit to that backend (:func:`router.choose.commit`: the policy learns
  where the request went), made when the attempt is opened;
- the prefill share moving to decode at the first response byte (:meth:`Attempt.first_byte`);
- what the try tells about its backend: health (``record_success`` / ``record_failure``),
  ``kvrouter_upstream_failures_total`` and ``kvrouter_retries_total``;
- its place on the backend's in-flight list, from which a backend found dead
  (:meth:`router.fleet.backends.BackendState.abort_in_flight`) or the router's drain deadline
  cancels it (:attr:`Attempt.aborted` says which);
- the upstream response, whose connection goes back to the pool when the exchange
  finished, and is closed otherwise, which is how vLLM learns to abort the request.

:class:`Attempts` is a request's tries in the decision's order: the first is opened when
the router decides (:meth:`router.request_path.RequestPath.send`), before any await, so the
next decision already sees its load; a retry opens a new attempt on the next routable
backend, within the retry budget. It counts the request once it is answered
(``kvrouter_requests_total``, ``kvrouter_overhead_seconds``) and then starts what its plan
owes (stage 8, *settle*).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import aiohttp

from router import metrics
from router.fleet.backends import BackendPool, BackendState, describe
from router.http.errors import UpstreamError
from router.fleet.load import LoadTracker, Ticket

log = logging.getLogger(__name__)

BACKEND_DOWN = "backend_down"
SHUTTING_DOWN = "shutting_down"


class Attempt:
    """One try of a request on one backend (see the module docstring)."""

    __slots__ = ("backend", "ticket", "model", "upstream", "finished", "aborted", "_task")

    def __init__(self, backend: BackendState, ticket: Ticket, model: str) -> None:
        self.backend = backend
        self.model = model
        self.ticket = ticket
        self.upstream: aiohttp.ClientResponse | None = None
        """The backend's response, once it answered."""
        self.finished = False
        """The exchange ended cleanly: the upstream connection can serve another request."""
        self.aborted: str | None = None
        """Why the attempt's task was cancelled from outside: :data:`BACKEND_DOWN` or :data:`SHUTTING_DOWN`."""
        self._task: asyncio.Task[Any] | None = None

    @property
    def name(self) -> str:
        return self.backend.name

    async def __aenter__(self) -> Attempt:
        task = asyncio.current_task()
        if task is not None:
            self._task = task
            self.backend.in_flight[task] = self._abort
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """End the attempt: off the in-flight list, the ticket released, the upstream
        connection returned or closed. Runs once per attempt (``release`` is idempotent too)."""
        self._unwatch()
        self.ticket.release()
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            if self.finished:
                upstream.release()
            else:
                upstream.close()

    def _unwatch(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self.backend.in_flight.pop(task, None)

    def _abort(self, shutting_down: bool = False) -> None:
        """End the exchange now: its backend is dead, or (``shutting_down``) the router's
        drain deadline has come. The first reason sticks."""
        if self._task is not None and self.aborted is None:
            self.aborted = SHUTTING_DOWN if shutting_down else BACKEND_DOWN
            self._task.cancel()

    def first_byte(self) -> None:
        """The response began: the request's prefill share moves to decode."""
        self.ticket.first_token()

    def answered(self, status: int) -> None:
        """The backend answered ``status`` (and a stream ended whole); a 5xx counts against its health."""
        if status >= 500:
            self.backend.record_failure(f"answered {status}", answered=self.model)
            metrics.child(metrics.UPSTREAM_FAILURES, self.name, f"status_{status}").inc()
        else:
            self.backend.record_success()

    def failed(self, kind: str, exc: BaseException, *, during: str = "") -> None:
        """Count an upstream failure and keep its detail for the operator: the log and
        ``/debug/backends`` get the exception (it names the address), the client does not.

        The attempt leaves the backend's in-flight list first: a refused connection
        (``kind`` ``connect``) ejects the backend and aborts its in-flight requests, which
        must not include this one (it would be cancelled on its retry)."""
        self._unwatch()
        detail = f"{kind}{' ' + during if during else ''}: {describe(exc)} ({self.backend.url})"
        self.backend.record_failure(detail, connect_error=kind == "connect")
        metrics.child(metrics.UPSTREAM_FAILURES, self.name, kind).inc()
        log.warning("backend %s: %s", self.name, detail)

    def truncated(self, dropped: int) -> None:
        """The backend ended a stream without vLLM's closing ``[DONE]``."""
        self.backend.record_failure("stream ended without [DONE]", answered=self.model)
        metrics.child(metrics.UPSTREAM_FAILURES, self.name, "truncated").inc()
        log.warning("backend %s: stream ended without [DONE] (%d bytes of an unfinished event dropped)", self.name, dropped)

    def went_down(self) -> None:
        """The backend was found dead while this attempt waited on it."""
        metrics.child(metrics.UPSTREAM_FAILURES, self.name, BACKEND_DOWN).inc()

    def retried(self, kind: str) -> None:
        """The request moves on to the next backend because this attempt failed (``kind``)."""
        metrics.child(metrics.RETRIES, self.name, kind).inc()


class Attempts:
    """A request's tries, in the decision's order (see the module docstring)."""

    __slots__ = ("pool", "loads", "retries", "order", "model", "policy", "started", "keys", "prefill", "commit",
                 "on_done", "error", "counted_on", "tried", "_first", "_next")

    def __init__(
        self, pool: BackendPool, loads: LoadTracker, retries: int, order: list[str], model: str, policy: str,
        started: float, *, keys: list[int] | None = None, prefill: Mapping[str, int] | None = None,
        commit: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.loads = loads
        self.retries = retries
        self.order = order
        """Backends to try, best first."""
        self.model = model
        self.policy = policy
        self.started = started
        """When the body was received: the overhead clock (``kvrouter_overhead_seconds``)."""
        self.keys: list[int] = keys if keys is not None else []
        self.prefill: Mapping[str, int] = prefill if prefill is not None else {}
        """Uncached prompt tokens per backend, for the load ticket of each attempt."""
        self.commit = commit
        """The decision's commit (:func:`router.choose.commit` bound to the request), called
        with each attempt's backend when it is opened; None: nothing to commit (a passthrough)."""
        self.on_done: Callable[[], None] | None = None
        """Starts what the request's plan owes sooner, once it is answered."""
        self.error: UpstreamError | None = None
        """Why the last retried attempt failed: the answer once the tries run out."""
        self.counted_on = order[0] if order else "none"
        """The backend ``kvrouter_requests_total`` counts the request on: the one whose
        response or error the client got (until then, the first of the order)."""
        self.tried = 0
        self._first: Attempt | None = None
        self._next = 0

    def open(self, name: str, *, announced: bool = False, ticket: int | None = None) -> Attempt:
        """An attempt on backend ``name``: its load ticket taken and the decision committed
        to it, now. The first is kept until :meth:`next` hands it out; ``announced``: its
        decision went to the replicas' fleet-state log already, as ``ticket``
        (:meth:`router.fleet.load.LoadTracker.acquire`)."""
        backend = self.pool.backends[name]
        held = self.loads.acquire(name, self.keys, self.prefill.get(name, 0), self.model, announced=announced,
                                  ticket=ticket)
        attempt = Attempt(backend, held, self.model)
        if self.tried == 0:
            self._first = attempt
        if self.commit is not None:
            self.commit(name)
        return attempt

    def next(self) -> Attempt | None:
        """The next attempt to try, or None when the order or the retry budget is spent.

        The first try takes the attempt opened when the router decided, unless a config
        reload removed its backend since; a later one skips backends that are not routable."""
        while self._next < len(self.order) and self.tried <= self.retries:
            name = self.order[self._next]
            self._next += 1
            backend = self.pool.backends.get(name)
            if backend is None or self.tried > 0 and not backend.routable:
                continue
            self.tried += 1
            first, self._first = self._first, None
            if first is not None and first.backend is backend:
                attempt = first
            else:
                if first is not None:
                    first.close()
                attempt = self.open(name)
            if self.tried == 1:
                metrics.child(metrics.OVERHEAD_SECONDS, self.model).observe(time.perf_counter() - self.started)
            return attempt
        return None

    def more(self) -> bool:
        """Whether a retry would find a routable backend within the budget."""
        backends = self.pool.backends
        return self.tried <= self.retries and any(n in backends and backends[n].routable for n in self.order[self._next :])

    def abandon(self) -> None:
        """Close the first attempt if it was never tried (the request ended before it)."""
        first, self._first = self._first, None
        if first is not None:
            first.close()

    def end(self, status: int) -> None:
        """The request is answered with ``status`` (or abandoned): count it, start what it owes."""
        self.abandon()
        metrics.child(metrics.REQUESTS, self.model, self.counted_on, self.policy, str(status)).inc()
        if self.on_done is not None:
            self.on_done()
