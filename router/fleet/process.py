"""This process's side of the fleet-state log (:mod:`router.fleet.log`): appends, transports, snapshots, expiry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.fleet.log import SNAPSHOT_S, Changed, FleetState, Load, Record, Snapshot, coalesce, encode
from router.fleet.ring import Ring
from router.fleet.stream import FleetStream

log = logging.getLogger(__name__)


class FleetLog:
    """Appends to every transport, folds the others' into :attr:`state`, snapshots, expires."""

    def __init__(self, state: FleetState, snapshot: Callable[[], dict[str, Load]], host: Ring | None = None,
                 fleet: FleetStream | None = None) -> None:
        self.state = state
        self._snapshot = snapshot
        self.host = host  # between the workers of this host
        self.fleet = fleet  # between replicas
        self._pending: list[Record] = []  # for the ring, written at the end of this loop iteration

    def append(self, record: Record, *, to_fleet: bool = True) -> None:
        """``to_fleet=False``: the host's workers only (a verdict, a scrape or a committed decision).
        The ring gets load changes once per loop iteration (without a loop, at once), summed."""
        if self.host is not None:
            self._pending.append(record)
            if type(record) is not Changed:  # a decision reaches the other workers before their next one
                self.flush()
            elif len(self._pending) == 1:
                try:
                    asyncio.get_running_loop().call_soon(self.flush)
                except RuntimeError:
                    self.flush()
        if self.fleet is not None and to_fleet:
            self.fleet.append([record])

    def flush(self) -> None:
        if self._pending and self.host is not None:
            self.host.append(encode(coalesce(self._pending)))
            self._pending = []

    def catch_up(self) -> None:
        """Fold what the host's other workers appended (the stream is folded as it arrives)."""
        if self.host is not None:
            self.host.catch_up(self.state)

    async def run_forever(self, follow_s: float) -> None:
        """Snapshots, expiry and the ring every ``follow_s``, and the stream's loops (cancelled with it)."""
        await asyncio.gather(self._tick_forever(follow_s), *([self.fleet.run(self.state)] if self.fleet else []))

    async def _tick_forever(self, follow_s: float) -> None:
        last = 0.0
        while True:
            if time.monotonic() - last >= SNAPSHOT_S:
                last = time.monotonic()
                self.append(Snapshot(self._snapshot()))
                if self.state.expire():
                    log.info("fleet state: a router process went silent; its load no longer counts")
            self.catch_up()
            await asyncio.sleep(min(follow_s, SNAPSHOT_S))

    async def aclose(self) -> None:
        """Withdraw this process's load from the stream (a ring's stays mapped: a request may still end)."""
        if self.fleet is not None:
            await self.fleet.aclose()
