"""Router replicas' concurrent decisions put in one order through Redis (``router.shared_sequence``).

One process decides a burst's requests one after another, each seeing the ones before.
Replicas share their decisions (:mod:`router.replica_decisions`) and their load (claims,
:mod:`router.replica_load`) within milliseconds, but requests that reach different replicas
within those milliseconds are decided blind to each other: each replica picks the same
least-loaded backend. On the Mooncake slice, whose trace puts up to 16 requests at the same
millisecond, that cost 3 replicas 17-29% of one process's engine TTFT p90 (docs/scaling.md,
"Mooncake's remaining gap: what it is"), and no freshness of the shared view can close it:
only an order can.

**The order.** Before a request is sent, its decision is committed to a Redis stream,
``{namespace}:sequence``, by one script (:data:`_COMMIT`) that Redis runs atomically. The
replica passes its *cursor*: the last entry of the stream it has taken into account. If
other replicas committed entries after it, the script commits nothing and returns them; the
replica counts them (their requests as load on the backends they chose, their prefixes in
kv_aware's memory), decides again with the same policy, and commits again (entries it had
already counted before deciding, from their claims, do not make it decide again). The
:data:`ATTEMPTS`-th decision is committed whatever came meanwhile. So every committed
decision saw every decision committed before it, as in one process, at the price of one
round trip to Redis per request (more in a burst: one per retry). Across replicas this is
optimistic concurrency: no replica waits while another decides. Within one process the
commits go one at a time (:meth:`ReplicaSequence.order`), so that its own decisions see each
other as they do without sequencing.

**No double counting.** An entry counted from the stream is a *reservation* (sender,
decision number) in :class:`router.replica_load.ReplicaLoad`. The sender's message that
carries the request's load claim also carries its decision number
(:meth:`router.replica_decisions.ReplicaDecisions.sent`), and the reservation gives way
to the claim then. A reservation whose claim never comes (the sender died, or failed to send
the request) expires after ``shared_load_ttl_s``.

**Failures.** Redis down or slower than :data:`TIMEOUT_S`: the request goes where this
replica decided alone, as without sequencing, and ``kvrouter_sequenced_decisions{outcome="failed"}``
counts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import redis.asyncio as aredis
from prometheus_client import Counter, Histogram

from router import metrics
from router.choose import uncached
from router.replica_load import process_id
from router.shared_prefix import stored_keys

if TYPE_CHECKING:
    from router.choose import Decided
    from router.replica_decisions import ReplicaDecisions
    from router.replica_load import ReplicaLoad

log = logging.getLogger(__name__)

ATTEMPTS = 4
"""A decision is made at most this many times: the last is committed whatever the others
committed meanwhile (as are the tries after ``2 * ATTEMPTS`` commits refused for entries
it had seen)."""
TIMEOUT_S = 0.25
"""Longest a request waits on one commit before it goes where this replica decided alone."""
STREAM_MAXLEN = 4096

SEQUENCED = Counter(
    "kvrouter_sequenced_decisions",
    "Decisions committed in the replicas' shared order, by outcome: first (no other replica committed "
    "meanwhile), again (decided again after others' commits, same backend), moved (decided again, another "
    "backend), failed (Redis down or slow: sent as decided alone)",
    ["outcome"],
)
SEQUENCE_SECONDS = Histogram(
    "kvrouter_sequence_seconds",
    "Time a decision spent in the replicas' shared order, by stage: wait (for this process's "
    "earlier commits) and commit (its own tries, decisions made again included)",
    ["stage"], buckets=metrics.LATENCY_BUCKETS,
)
SEQUENCE_ENTRIES = Counter(
    "kvrouter_sequence_entries",
    "Other replicas' committed decisions this process counted from the stream before their load claims came",
)

# KEYS[1]: the stream. ARGV: cursor, own replica prefix, force, sender, payload, window ms,
# max length, TTL ms. Entries older than the window are skipped (their claims have come).
_COMMIT = """
local key, cursor, mine = KEYS[1], ARGV[1], ARGV[2]
local t = redis.call('TIME')
local floor = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[6])
local start = '(' .. cursor
if (tonumber(string.match(cursor, '^(%d+)')) or 0) < floor then
  start = floor .. '-0'
end
local out = {0, cursor}
for _, e in ipairs(redis.call('XRANGE', key, start, '+')) do
  out[2] = e[1]
  local f = e[2]
  if string.sub(f[2], 1, #mine) ~= mine then
    out[#out + 1] = f[2]
    out[#out + 1] = f[4]
  end
end
if #out > 2 and ARGV[3] ~= '1' then
  return out
end
out[1] = 1
out[2] = redis.call('XADD', key, 'MAXLEN', '~', ARGV[7], '*', 's', ARGV[4], 'p', ARGV[5])
redis.call('PEXPIRE', key, ARGV[8])
return out
"""


class Entry(msgspec.Struct, array_like=True):
    """One committed decision: the request's load on its backend and its prefix."""

    number: int
    """The sender's decision number (its claim message names it: see the module docstring)."""
    model: str
    backend: str
    prefill: int
    """Prompt tokens the backend must compute (the load claim's prefill change)."""
    context: int
    """Prompt blocks (the load claim's context change)."""
    stored: list[int]
    """The chain's keys at the positions kv_aware's memory stores (:func:`router.shared_prefix.stored_keys`)."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Entry).decode


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class ReplicaSequence:
    """Commits this process's decisions to the replicas' shared order (see the module docstring)."""

    def __init__(self, redis: aredis.Redis, namespace: str, replica: str, worker: int,
                 replica_load: ReplicaLoad, decisions: ReplicaDecisions, window_s: float) -> None:
        self._script = redis.register_script(_COMMIT)
        self.key = f"{namespace}:sequence"
        self.me = process_id(replica, worker)
        self.mine = f"{replica}/"
        self.replica_load = replica_load
        self.decisions = decisions
        self.window_ms = max(1, int(window_s * 1000))
        self.cursor = "0-0"
        self._number = 0
        self._failing = False
        self._lock = asyncio.Lock()

    def applies(self, d: Decided) -> bool:
        """Whether ``d`` is committed to the order: kv_aware decisions with a choice to make."""
        return d.rt.policy.name == "kv_aware" and sum(c.healthy for c in d.candidates) > 1

    async def order(self, d: Decided, decide_again: Callable[[Decided], None]) -> None:
        """Commit ``d``'s decision in the shared order, calling ``decide_again`` while other
        replicas committed decisions it did not see (see the module docstring).

        One commit at a time per process: the caller sends the request as soon as this
        returns, before yielding, so the next of this process's decisions, made once it holds
        the lock, sees this one's load and prefix as it would without the wait on Redis. (The
        price: a process commits at most one decision per Redis round trip.)"""
        waited = self._lock.locked()
        t0 = time.perf_counter()
        async with self._lock:
            t1 = time.perf_counter()
            if waited:
                decide_again(d)
            await self._commit_in_order(d, decide_again)
        metrics.child(SEQUENCE_SECONDS, "wait").observe(t1 - t0)
        metrics.child(SEQUENCE_SECONDS, "commit").observe(time.perf_counter() - t1)

    async def _commit_in_order(self, d: Decided, decide_again: Callable[[Decided], None]) -> None:
        self._number += 1
        d.sequence_number = self._number
        first = d.decision.backend
        decided_at, cursor = time.monotonic(), self.cursor
        overtaken = tries = 0
        while True:
            force = overtaken >= ATTEMPTS - 1 or tries >= 2 * ATTEMPTS
            try:
                committed, news, last = await asyncio.wait_for(self._commit(d, cursor, force, decided_at), TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - Redis down or slow: go as decided alone
                metrics.child(SEQUENCED, "failed").inc()
                if not self._failing:
                    log.warning("shared sequence: cannot commit to Redis (%r); deciding alone until it answers", e)
                self._failing = True
                return
            self._failing = False
            if committed:
                outcome = "moved" if d.decision.backend != first else "again" if overtaken else "first"
                metrics.child(SEQUENCED, outcome).inc()
                return
            tries += 1
            if news:
                overtaken += 1
                decide_again(d)
                decided_at, cursor = time.monotonic(), self.cursor
            else:
                cursor = last  # every entry up to there was counted before the decision

    def sent(self, number: int) -> None:
        """Decision ``number`` was sent: its load claim, pushed just now, names it."""
        self.decisions.sent(number)

    async def _commit(self, d: Decided, cursor: str, force: bool, decided_at: float) -> tuple[bool, bool, str]:
        """One try, for a decision made at ``decided_at`` knowing the stream up to ``cursor``
        (this process's cursor then: another request's commit may move it meanwhile). Returns
        whether it committed, whether the other replicas' entries after ``cursor`` (counted
        either way) hold any the decision did not see, and the stream's last entry. An entry
        counted before the decision, from another request's commit or from its claim, did not
        overtake it: a replica idle for a while finds entries since its last commit that it
        has counted from their claims."""
        backend = d.decision.backend
        chosen = next(c for c in d.candidates if c.backend == backend)
        prefill = uncached(d.ctx.num_tokens, chosen, d.ctx.block_size)
        payload = _encode(Entry(d.sequence_number, d.rt.name, backend, prefill, len(d.ctx.keys),
                                stored_keys(d.ctx.keys) if d.ctx.keys else []))
        out = await self._script(keys=[self.key], args=[cursor, self.mine, int(force), self.me, payload,
                                                        self.window_ms, STREAM_MAXLEN, 4 * self.window_ms])
        last = out[1].decode()
        if _id(last) > _id(self.cursor):
            self.cursor = last
        return bool(int(out[0])), self._count(out[2:], decided_at), last

    def _count(self, flat: list[bytes], decided_at: float) -> bool:
        """Count other replicas' committed decisions: their load until their claims arrive, and
        their prefixes in the policy's memory (as :meth:`ReplicaDecisions.replay` does).
        Returns whether any was unknown at ``decided_at``."""
        fresh, news = 0, False
        for i in range(0, len(flat) - 1, 2):
            sender = flat[i].decode(errors="replace")
            try:
                e = _decode(flat[i + 1])
            except msgspec.DecodeError:
                continue
            known = self.replica_load.known_at(sender, e.number)
            if known is None:
                fresh += 1
                self.replica_load.reserve(sender, e.number, e.backend, e.prefill, e.context)
                memory = self.decisions.memories.get(e.model)
                if memory is not None and e.stored:
                    memory.insert_stored(e.stored, e.backend)
            news = news or known is None or known > decided_at
        if fresh:
            SEQUENCE_ENTRIES.inc(fresh)
        return news
