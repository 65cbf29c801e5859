"""The index survives what real fleets do to event streams (real ZMQ on loopback).

Lost PUB messages are repaired by replay, a restarted publisher's stale entries go, a
replay that cannot fill a hole clears the worker and counts the loss, and garbage is
counted and skipped without stopping ingestion.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import closing, contextmanager

import pytest
from prometheus_client import CollectorRegistry

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch, to_key
from indexer.index import MemoryIndex, Worker
from indexer.subscriber import FleetSubscriber, StreamSpec, StreamStats
from kvpub import EnginePublisher, LossyRelay
from support import golden_batches, wait_for

MODEL = "m"
WORKER = Worker("engine-0", 0)


def stored(keys: list[int], ts: float = 1.0, medium: str | None = "GPU") -> bytes:
    ev = BlockStored(keys, None, list(range(16 * len(keys))), 16, None, medium)
    return encode_batch(EventBatch(ts, [ev], 0), "0.33.0")


def removed(keys: list[int], ts: float = 1.0) -> bytes:
    return encode_batch(EventBatch(ts, [BlockRemoved(keys, "GPU")], 0), "0.33.0")


def held(index: MemoryIndex, keys: list[int]) -> set[int]:
    """The keys of ``keys`` the index says WORKER holds (each looked up alone)."""
    async def run() -> set[int]:
        out = set()
        for k in keys:
            if (await index.lookup(MODEL, [k])).get(WORKER):
                out.add(k)
        return out

    return asyncio.run(run())


def stats_of(sub: FleetSubscriber) -> StreamStats:
    return sub.stats()[WORKER]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def engine() -> Iterator[EnginePublisher]:
    pub = EnginePublisher()
    yield pub
    pub.close()


@contextmanager
def subscribed(endpoint: str, replay: str | None, registry: CollectorRegistry,
               **kw) -> Iterator[tuple[MemoryIndex, FleetSubscriber]]:
    """A fresh index fed by one stream (WORKER), its subscriber started, and stopped after the block."""
    index = MemoryIndex()
    spec = StreamSpec(MODEL, WORKER, endpoint, replay, topic="kv-events")
    sub = FleetSubscriber(index, [spec], metrics_registry=registry, **kw)
    sub.start()
    try:
        yield index, sub
    finally:
        sub.stop()


def true_cache(payloads: list[bytes]) -> tuple[set[int], set[int]]:
    """(keys cached at the end, every key ever stored), by applying the batches to a plain set."""
    cached: set[int] = set()
    seen: set[int] = set()
    for p in payloads:
        for ev in decode_batch(p).events:
            if isinstance(ev, BlockStored):
                keys = {to_key(h) for h in ev.block_hashes}
                cached |= keys
                seen |= keys
            elif isinstance(ev, BlockRemoved):
                cached -= {to_key(h) for h in ev.block_hashes}
            elif isinstance(ev, AllBlocksCleared):
                cached.clear()
    return cached, seen


def test_index_converges_to_the_engine_cache_when_a_fifth_of_messages_are_dropped(
    engine: EnginePublisher, registry: CollectorRegistry
) -> None:
    payloads = golden_batches()
    truth, seen = true_cache(payloads)
    assert len(truth) > 50 and len(seen) > len(truth)
    relay = LossyRelay(engine.endpoint, drop=0.2, seed=3)
    with closing(relay), subscribed(relay.endpoint, engine.replay_endpoint, registry, tail_probe_s=0.3) as (index, sub):
        engine.wait_subscribed()
        assert relay.subscribed.wait(10)
        # The subscriber asks for history when it connects; publish after that, so every
        # batch travels through the lossy relay rather than in that first replay.
        wait_for(lambda: engine.replay_requests == [0], "the connect-time replay request")
        for p in payloads:
            engine.publish(p)
        last = len(payloads) - 1
        wait_for(lambda: stats_of(sub).last_seq == last, "the last batch to be applied")
        stats = stats_of(sub)
        assert len(relay.dropped) > 0.1 * len(payloads)
        assert stats.gaps > 0 and stats.replays > 0
        assert stats.lost == 0 and stats.restarts == 0 and stats.malformed == 0
        assert stats.batches == len(payloads)
        assert held(index, sorted(seen)) == truth
        assert index.block_counts(MODEL) == {WORKER: len(truth)}
        assert registry.get_sample_value("kvrouter_kv_event_gaps_total", {"backend": "engine-0", "dp_rank": "0"}) == stats.gaps


def test_lost_tail_messages_are_fetched_by_the_idle_probe(engine: EnginePublisher, registry: CollectorRegistry) -> None:
    with subscribed(engine.endpoint, engine.replay_endpoint, registry, tail_probe_s=0.2) as (index, sub):
        engine.wait_subscribed()
        engine.publish(stored([1, 2]))
        engine.publish(stored([3]))
        wait_for(lambda: stats_of(sub).last_seq == 1, "the sent batches")
        engine.publish(stored([4]), send=False)
        wait_for(lambda: held(index, [1, 2, 3, 4]) == {1, 2, 3, 4}, "the unsent batch to arrive by replay")
        stats = stats_of(sub)
        assert stats.probes >= 1 and stats.last_seq == 2 and stats.lost == 0


def test_publisher_restart_clears_stale_entries(registry: CollectorRegistry) -> None:
    first = EnginePublisher()
    with subscribed(first.endpoint, first.replay_endpoint, registry) as (index, sub):
        first.wait_subscribed()
        for i in range(5):
            first.publish(stored([100 + i], ts=1.0 + i))
        wait_for(lambda: stats_of(sub).last_seq == 4, "first incarnation applied")
        assert held(index, [100, 104]) == {100, 104}
        port, replay_port = first.port, first.replay_port
        first.close()
        second = EnginePublisher(port=port, replay_port=replay_port)
        try:
            second.wait_subscribed()
            second.publish(stored([200], ts=50.0))
            second.publish(stored([201], ts=51.0))
            wait_for(lambda: held(index, [200, 201]) == {200, 201}, "second incarnation applied")
            assert held(index, list(range(100, 105))) == set()
            stats = stats_of(sub)
            assert stats.restarts == 1 and stats.last_seq == 1
        finally:
            second.close()


def test_seq_going_back_on_a_live_stream_is_a_restart(engine: EnginePublisher, registry: CollectorRegistry) -> None:
    with subscribed(engine.endpoint, engine.replay_endpoint, registry) as (index, sub):
        engine.wait_subscribed()
        for i in range(4):
            engine.publish(stored([10 + i], ts=float(i)))
        wait_for(lambda: stats_of(sub).last_seq == 3, "first run applied")
        engine.seq = 0
        engine.forget_history()
        engine.publish(stored([99], ts=100.0))
        wait_for(lambda: held(index, [99]) == {99}, "restarted stream applied")
        assert held(index, [10, 11, 12, 13]) == set()
        assert stats_of(sub).restarts == 1


def test_history_gone_clears_the_worker_and_counts_the_loss(engine: EnginePublisher, registry: CollectorRegistry) -> None:
    with subscribed(engine.endpoint, engine.replay_endpoint, registry) as (index, sub):
        engine.wait_subscribed()
        engine.publish(stored([1]))
        engine.publish(stored([2]))
        wait_for(lambda: stats_of(sub).last_seq == 1, "first batches applied")
        for k in (3, 4, 5):
            engine.publish(stored([k]), send=False)
        engine.forget_history()
        engine.publish(stored([6]))
        wait_for(lambda: stats_of(sub).last_seq == 5, "the batch after the hole")
        assert held(index, [1, 2, 3, 4, 5, 6]) == {6}
        stats = stats_of(sub)
        assert stats.gaps == 1 and stats.lost == 1 and stats.restarts == 0
        assert registry.get_sample_value(
            "kvrouter_kv_event_history_lost_total", {"backend": "engine-0", "dp_rank": "0"}
        ) == 1


def test_gap_without_a_replay_endpoint_is_a_loss(registry: CollectorRegistry) -> None:
    pub = EnginePublisher(replay=False)
    with closing(pub), subscribed(pub.endpoint, None, registry) as (index, sub):
        pub.wait_subscribed()
        pub.publish(stored([1]))
        pub.publish(stored([2]), send=False)
        pub.publish(stored([3]))
        wait_for(lambda: stats_of(sub).last_seq == 2, "the batch after the hole")
        assert held(index, [1, 2, 3]) == {3}
        assert stats_of(sub).lost == 1


def test_garbage_frames_are_counted_and_ingestion_goes_on(engine: EnginePublisher, registry: CollectorRegistry) -> None:
    topic = engine.topic
    with subscribed(engine.endpoint, engine.replay_endpoint, registry) as (index, sub):
        engine.wait_subscribed()
        engine.publish(stored([1]))
        engine.send_raw([topic])
        engine.send_raw([topic, b"abc", stored([7])])
        engine.send_raw([topic, (1).to_bytes(8, "big"), stored([8]), b"extra"])
        engine.publish(b"\xc1 not msgpack")
        engine.publish(b"\x81\xa1a\x01")
        engine.publish(b"")
        engine.publish(stored([2]))
        wait_for(lambda: stats_of(sub).last_seq == 4, "the valid batch after the garbage")
        stats = stats_of(sub)
        assert stats.malformed == 6
        assert stats.gaps == stats.lost == stats.restarts == 0
        assert held(index, [1, 2, 7, 8]) == {1, 2}
        assert registry.get_sample_value(
            "kvrouter_kv_events_malformed_total", {"backend": "engine-0", "dp_rank": "0"}
        ) == 6
