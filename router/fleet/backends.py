"""Backend health: active checks, passive ejection, re-admission and a circuit breaker.

A backend is *routable* when its last health check passed and its circuit is not
open. Two signals feed that:

- the health loop polls ``GET /health`` every ``health_interval_s``: one failure ejects
  the backend, one success re-admits it;
- the proxy reports every upstream outcome: a connect error ejects at once (the
  process is gone; waiting for the next check would send it more requests), and
  ``Tuning.breaker_failures`` (5) consecutive failures (5xx, resets, timeouts) open the circuit
  for ``Tuning.breaker_cooldown_s`` (5 s), doubling on each re-open up to 60 s. After the cooldown
  the circuit is half-open: the next request is a trial and its success closes it.

A failure the engine *answered* (a 5xx, a stream that ended without ``[DONE]``) may be
the request's own doing: a client can craft requests an engine fails (12 of them once
opened the circuit on every backend, and ``/health`` answered 503 for up to a minute).
So a streak with such failures in it does not open the circuit by itself: the router
first sends the engine a request of its own (:meth:`BackendState.verify`, a one-token
completion), and opens the circuit only if that fails too
(``kvrouter_breaker_verifications_total``). Failures without an answer (resets,
timeouts) open it as before.

With ``serve --workers N`` there is one health decision per backend, not N: worker 0,
the *leader*, runs the active checks and appends each verdict to the fleet-state log
(:mod:`router.fleet.log`); the other workers fold it within :data:`FOLLOW_S`. A
passive ejection seen by any worker (a refused connection) is published the same way,
so every worker ejects the backend, and the leader's next passing check re-admits it
for all. Should the leader fall silent (it died and is being restarted), the followers
check for themselves until it is back. The circuit breaker stays per worker: it counts
that worker's own failures, and opens only that worker's circuit.

A *refused* connection (health check or proxy) means the engine's listener is gone:
the process died or restarted, and requests already sent to it will never finish (a
dead peer does not always reset its connections). Those in-flight requests are aborted
at once (:meth:`BackendState.abort_in_flight`) instead of waiting for the read timeout;
they answer 502, or end their stream with an error event.

What an ejection says about the engine's KV cache depends on why: a refused connection
(the process is gone) or a failing answer (``/health`` other than 200: the engine core is
dead) presumes it gone, and the index forgets the backend (``on_down``); a check that only
timed out (the engine is slow or hung, e.g. SIGSTOP) ejects it but leaves the index alone,
since the cache is still there when it answers again. A timeout is also only the engine's
fault if the router's own event loop was not what made it late: a check whose timeout
fired far past its deadline (:func:`stall_slack`) was in flight while the loop was blocked
(a request's work on it, the process stopped), and its answer may have been waiting in the
socket all along. Such a check is discounted
(``kvrouter_health_checks_discounted_total``) and made again at once.

Each backend owns one pooled keep-alive ``aiohttp.ClientSession`` (HTTP/1.1, connection
limit sized for streaming concurrency), and it carries all of the router's traffic to
that engine: proxied requests, health checks, ``/metrics`` scrapes, ``/v1/models``,
remote ``/tokenize`` and parity checks. One stack, chosen by measurement: against a
loopback null server (benchmarks/bench_http_clients.py, medians of 5 interleaved
rounds of 2,000 POSTs, uvloop), aiohttp cost 93 µs of client CPU per request where
``httpx.AsyncClient`` cost 471 µs, and 238 µs against 3,438 µs of wall time per request
with 32 in flight. That CPU is spent on the event loop, which every request in flight
waits for. (The CLI, ``kvrouter doctor``, and the tests keep httpx: nothing waits on them.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from router import metrics
from kvconfig import Backend, Config, RouterSettings
from router.fleet.log import Verdict
from router.fleet.ring import sender
from router.tuning import Tuning

if TYPE_CHECKING:
    from router.fleet.process import FleetLog

log = logging.getLogger(__name__)

MAX_COOLDOWN_S = 60.0
VERIFY_TIMEOUT_S = 30.0
"""Longest the router's own request to an engine that failed a streak may take: a one-token
completion; past it the engine counts as failing."""
FOLLOW_S = 0.05
"""How often a worker folds the others' records (health verdicts among them)."""


def describe(exc: BaseException) -> str:
    """``Kind: message`` for the log and ``/debug/backends``, not a repr: aiohttp's reprs spell
    out connection keys, SSL contexts and proxies where the operator wants what failed."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True, slots=True)
class PollError:
    """Why a health check or scrape got no answer."""

    error: str
    refused: bool
    timed_out: bool = False
    """No answer within the timeout: the engine may be slow or hung, or the router's loop late."""


class BackendState:
    """One engine's connection pool and health. Mutated only on the event loop."""

    def __init__(self, backend: Backend, settings: RouterSettings, tuning: Tuning | None = None) -> None:
        self.name = backend.name
        self.url = backend.url
        self.config = backend
        self.settings = settings
        self.tuning = tuning or Tuning()
        self.session: aiohttp.ClientSession | None = None
        self.health_ok = True
        self.on_down: Callable[[str], None] | None = None
        """Called with the name when an ejection presumes the backend's cache gone (a refused
        connection, seen by a health check or by the proxy, or a failing ``/health`` answer; not
        a timeout alone): :meth:`BackendPool.health_forever` sets it."""
        self.forgotten = False
        """``on_down`` has been called since the backend was last admitted. A backend ejected by a
        timeout is not forgotten yet, so a refusal or failing answer that follows still purges it."""
        self.consecutive_failures = 0
        self.answered_model: str | None = None
        """The model of the last failure in the streak the engine answered itself, if any."""
        self._verifying: asyncio.Future[None] | None = None
        self.circuit_open_until = 0.0
        self.cooldown_s = self.tuning.breaker_cooldown_s
        self.ejections = 0
        self.last_error: str | None = None
        self.in_flight: dict[asyncio.Task[None], Callable[..., None]] = {}
        """Proxy tasks waiting on this backend -> how to abort each (see abort_in_flight)."""
        self.retired = False
        """Removed from the config by a reload: no longer checked, closed once idle."""
        self.fleet: FleetLog | None = None
        """Where this worker's verdicts go, when the workers of a host share them."""

    def open(self) -> None:
        """Create the session (needs the running event loop)."""
        s = self.settings
        self.session = aiohttp.ClientSession(
            base_url=self.url,
            connector=aiohttp.TCPConnector(limit=self.tuning.max_connections_per_backend, keepalive_timeout=30.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.tuning.connect_timeout_s, sock_read=s.request_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            headers=self.config.auth_headers(),
            # One session serves every client: a jar would send a cookie an engine set for
            # one client's request with every later client's requests to that engine.
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    @property
    def http(self) -> aiohttp.ClientSession:
        """The session, once :meth:`open` made it."""
        assert self.session is not None, "BackendState.open() was not called"
        return self.session

    async def poll(self, path: str, timeout_s: float) -> tuple[int | PollError, bytes]:
        """GET ``path`` over the pooled session: the status and body, or why it failed
        (``refused``: nothing listens there any more)."""
        assert self.session is not None, "BackendState.open() was not called"
        if self.session.closed:  # removed by a reload while a scrape was on its way
            return PollError("backend removed", refused=False), b""
        try:
            async with self.session.get(path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.read()
        except aiohttp.ClientConnectorError as e:
            return PollError(f"{describe(e)} ({self.url}{path})", refused=True), b""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return PollError(f"{describe(e)} ({self.url}{path})", refused=False,
                             timed_out=isinstance(e, asyncio.TimeoutError)), b""

    @property
    def routable(self) -> bool:
        return self.health_ok and time.monotonic() >= self.circuit_open_until

    @property
    def circuit_open(self) -> bool:
        return time.monotonic() < self.circuit_open_until

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.answered_model = None
        self.cooldown_s = self.tuning.breaker_cooldown_s

    def record_failure(self, reason: str, *, connect_error: bool = False, answered: str | None = None) -> None:
        """One failed exchange; ``answered``: the engine answered it itself (the model asked),
        so the request may have caused it (see the module docstring)."""
        self.last_error = reason
        self.consecutive_failures += 1
        if answered is not None:
            self.answered_model = answered
        if connect_error:
            self.eject(reason, refused=True)
        if self.consecutive_failures < self.tuning.breaker_failures or self.circuit_open:
            return
        if self.answered_model is None:
            self._open(reason)
        elif self._verifying is None:
            self._verifying = asyncio.ensure_future(self.verify(self.answered_model, reason))

    def _open(self, reason: str) -> None:
        self.circuit_open_until = time.monotonic() + self.cooldown_s
        log.warning("circuit open for %s for %.1fs after %d failures (%s)", self.name, self.cooldown_s, self.consecutive_failures, reason)
        self.cooldown_s = min(MAX_COOLDOWN_S, self.cooldown_s * 2)
        self.consecutive_failures = 0
        self.answered_model = None

    async def verify(self, model: str, reason: str) -> None:
        """A failure streak with answers from the engine in it: a request of the router's own
        decides. Served, the failures were the requests' doing and the streak is forgotten;
        failed too, the circuit opens. The backend stays routable meanwhile."""
        try:
            if self.session is None or self.session.closed:
                return
            body = {"model": model, "prompt": "Hi", "max_tokens": 1}
            timeout = aiohttp.ClientTimeout(total=VERIFY_TIMEOUT_S)
            async with self.session.post("/v1/completions", json=body, timeout=timeout) as r:
                await r.read()
                served = r.status == 200
        except Exception:  # noqa: BLE001 - no answer, a reset, a closed session: it did not serve it
            served = False
        finally:
            self._verifying = None
        metrics.child(metrics.BREAKER_VERIFICATIONS, self.name, "request_caused" if served else "backend_failing").inc()
        if served:
            log.info("backend %s: %d failures in a row (%s), but it served the router's own request: not opening its circuit",
                     self.name, self.consecutive_failures, reason)
            self.consecutive_failures = 0
            self.answered_model = None
        elif not self.circuit_open:
            self._open(reason)

    def eject(self, reason: str, *, refused: bool = False, timed_out: bool = False, publish: bool = True) -> None:
        """Stop routing to the backend; unless only a timeout says so (``timed_out``: the engine is
        slow or hung and keeps its cache), presume its cache gone and call ``on_down``, once until
        it is re-admitted."""
        if publish and self.fleet is not None:
            self.fleet.append(Verdict(self.name, False, refused, timed_out), to_fleet=False)
        was_ok = self.health_ok
        if was_ok:
            self.ejections += 1
            log.warning("backend %s ejected: %s", self.name, reason)
        self.health_ok = False
        self.last_error = reason
        if refused:
            self.abort_in_flight()
        if not timed_out and not self.forgotten:
            self.forgotten = True
            if self.on_down is not None:
                self.on_down(self.name)

    def abort_in_flight(self, *, shutting_down: bool = False) -> int:
        """End every exchange waiting on this backend (it died, or the router's drain
        deadline came); returns how many."""
        aborts = list(self.in_flight.values())
        for abort in aborts:
            abort(shutting_down)
        return len(aborts)

    def admit(self, *, publish: bool = True) -> None:
        if not self.health_ok:
            if publish and self.fleet is not None:
                self.fleet.append(Verdict(self.name, True), to_fleet=False)
            log.info("backend %s re-admitted", self.name)
        self.health_ok = True
        self.forgotten = False

    def follow(self, v: Verdict) -> None:
        """Another worker's verdict, folded from the log."""
        if v.healthy:
            self.admit(publish=False)
        else:
            self.eject("ejected by the shared health verdict" + (" (connection refused)" if v.refused else ""),
                       refused=v.refused, timed_out=v.timed_out, publish=False)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "url": self.url,
            "healthy": self.routable,
            "health_check_ok": self.health_ok,
            "circuit_open": self.circuit_open,
            "ejections": self.ejections,
            "last_error": self.last_error,
        }


def health_timeout(interval_s: float) -> float:
    """How long one health check may take: 3/4 of the interval, within 1..5 s.

    A hung engine (SIGSTOP, a stalled GIL) is ejected when a check times out, and the check
    that starts right after it froze is the one that does it: ejection takes at most
    interval + timeout, under the two intervals the chaos suite holds the router to for
    intervals from 4/3 s up (the timeout used to be the whole interval: exactly two at the
    2 s default, more once scheduling delays add up). The 1 s floor keeps a loaded engine's
    slow answer from ejecting it under the short intervals tests use."""
    return min(5.0, max(1.0, 0.75 * interval_s))


def stall_slack(timeout_s: float) -> float:
    """How far past its deadline a health check may time out and still count against the engine.

    A timer fires late by however long the event loop takes to come back to it: milliseconds on
    a busy but healthy loop, whose callbacks are all short (long prompts are tokenized off it).
    A check that timed out later than this was in flight while the loop itself was
    blocked, and says nothing about the engine: its answer may have sat in the socket while the
    timer waited (a request that blocked the loop for 2.5-5 s once ejected every backend so).
    Half the timeout, and at least 0.25 s, is far above a healthy loop's lateness even on
    contended cores, so a hung engine is not given a second chance (one more timeout before its
    ejection) by scheduling noise alone."""
    return max(0.25, 0.5 * timeout_s)


class BackendPool:
    """Every configured backend by name (a backend serving two models is one state)."""

    def __init__(self, config: Config, tuning: Tuning | None = None) -> None:
        self.settings = config.router
        self.tuning = tuning or Tuning()
        self.backends: dict[str, BackendState] = {}
        self._on_down: Callable[[str], None] | None = None
        self.fleet: FleetLog | None = None
        self.worker = 0
        self.workers = 1
        self._started = time.monotonic()
        for m in config.models:
            for b in m.backends:
                if b.name not in self.backends:
                    self.backends[b.name] = BackendState(b, config.router, self.tuning)

    def get(self, name: str) -> BackendState:
        return self.backends[name]

    def open(self) -> None:
        for b in self.backends.values():
            b.open()

    def share(self, fleet: FleetLog, worker: int, workers: int) -> None:
        """Share health verdicts with the host's other workers (worker 0 is the leader that checks)."""
        self.fleet = fleet
        self.worker = worker
        self.workers = workers
        fleet.state.follow[Verdict] = self._follow
        for b in self.backends.values():
            b.fleet = fleet

    def _follow(self, v: Verdict) -> None:
        b = self.backends.get(v.backend)
        if b is not None and not b.retired:
            b.follow(v)

    @property
    def leader(self) -> bool:
        return self.fleet is None or self.worker == 0

    def leader_gone(self) -> bool:
        """Whether the leader has been silent longer than it would be had it lived on (a
        leader not heard from yet counts from this worker's start: it may be loading)."""
        if self.fleet is None:
            return False
        leader = self.fleet.state.senders.get(sender(0))
        late = 2 * self.settings.health_interval_s + health_timeout(self.settings.health_interval_s) + 1.0
        return time.monotonic() - (self._started if leader is None else leader.heard) > late

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.backends.values()))

    async def health_forever(self, on_down: Callable[[str], None]) -> None:
        """Check every backend each ``health_interval_s``; ``on_down(name)`` whenever an ejection
        presumes a backend's cache gone: a refused connection or a failing answer, not a check
        that only timed out (a hung engine keeps its cache; see :meth:`BackendState.eject`).

        Also when the proxy ejects it (a refused connection: the process died): the health
        loop used to see only the failures of its own checks, so an engine that restarted
        within an interval came back with the index still holding its old cache, and was
        routed to for blocks it no longer had until its event stream reconnected (kvrouter
        chaos engine_restart: 694 blocks wrongly held for 2.2 s after re-admission)."""
        self._on_down = on_down
        for b in self.backends.values():
            b.on_down = on_down
        if self.fleet is not None:
            await self._shared_forever()
        while True:
            await self.check_all()
            await asyncio.sleep(self.settings.health_interval_s)

    async def _shared_forever(self) -> None:
        """Each interval, check: the leader always, a follower only while the leader is
        silent (the verdicts are folded from the log as they come)."""
        checked = time.monotonic()  # core.Router.start has just checked every backend
        alone = False
        while True:
            now = time.monotonic()
            gone = not self.leader and self.leader_gone()
            if not self.leader and gone != alone:
                alone = gone
                if alone:
                    metrics.HEALTH_LEADER_GONE.inc()
                    log.warning("worker %d: the health leader (worker 0) is silent; checking backends itself",
                                self.worker)
                else:
                    log.info("worker %d: the health leader is back; following its verdicts", self.worker)
            if now - checked >= self.settings.health_interval_s and (self.leader or alone):
                checked = now
                await self.check_all()
            await asyncio.sleep(FOLLOW_S)

    async def max_model_len(self, model: str, names: list[str]) -> int | None:
        """``model``'s ``max_model_len`` from the first of ``names`` whose ``/v1/models``
        lists it (best effort: the engine enforces its limit anyway)."""
        for name in names:
            status, body = await self.get(name).poll("/v1/models", 5.0)
            if status != 200:
                log.debug("max_model_len from %s failed: %s", name, status)
                continue
            try:
                entries = json.loads(body).get("data", [])
            except (ValueError, AttributeError) as e:
                log.debug("max_model_len from %s: unreadable /v1/models: %r", name, e)
                continue
            for entry in entries if isinstance(entries, list) else []:
                if isinstance(entry, dict) and entry.get("id") == model and isinstance(entry.get("max_model_len"), int):
                    return entry["max_model_len"]
        return None

    async def add(self, backend: Backend) -> BackendState:
        """A backend a config reload added: its session opened and its health checked once
        before it can be chosen."""
        b = BackendState(backend, self.settings, self.tuning)
        b.open()
        b.on_down = self._on_down
        b.fleet = self.fleet
        await self._check(b)
        self.backends[b.name] = b
        return b

    async def remove(self, name: str) -> None:
        """Drop a backend a reload removed once nothing waits on it any more (the caller
        makes sure no new request is sent to it)."""
        b = self.backends.pop(name)
        b.retired = True
        if b.session is not None:
            await b.session.close()

    async def _check(self, b: BackendState) -> None:
        """One health verdict on ``b``. A check that timed out while the router's loop was stalled
        is discounted and made again at once; if that one is stalled too, there is no verdict
        until the next interval (a router whose loop keeps stalling must not eject engines for it)."""
        if b.retired:
            return
        timeout_s = health_timeout(self.settings.health_interval_s)
        for _ in range(2):
            started = time.monotonic()
            status, _ = await b.poll("/health", timeout_s)
            late_s = time.monotonic() - started - timeout_s
            if not (isinstance(status, PollError) and status.timed_out and late_s > stall_slack(timeout_s)):
                break
            metrics.HEALTH_CHECKS_DISCOUNTED.labels(b.name).inc()
            log.warning("health check of %s discounted: it timed out %.2fs past its %.2fs deadline, so the "
                        "router's event loop was stalled, not the engine slow", b.name, late_s, timeout_s)
        else:
            return
        if status == 200:
            b.admit()
        elif isinstance(status, int):
            b.eject(f"health check answered {status}")
        else:
            b.eject(f"health check {'refused' if status.refused else 'failed'}: {status.error}", refused=status.refused,
                    timed_out=status.timed_out)

    async def aclose(self) -> None:
        for b in self.backends.values():
            if b._verifying is not None:
                b._verifying.cancel()
        await asyncio.gather(*(b.session.close() for b in self.backends.values() if b.session is not None))
