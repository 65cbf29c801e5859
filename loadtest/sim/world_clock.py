"""A clock that the bench's oracle stops while it asks the simulator a question (bench only).

The oracle (:mod:`loadtest.policies.oracle`) asks the simulator for every engine's exact state,
one blocking question per decision. On a 2-core host at four times real speed, those questions
cost the oracle's router and the simulator milliseconds a decision that a real router of its
quality would not pay, and the client's TTFT counted them: the oracle was no bound at the client.

So the world stops while it asks. The router marks the start and end of each question in a
small shared file; the simulated engines (:class:`loadtest.sim.engine.Engine`) and the bench's
load generator (:class:`loadtest.replay.Replayer`) read their time from :meth:`WorldClock.now`,
wall time less every pause, so during a question no simulated step ends, no arrival is due,
and no client's TTFT grows. Stopping only the engines is not fair: requests would keep
arriving on the wall clock, and the oracle would face more load than the sweep offers.

The file is three numbers behind a sequence counter (a seqlock): writers take ``flock`` on it,
so several router processes may ask at once (the world stays stopped while any of them asks);
readers never block, they retry a read that a write overlapped. Written by hand because the
readers are three unrelated processes on one host and a read costs one syscall-free ``mmap``
copy: a lock or a socket per read would be felt on every token the client times.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

_LAYOUT = struct.Struct("<QddQ")
"""seq (odd while a write is in progress), paused seconds before the current pause, the current
pause's start (``time.monotonic()``; 0 when none), how many askers are pausing now."""
_SEQ = struct.Struct("<Q")
_FIELDS = struct.Struct("<ddQ")
EARLY_S = 1e-4
"""Time still to wait after a sleep that tells a stopped clock from a timer's early wake-up."""
STEP_S = 0.0005
"""How long to sleep again while the clock stands still (a pause lasts milliseconds)."""


async def sleep_until(deadline: float, clock: Callable[[], float]) -> None:
    """Sleep until ``clock()`` reaches ``deadline``, again after a wake-up that finds the clock
    stood still meanwhile. With the wall clock this is one sleep."""
    delay = deadline - clock()
    while delay > 0:
        await asyncio.sleep(delay)
        if (delay := deadline - clock()) <= EARLY_S:
            return
        delay = max(delay, STEP_S)


class WorldClock:
    """Wall time less the pauses recorded in ``path`` (created, zeroed, when it does not exist)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _LAYOUT.size:
                os.ftruncate(fd, _LAYOUT.size)
            self._mm = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        self._lock_fd: int | None = None

    def paused_s(self) -> float:
        """Seconds the world has stood still so far, the pause in progress included."""
        return self._read()[1]

    def now(self) -> float:
        """``time.monotonic()`` less every pause: frozen while one is in progress."""
        t, paused = self._read()
        return t - paused

    def _read(self) -> tuple[float, float]:
        """``(time.monotonic(), paused seconds at that instant)``, read between two equal even
        sequence numbers, so no pause started or ended between the time and the fields."""
        while True:
            seq = _SEQ.unpack_from(self._mm)[0]
            t = time.monotonic()
            total, started, _ = _FIELDS.unpack_from(self._mm, _SEQ.size)
            if seq & 1 == 0 and _SEQ.unpack_from(self._mm)[0] == seq:
                return t, total + (max(0.0, t - started) if started else 0.0)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Stop the world for the block (nested and concurrent pauses are one pause)."""
        self._update(+1)
        try:
            yield
        finally:
            self._update(-1)

    def _update(self, step: int) -> None:
        if self._lock_fd is None:
            self._lock_fd = os.open(self.path, os.O_RDWR)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            seq, total, started, depth = _LAYOUT.unpack_from(self._mm)
            _SEQ.pack_into(self._mm, 0, seq + 1)  # odd: readers retry until the fields are whole
            now = time.monotonic()  # after the odd mark: no reader pairs an earlier time with the old fields
            if step > 0 and depth == 0:
                started = now
            elif step < 0 and depth == 1:
                total, started = total + (now - started), 0.0
            depth = max(0, depth + step)
            _FIELDS.pack_into(self._mm, _SEQ.size, total, started, depth)
            _SEQ.pack_into(self._mm, 0, seq + 2)
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._mm.close()
