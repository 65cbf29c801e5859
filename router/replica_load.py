"""Load shared across router replicas (hosts) through Redis: tickets that expire.

Every router process publishes its own exact counters per backend (what its
:class:`router.load.BackendLoad` objects hold) under a key of its own,
``{namespace}:load:{replica}/{worker}``, with a TTL of ``router.shared_load_ttl_s``,
every ``router.shared_load_interval_s``; in the same round trip it reads every other
live process's vector. The sum of the *other replicas'* vectors becomes
:attr:`router.load.LoadTracker.remote`, which :class:`router.load.LoadView` adds to
this process's counters (the other workers of the same supervisor are already counted
through the shared segment, so they are skipped by their replica prefix).

A killed replica stops refreshing its key and Redis expires it within the TTL: its load
is gone from every other replica's view then, never left behind as phantom load. A
replica that cannot reach Redis drops the remote figures once they are older than the
TTL (stale numbers would steer traffic by a picture that is gone), counts the failure
(``kvrouter_shared_load_failures``) and routes on what it sees itself and the engines'
scraped queues (``scraped_waiting/running`` in :meth:`router.load.BackendLoad.effective_in_flight`),
which reconcile every estimate with the engine's real queue each scrape.

One Lua script per round: SET own key PX ttl, SADD the member set, read every member's
key, SREM the members whose key expired. Members live in one set so a reader needs no
``SCAN``.

**Claims.** A vector is up to two intervals old when another replica reads it (more
when Redis is busy), so it shows requests that have since reached their first token or
ended as still queued, and does not show requests routed since: on the Mooncake slice, 3
replicas lost 28% of one process's engine TTFT p90 with vectors alone. So every change
of this process's load (a *claim*: a ticket acquired, its first token, its end, a deferred
request's settled estimate) is also pushed at once, numbered, on the shared decisions
channel (:mod:`router.replica_decisions`, with ``router.shared_load_claims``), and each
replica adds the changes it received on top of the sender's last vector until a vector
that covers them arrives (every vector carries the number of changes it includes).
Changes not covered within ``shared_load_ttl_s`` (a sender whose vector stopped) are
dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable

import redis.asyncio as aredis
from prometheus_client import Counter

from router.load import LoadTracker

log = logging.getLogger(__name__)

SHARED_LOAD_FAILURES = Counter(
    "kvrouter_shared_load_failures", "Rounds of publishing and reading replicas' load in Redis that failed",
)
SHARED_LOAD_REPLICAS = Counter(
    "kvrouter_shared_load_expired", "Other replicas' load vectors found expired (a replica stopped refreshing: died or cut off)",
)
SHARED_LOAD_CLAIMS = Counter(
    "kvrouter_shared_load_claims", "Other replicas' routed requests counted from their pushed claims before their next load vector",
)

_Pending = tuple[int, str, int, int, int, float]
"""A claim not yet covered by its sender's vector: (number, backend, in-flight, prefill-token
and context-block changes, arrived at)."""

_ROUND = """
local members, own, prefix = KEYS[1], ARGV[1], ARGV[2]
redis.call('SET', prefix .. own, ARGV[3], 'PX', ARGV[4])
redis.call('SADD', members, own)
local out, gone = {}, 0
for _, m in ipairs(redis.call('SMEMBERS', members)) do
  if m ~= own then
    local v = redis.call('GET', prefix .. m)
    if v then
      out[#out + 1] = m
      out[#out + 1] = v
    else
      redis.call('SREM', members, m)
      gone = gone + 1
    end
  end
end
out[#out + 1] = tostring(gone)
return out
"""


class ReplicaLoad:
    """Publishes this process's load and reads the other replicas' (see the module docstring)."""

    def __init__(self, url: str, namespace: str, replica: str, worker: int, tracker: LoadTracker,
                 interval_s: float, ttl_s: float) -> None:
        self.redis = aredis.Redis.from_url(url, socket_timeout=max(0.5, ttl_s), socket_connect_timeout=max(0.5, ttl_s))
        self.prefix = f"{namespace}:load:"
        self.members = f"{namespace}:load-members"
        self.replica = replica
        self.me = process_id(replica, worker)
        self.tracker = tracker
        self.interval_s = interval_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.ttl_s = ttl_s
        self._script = self.redis.register_script(_ROUND)
        self._read_at = 0.0
        self.peers: dict[str, dict[str, list[int]]] = {}
        """The other replicas' processes' last vectors (``/debug/backends``)."""
        self._covered: dict[str, int] = {}
        """Per other process: the claims its last vector includes."""
        self._pending: dict[str, list[_Pending]] = {}
        self._reserved: dict[tuple[str, int], _Pending] = {}
        """Other processes' decisions counted from the shared order before their claims came
        (:mod:`router.replica_sequence`), by (sender, decision number)."""
        self._sent: dict[tuple[str, int], float] = {}
        """(sender, decision number) of the claims received lately: an entry of the order that
        arrives after its claim is not counted again."""
        self.on_start: Callable[[str], None] | None = None
        """Receives the backend of each request another process's claims say it sent (the
        policies' request share: :meth:`router.core.Router._sent_elsewhere`)."""

    async def run_forever(self) -> None:
        failing = False
        while True:
            started = time.monotonic()
            try:
                await self.round()
                if failing:
                    log.info("shared load: Redis answers again")
                failing = False
            except Exception as e:  # noqa: BLE001 - Redis down or slow: route on local load, keep trying
                SHARED_LOAD_FAILURES.inc()
                if not failing:
                    log.warning("shared load: cannot reach Redis (%r); routing on this replica's load until it answers", e)
                failing = True
                if time.monotonic() - self._read_at > self.ttl_s:
                    self.tracker.remote = {}
                    self.peers = {}
                    self._pending = {}
                    self._reserved = {}
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def round(self) -> None:
        claims = self.tracker.claims  # read with the counters: the vector includes exactly these
        mine = {name: [*load.vector(), claims] for name, load in self.tracker.backends.items()}
        payload = json.dumps(mine, separators=(",", ":"))
        out = await self._script(keys=[self.members], args=[self.me, self.prefix, payload, self.ttl_ms])
        gone = int(out[-1])
        if gone:
            SHARED_LOAD_REPLICAS.inc(gone)
        base: dict[str, list[int]] = {}
        peers: dict[str, dict[str, list[int]]] = {}
        covered: dict[str, int] = {}
        own_replica = self.replica.encode() + b"/"
        for i in range(0, len(out) - 1, 2):
            member, raw = out[i], out[i + 1]
            if member.startswith(own_replica):
                continue  # a worker of this supervisor: counted through the shared segment
            try:
                vector = json.loads(raw)
            except ValueError:
                continue
            sender = member.decode(errors="replace")
            peers[sender] = vector
            for name, v in vector.items():
                acc = base.setdefault(name, [0, 0, 0, 0, 0])
                for j in range(5):
                    acc[j] += int(v[j])
                if len(v) > 5:  # a router that pushes no claims sends 5 numbers
                    covered[sender] = int(v[5])
        self._covered, self.peers = covered, peers
        self._read_at = now = time.monotonic()
        pending = {}
        for sender, claims in self._pending.items():
            done = covered.get(sender, -1)
            kept = [c for c in claims if c[0] > done and now - c[5] < self.ttl_s]
            if kept:
                pending[sender] = kept
        self._pending = pending
        self._reserved = {k: r for k, r in self._reserved.items() if now - r[5] < self.ttl_s}
        self._sent = {k: t for k, t in self._sent.items() if now - t < 2 * self.ttl_s}
        remote = {name: (v[0], v[1], v[2], v[3], v[4]) for name, v in base.items()}
        self.tracker.remote = _with(remote, [c for claims in pending.values() for c in claims] + list(self._reserved.values()))

    def on_claims(self, sender: str, sent_at: float, claims: list[tuple[int, str, int, int, int]]) -> None:
        """Another replica's claims, pushed as it routed (see "Claims" above): counted at once,
        unless the message is older than the TTL (its vector has covered them by then)."""
        if time.time() - sent_at > self.ttl_s:
            return
        done = self._covered.get(sender, -1)
        now = time.monotonic()
        fresh = [(n, b, i, p, k, now) for n, b, i, p, k in claims if n > done and b in self.tracker.backends]
        if not fresh:
            return
        self._pending.setdefault(sender, []).extend(fresh)
        self.tracker.remote = _with(self.tracker.remote, fresh)
        SHARED_LOAD_CLAIMS.inc(len(fresh))
        if self.on_start is not None:
            for c in fresh:
                if c[2] > 0:  # a request sent (its end and first token change no in-flight count up)
                    self.on_start(c[1])

    def known_at(self, sender: str, number: int) -> float | None:
        """When this process first counted ``sender``'s decision ``number`` (reserved from the
        shared order, or its claim received), or None."""
        r = self._reserved.get((sender, number))
        return r[5] if r is not None else self._sent.get((sender, number))

    def reserve(self, sender: str, number: int, backend: str, prefill: int, context: int) -> None:
        """Count another process's decision, read from the shared order, as one request on
        ``backend`` until its claim arrives (:meth:`on_sent`)."""
        if backend in self.tracker.backends:
            r = self._reserved[(sender, number)] = (0, backend, 1, prefill, context, time.monotonic())
            self.tracker.remote = _with(self.tracker.remote, [r])

    def on_sent(self, sender: str, numbers: list[int]) -> None:
        """The claims of ``sender``'s decisions ``numbers`` arrived (and were counted by
        :meth:`on_claims`): their reservations give way."""
        now = time.monotonic()
        gone: list[_Pending] = []
        for number in numbers:
            key = (sender, number)
            r = self._reserved.pop(key, None)
            self._sent.setdefault(key, now if r is None else r[5])
            if r is not None:
                gone.append((0, r[1], -r[2], -r[3], -r[4], now))
        if gone:
            self.tracker.remote = _with(self.tracker.remote, gone)

    async def aclose(self) -> None:
        """Withdraw this process's vector at once (a clean stop need not wait for the TTL)."""
        try:
            await self.redis.delete(self.prefix + self.me)
            await self.redis.srem(self.members, self.me)
        except Exception as e:  # noqa: BLE001 - the TTL removes it anyway
            log.debug("shared load: could not withdraw %s: %r", self.me, e)
        await self.redis.aclose()


def process_id(replica: str, worker: int) -> str:
    """``{replica}/{worker}.{pid}``: one router process's name in Redis (its load key, its
    decisions' sender). The pid makes a worker its supervisor restarted a new sender, whose
    claim numbers start again at 1, not the dead one's continuation; the ``{replica}/``
    prefix is what the workers of one supervisor skip in each other's messages."""
    return f"{replica}/{worker}.{os.getpid()}"


def _with(remote: dict[str, tuple[int, int, int, int, int]],
          claims: list[_Pending]) -> dict[str, tuple[int, int, int, int, int]]:
    """``remote`` (summed vectors, never mutated: policies may hold it) with ``claims`` added:
    requests in flight, prefill tokens queued, prompt blocks in the context (decode sequences
    and unique blocks are left to the sender's next vector). Only the claimed backends' entries
    are rebuilt, so a message costs its claims, not the fleet's size."""
    out = dict(remote)
    for _, backend, in_flight, prefill, blocks, _ in claims:
        r = out.get(backend, (0, 0, 0, 0, 0))
        out[backend] = (r[0] + in_flight, r[1] + prefill, r[2], r[3], r[4] + blocks)
    return out
