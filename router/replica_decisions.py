"""kv_aware's decision memory shared across router replicas (hosts) through Redis pub/sub.

A burst of requests sharing a new prefix, spread by a load balancer over R replicas,
must land where its first request went, as it does on one process: that is what the
policy's memory of its own decisions ("speculative insertion",
:class:`router.policies.approx_index.ApproxPrefixIndex`) is for, before the engine's KV
events can say the blocks are there. The workers of one host share that memory through
a ring in shared memory (:mod:`router.shared_prefix`); replicas share it here.

- **Publishing.** Every insert of a :class:`router.shared_prefix.SharedPrefixIndex`
  (the chain's keys at the positions the index stores, and the backend) is queued; one
  background task sends what is queued as one ``PUBLISH`` on
  ``{namespace}:decisions``, then waits ``router.shared_decisions_interval_s`` before the
  next. So a lone insert goes out at once and a busy process sends at most one message
  per interval: no round trip on, or per, request.
- **Replaying.** A second connection subscribes to the channel; each message from
  another replica is replayed into the local index (``insert_stored``, the same call the
  workers' ring uses) as it arrives. Reads stay local: a decision never waits on Redis.
- **Expiry.** A replayed insert lives ``speculative_ttl_s`` from its replay, as a local
  one does from its decision; a message older than that on arrival (by the sender's
  wall clock, so hosts' clocks must agree to well under the TTL) is dropped. A dead
  replica publishes nothing more, so what it said is gone from every other replica
  within the TTL after its last message. Redis keeps nothing: pub/sub stores no message,
  and a subscriber that falls behind is cut by Redis' ``client-output-buffer-limit
  pubsub`` and resubscribes (missing what was sent meanwhile: these are hints).

Why pub/sub and not a stream (``XADD MAXLEN ~`` and a blocking ``XREAD``): a record is
worth something only for ``speculative_ttl_s`` and only to the replicas running now, so
a stream's storage buys nothing but memory to bound, and a reader that rejoins must skip
what is stale anyway. ``benchmarks/bench_workers.py decisions`` measures both
(docs/scaling.md, "Decision quality").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import redis.asyncio as aredis
from prometheus_client import Counter, Histogram

from router.metrics import LATENCY_BUCKETS
from router.replica_load import process_id
from router.shared_prefix import SharedPrefixIndex

log = logging.getLogger(__name__)

DECISIONS_PUBLISHED = Counter(
    "kvrouter_shared_decisions_published", "Decision-memory inserts this process sent to the other replicas",
)
DECISIONS_REPLAYED = Counter(
    "kvrouter_shared_decisions_replayed", "Other replicas' decision-memory inserts replayed into this process's memory",
)
DECISIONS_STALE = Counter(
    "kvrouter_shared_decisions_stale", "Other replicas' inserts dropped on arrival: older than speculative_ttl_s",
)
DECISIONS_DELAY = Histogram(
    "kvrouter_shared_decisions_delay_seconds",
    "Age of another replica's message (its decisions and load claims) on arrival, by the sender's clock: how late "
    "this process learns what the others just routed",
    buckets=LATENCY_BUCKETS,
)
DECISIONS_FAILURES = Counter(
    "kvrouter_shared_decisions_failures", "Publishes and subscriptions of shared decision memory that failed (Redis down or slow)",
)

Record = tuple[str, str, list[int]]
"""(model, backend, the chain's keys at the stored positions)."""
Claim = tuple[int, str, int, int, int]
"""(the sender's change number, backend, in-flight, prefill-token and context-block changes):
one change of the sender's load, pushed at once (:mod:`router.replica_load`, "Claims")."""


class Message(msgspec.Struct, array_like=True):
    sender: str
    """``{replica}/{worker}``: a process skips its own replica's messages (its workers share a ring)."""
    sent_at: float
    """The sender's ``time.time()`` when it published."""
    records: list[Record]
    claims: list[Claim] = []
    """Absent from the messages of routers that do not push claims."""
    sent: list[int] = []
    """Decision numbers of the requests whose first claim is in ``claims``: their entries in
    the replicas' shared order (:mod:`router.replica_sequence`) give way to the claims."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Message).decode


class ReplicaDecisions:
    """Publishes this process's decision-memory inserts and replays the other replicas'
    (see the module docstring). :meth:`attach` each model's memory before :meth:`run_forever`."""

    def __init__(self, url: str, namespace: str, replica: str, worker: int, interval_s: float) -> None:
        self.redis = aredis.Redis.from_url(url, socket_connect_timeout=1.0, socket_keepalive=True)
        self.channel = f"{namespace}:decisions"
        self.me = process_id(replica, worker)
        self._own_replica = f"{replica}/"
        self.interval_s = interval_s
        self.memories: dict[str, SharedPrefixIndex] = {}
        self._queued: list[Record] = []
        self._claims: list[Claim] = []
        self._sent: list[int] = []
        self._wake = asyncio.Event()
        self.on_claims: Callable[[str, float, list[Claim]], None] | None = None
        """Receives the other replicas' claims (:meth:`router.replica_load.ReplicaLoad.on_claims`)."""
        self.on_sent: Callable[[str, list[int]], None] | None = None
        """Receives the decision numbers those claims name (:meth:`router.replica_load.ReplicaLoad.on_sent`)."""

    def attach(self, model: str, memory: SharedPrefixIndex) -> None:
        """Share ``memory`` (one model's policy memory) with the other replicas."""
        self.memories[model] = memory

        def publish(stored: list[int], backend: str) -> None:
            self._queued.append((model, backend, stored))
            self._wake.set()

        memory.publish = publish

    def claim(self, number: int, backend: str, in_flight: int, prefill: int, blocks: int) -> None:
        """Push one change of this process's load to the other replicas with the next message
        (:meth:`router.load.LoadTracker.push_changes`)."""
        self._claims.append((number, backend, in_flight, prefill, blocks))
        self._wake.set()

    def sent(self, number: int) -> None:
        """Name decision ``number`` (committed to the shared order) in the message that carries
        its request's first claim, pushed just before this call."""
        self._sent.append(number)
        self._wake.set()

    async def run_forever(self) -> None:
        await asyncio.gather(self._publish_forever(), self._replay_forever())

    async def _publish_forever(self) -> None:
        failing = False
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queued = self._queued, []
            claims, self._claims = self._claims, []
            sent, self._sent = self._sent, []
            try:
                await self.redis.publish(self.channel, _encode(Message(self.me, time.time(), batch, claims, sent)))
                DECISIONS_PUBLISHED.inc(len(batch))
                failing = False
            except Exception as e:  # noqa: BLE001 - Redis down or slow: these are hints, drop them
                DECISIONS_FAILURES.inc()
                if not failing:
                    log.warning("shared decisions: cannot publish to Redis (%r); the other replicas miss this one's "
                                "decisions until it answers", e)
                failing = True
            await asyncio.sleep(self.interval_s)

    async def _replay_forever(self) -> None:
        failing = False
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                if failing:
                    log.info("shared decisions: subscribed again")
                failing = False
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        self.replay(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis down, restarted or cut this slow subscriber: resubscribe
                DECISIONS_FAILURES.inc()
                if not failing:
                    log.warning("shared decisions: subscription lost (%r); resubscribing", e)
                failing = True
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()

    def replay(self, data: bytes) -> None:
        """One message of another replica's inserts into the local memories."""
        try:
            message = _decode(data)
        except msgspec.DecodeError:
            DECISIONS_FAILURES.inc()
            return
        if message.sender.startswith(self._own_replica):
            return  # this process, or a worker of its supervisor: shared through the ring
        age = time.time() - message.sent_at
        DECISIONS_DELAY.observe(max(0.0, age))
        if message.claims and self.on_claims is not None:
            self.on_claims(message.sender, message.sent_at, message.claims)
        if message.sent and self.on_sent is not None:
            self.on_sent(message.sender, message.sent)
        replayed = 0
        for model, backend, stored in message.records:
            memory = self.memories.get(model)
            if memory is None:
                continue
            if age > memory.ttl_s:
                DECISIONS_STALE.inc()
                continue
            memory.insert_stored(stored, backend)
            replayed += 1
        if replayed:
            DECISIONS_REPLAYED.inc(replayed)

    async def aclose(self) -> None:
        await self.redis.aclose()
