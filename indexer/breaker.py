"""A circuit breaker for a remote call on the request path (Redis): fail fast while it is down.

A Redis that hangs (SIGSTOP, a full network buffer) answers nothing until each call's
timeout, and every request that asks it pays that timeout: a frozen index made every
request take 1.3 s. After ``threshold`` failures in a row (one slow answer on a loaded host
is not an outage) the breaker lets no call through for a back-off,
then exactly one at a time: that probe's success closes it, its failure doubles the
back-off (:data:`BACKOFF_S`). Callers route without what the call would have told them,
and count it.

Written here rather than taken from a library: the Python breakers (pybreaker,
aiobreaker) count failures over a window and have no single-probe half-open for asyncio
callers, which is what keeps a frozen server from costing every request its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Literal, TypeVar

T = TypeVar("T")

BACKOFF_S = (1.0, 30.0)
"""The first back-off after a failure, and the most it doubles to."""

Pass = Literal["call", "probe"]


class Open(Exception):
    """The breaker is open: the call was not made."""


class Breaker:
    """``allow()`` before the call; then ``succeeded(p)``, ``failed(p)`` or ``release(p)`` with what it returned."""

    def __init__(self, threshold: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self._streak = 0
        self._clock = clock
        self.failing_since: float | None = None
        self._until = 0.0
        self._backoff_s = BACKOFF_S[0]
        self._probing = False

    async def guard(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` awaited under the breaker: :class:`Open` while it is open (``call`` not
        made); an exception it raises counts as a failure and is raised again."""
        p = self.allow()
        if p is None:
            raise Open()
        try:
            got = await call()
        except asyncio.CancelledError:
            self.release(p)
            raise
        except Exception:
            self.failed(p)
            raise
        self.succeeded(p)
        return got

    def allow(self) -> Pass | None:
        """``call`` while closed, ``probe`` for the one call after the back-off, None: skip it."""
        if self.failing_since is None:
            return "call"
        if self._probing or self._clock() < self._until:
            return None
        self._probing = True
        return "probe"

    def succeeded(self, p: Pass) -> float | None:
        """Close; returns how long it was open (None: it was closed)."""
        if p == "probe":
            self._probing = False
        self._streak = 0
        since, self.failing_since = self.failing_since, None
        self._backoff_s = BACKOFF_S[0]
        return None if since is None else self._clock() - since

    def failed(self, p: Pass) -> bool:
        """Open on the ``threshold``-th call failing in a row (calls under way when it opened
        change nothing); a failed probe doubles the back-off. Returns whether this opened it."""
        now = self._clock()
        if p == "probe":
            self._probing = False
            self._backoff_s = min(BACKOFF_S[1], 2 * self._backoff_s)
            self._until = now + self._backoff_s
            return False
        self._streak += 1
        if self.failing_since is not None or self._streak < self.threshold:
            return False
        self.failing_since = now
        self._backoff_s = BACKOFF_S[0]
        self._until = now + self._backoff_s
        return True

    def release(self, p: Pass) -> None:
        """The call ended without telling anything (cancelled): the next one may probe."""
        if p == "probe":
            self._probing = False


class Outage:
    """Failures of remote calls logged once per outage, and the recovery once: a Redis down
    once made ~20 tracebacks a second. Keyed by call (or stream), so one object serves
    several; callers count every failure in their own metric."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._since: dict[Hashable, float] = {}

    def failed(self, key: Hashable, message: str, *args: object) -> None:
        if key not in self._since:
            self._since[key] = time.monotonic()
            self._log.warning(message, *args)

    def answered(self, key: Hashable, message: str, *args: object) -> None:
        """A call under ``key`` succeeded: ends its outage, if one was on (cheap when none was)."""
        if self._since and key in self._since:
            self._log.info(message + " (after %.1f s)", *args, time.monotonic() - self._since.pop(key))


class Throttle:
    """At most one log line per ``every_s`` for a repeating warning (a forged publisher once
    filled the log with 1,539 lines); the next line says how many were held back. Callers
    count every occurrence in their own metric."""

    __slots__ = ("every_s", "_at", "_held")

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._at = -float("inf")
        self._held = 0

    def due(self) -> str | None:
        """None while the last line is recent (this one is held back); else the suffix the
        line ends with, naming what was held back since the last."""
        now = time.monotonic()
        if now - self._at < self.every_s:
            self._held += 1
            return None
        more = f" ({self._held} more since the last one logged)" if self._held else ""
        self._at, self._held = now, 0
        return more
