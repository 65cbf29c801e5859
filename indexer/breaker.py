"""A circuit breaker for a remote call on the request path (Redis): fail fast while it is down.

A Redis that hangs (SIGSTOP, a full network buffer) answers nothing until each call's
timeout, and every request that asks it pays that timeout: a frozen index made every
request take 1.3 s. After a failure the breaker lets no call through for a back-off,
doubling on each failed probe (:data:`BACKOFF_S`), then lets exactly one through at a time:
that probe's success closes it. Callers route without what the call would have told them,
and count it.

Written here rather than taken from a library: the Python breakers (pybreaker,
aiobreaker) count failures over a window and have no single-probe half-open for asyncio
callers, which is what keeps a frozen server from costing every request its timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

BACKOFF_S = (1.0, 30.0)
"""The first back-off after a failure, and the most it doubles to."""


class Breaker:
    """``allow()`` before the call, then ``succeeded()`` or ``failed()``; one probe at a time while open."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.failing_since: float | None = None
        self._until = 0.0
        self._backoff_s = BACKOFF_S[0]
        self._probing = False

    def allow(self) -> bool:
        """Whether to make the call now (closed, or the one probe after the back-off)."""
        if self.failing_since is None:
            return True
        if self._probing or self._clock() < self._until:
            return False
        self._probing = True
        return True

    def succeeded(self) -> float | None:
        """Close; returns how long it was open (None: it was closed)."""
        self._probing = False
        since, self.failing_since = self.failing_since, None
        self._backoff_s = BACKOFF_S[0]
        return None if since is None else self._clock() - since

    def failed(self) -> bool:
        """Open, or stay open with a doubled back-off; returns whether this opened it."""
        self._probing = False
        opened = self.failing_since is None
        if opened:
            self.failing_since = self._clock()
            self._backoff_s = BACKOFF_S[0]
        else:
            self._backoff_s = min(BACKOFF_S[1], 2 * self._backoff_s)
        self._until = self._clock() + self._backoff_s
        return opened

    def release(self) -> None:
        """The call was cancelled before it told anything: let the next one probe."""
        self._probing = False
