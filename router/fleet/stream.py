"""The fleet-state log between router replicas: one Redis Stream per fleet (``router.fleet_state``).

Each process appends entries to ``{namespace}:fleet`` (its name and a batch of records, in its
order, load changes summed), at most one per :data:`FLUSH_S`, and folds
the other replicas' entries as a blocking ``XREAD`` brings them (its own host's workers reach it
through their ring). kv_aware's decisions are committed by one atomic script
(:meth:`FleetStream.order`) only if no other process decided since the last entry folded; else
the decision is made again on those entries (the :data:`ATTEMPTS`-th goes whatever came): each
decision sees every one committed before it, as in one process. Redis down or slower than
:data:`TIMEOUT_S`: decisions go as decided alone and a snapshot re-bases the others later.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aredis

from indexer.breaker import Breaker, Open, Outage
from router import metrics
from router.fleet.log import Decided, FleetState, Record, Snapshot, coalesce, decode, encode

log = logging.getLogger(__name__)

FLUSH_S = 0.002
ATTEMPTS = 4
TIMEOUT_S = 0.25
MAXLEN = 8192
BLOCK_MS = 1000

# KEYS[1]: the stream. ARGV: cursor, own replica prefix, force, sender, window ms, max length,
# payload, TTL ms. Returns committed (0/1), the last entry's id, then each other process's
# entry after the cursor: id, sender, decided flag, records.
_COMMIT = """
local key, cursor, mine = KEYS[1], ARGV[1], ARGV[2]
local t = redis.call('TIME')
local floor = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[5])
local start = '(' .. cursor
if (tonumber(string.match(cursor, '^(%d+)')) or 0) < floor then start = floor .. '-0' end
local out, news = {0, cursor}, false
for _, e in ipairs(redis.call('XRANGE', key, start, '+')) do
  out[2] = e[1]
  if string.sub(e[2][2], 1, #mine) ~= mine then
    for _, v in ipairs({e[1], e[2][2], e[2][4], e[2][6]}) do out[#out + 1] = v end
    news = news or e[2][4] == '1'
  end
end
if news and ARGV[3] ~= '1' then return out end
out[1] = 1
out[2] = redis.call('XADD', key, 'MAXLEN', '~', ARGV[6], '*', 's', ARGV[4], 'd', '1', 'r', ARGV[7])
redis.call('PEXPIRE', key, ARGV[8])
return out
"""


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class FleetStream:
    """This process's side of the replicas' stream (see the module docstring)."""

    def __init__(self, url: str, namespace: str, replica: str, worker: int, ttl_s: float) -> None:
        timeout = max(0.5, ttl_s)
        self.redis = aredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._reader = aredis.Redis.from_url(url, socket_timeout=BLOCK_MS / 1000 + timeout,
                                             socket_connect_timeout=timeout)
        self._script = self.redis.register_script(_COMMIT)
        self.key = f"{namespace}:fleet"
        self.me = f"{replica}/{worker}.{os.getpid()}"  # the pid: a restarted worker is a new sender
        self.mine = f"{replica}/"  # what this host's workers skip (their ring brings them)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._queue: list[Record] = []
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self.cursor = "0-0"  # the last entry folded (the reader and the commits both advance it)
        self.state: FleetState | None = None
        self._outage = Outage(log)
        self._breaker = Breaker()  # a frozen Redis cost every decision TIMEOUT_S, and more behind an append

    def append(self, records: list[Record]) -> None:
        self._queue += records
        self._wake.set()

    async def run(self, state: FleetState) -> None:
        self.state = state
        self.cursor = f"{int(time.time() * 1000) - self.ttl_ms}-0"
        await asyncio.gather(self._flush_forever(), self._read_forever())

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            async with self._lock:
                records, self._queue = coalesce(self._queue), []
                try:
                    await self._breaker.guard(lambda: self._add(records))
                    self._failed("append", None)
                except Exception as e:  # noqa: BLE001 - Redis down, slow or skipped: the next snapshot re-bases the others
                    self._failed("append", e)
            await asyncio.sleep(FLUSH_S)

    async def _add(self, records: list[Record]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        decided = int(any(isinstance(r, Decided) for r in records))
        pipe.xadd(self.key, {"s": self.me, "d": decided, "r": encode(records)}, maxlen=MAXLEN, approximate=True)
        pipe.pexpire(self.key, 4 * self.ttl_ms)
        await pipe.execute()

    async def _read_forever(self) -> None:
        while True:
            try:
                out = await self._reader.xread({self.key: self.cursor}, count=1000, block=BLOCK_MS)
                for _, entries in out or []:
                    for entry_id, fields in entries:
                        self._fold(entry_id.decode(), fields.get(b"s", b""), fields.get(b"r", b""))
                self._failed("read", None)
            except Exception as e:  # noqa: BLE001 - Redis down or restarted: read again from where it was
                self._failed("read", e)
                await asyncio.sleep(0.5)

    def _fold(self, entry_id: str, sender: bytes, payload: bytes) -> None:
        if _id(entry_id) <= _id(self.cursor):  # folded already (by the reader or a commit)
            return
        self.cursor = entry_id
        name = sender.decode(errors="replace")
        if name.startswith(self.mine) or self.state is None:
            return
        got = decode(payload)
        if got is None or got[1]:
            metrics.child(metrics.FLEET_LOG_FAILURES, "decode").inc(1 if got is None else got[1])
            if got is None:
                return
        age = max(0.0, time.time() - _id(entry_id)[0] / 1000)
        metrics.FLEET_LOG_DELAY.observe(age)
        self.state.fold(name, got[0], age)

    async def order(self, record: Callable[[], Decided], again: Callable[[], None]) -> bool:
        """Commit ``record()``, calling ``again`` to decide anew while others' decisions overtake it
        (False: it goes as decided alone); one at a time, so this process's next decision sees it."""
        if self._breaker.failing_since is not None and self._lock.locked():  # Redis down and a try under way
            metrics.child(metrics.SEQUENCED, "failed").inc()
            return False
        waited = self._lock.locked()
        t0 = time.perf_counter()
        async with self._lock:
            t1 = time.perf_counter()
            if waited:
                again()
            first, overtaken = "", 0
            while True:
                r = record()
                first = first or r.backend
                args = [self.cursor, self.mine, int(overtaken >= ATTEMPTS - 1), self.me, self.ttl_ms, MAXLEN,
                        encode([r]), 4 * self.ttl_ms]
                try:
                    out: list[Any] = await self._breaker.guard(
                        lambda: asyncio.wait_for(self._script(keys=[self.key], args=args), TIMEOUT_S))
                except Exception as e:  # noqa: BLE001 - Redis down, slow or skipped: go as decided alone
                    metrics.child(metrics.SEQUENCED, "failed").inc()
                    self._failed("order", e)
                    return False
                self._failed("order", None)
                for i in range(2, len(out) - 3, 4):  # id, sender, decided flag, records
                    self._fold(out[i].decode(), out[i + 1], out[i + 3])
                if int(out[0]):  # every other entry before it was just folded:
                    self.cursor = max(self.cursor, out[1].decode(), key=_id)
                    break
                overtaken += 1
                again()
        metrics.child(metrics.SEQUENCED, "moved" if r.backend != first else "again" if overtaken else "first").inc()
        metrics.child(metrics.SEQUENCE_SECONDS, "wait").observe(t1 - t0)
        metrics.child(metrics.SEQUENCE_SECONDS, "commit").observe(time.perf_counter() - t1)
        return True

    def _failed(self, what: str, e: Exception | None) -> None:  # a skip while the breaker is open is no failure
        if e is None:
            self._outage.answered(what, "fleet state: Redis answers again (%s)", what)
        elif not isinstance(e, Open):
            metrics.child(metrics.FLEET_LOG_FAILURES, what).inc()
            self._outage.failed(what, "fleet state: cannot %s the replicas' stream in Redis (%s: %s); this replica "
                                "routes on what it sees itself until Redis answers", what, type(e).__name__, e)

    async def aclose(self) -> None:
        """Withdraw this process's load at once (a clean stop need not wait for the TTL)."""
        try:
            await asyncio.wait_for(self._add([Snapshot({})]), TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the TTL removes it anyway
            log.debug("fleet state: could not withdraw %s: %s", self.me, e)
        await self.redis.aclose()
        await self._reader.aclose()
