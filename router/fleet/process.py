"""This process's side of the fleet-state log (:mod:`router.fleet.log`): what it appends,
through which transports, and the snapshots and expiry that keep the fold current."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.fleet.log import SNAPSHOT_S, FleetState, Load, Record, Snapshot, encode
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

    def append(self, record: Record, *, to_fleet: bool = True) -> None:
        """``to_fleet=False``: the host's workers only (a verdict or a scrape: each replica
        checks its own engines; or a decision already committed to the stream)."""
        records = [record]
        if self.host is not None:
            self.host.append(encode(records))
        if self.fleet is not None and to_fleet:
            self.fleet.append(records)

    def catch_up(self) -> None:
        """Fold what the host's other workers appended (the stream is folded as it arrives)."""
        if self.host is not None:
            self.host.catch_up(self.state)

    async def run_forever(self, follow_s: float) -> None:
        tasks = [asyncio.create_task(self.fleet.run(self.state))] if self.fleet is not None else []
        try:
            last = 0.0
            while True:
                now = time.monotonic()
                if now - last >= SNAPSHOT_S:
                    last = now
                    self.append(Snapshot(self._snapshot()))
                    if self.state.expire():
                        log.info("fleet state: a router process went silent; its load no longer counts")
                self.catch_up()
                await asyncio.sleep(min(follow_s, SNAPSHOT_S))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """Withdraw this process's load from the stream (a ring's stays mapped: a request may still end)."""
        if self.fleet is not None:
            await self.fleet.aclose()
