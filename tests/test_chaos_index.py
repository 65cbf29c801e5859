"""What ``kvrouter chaos`` relies on and found missing in the index layer (real Redis, real ZMQ).

``worker_keys`` is the whole picture ``/debug/index`` serves, the same from both index
implementations. A Redis that does not answer must not fail a request: a lookup answers
no hits and counts it. A Redis that comes back empty must be refilled: the indexer
notices the lost epoch marker and rebuilds every worker from its engine's history, also
the workers whose streams were quiet during the outage (before, only a stream that
happened to write while Redis was down re-synchronised; the others stayed missing).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from indexer.events import BlockStored, EventBatch, encode_batch
from indexer.index import MemoryIndex, Worker
from indexer.redis_index import RedisIndex
from indexer.subscriber import FleetSubscriber, StreamSpec
from kvpub import EnginePublisher
from support import free_port, wait_for

M = "m"


@pytest.fixture
def ns() -> str:
    return f"chaos-{uuid.uuid4().hex}"


@pytest.fixture
def index(redis_url: str, ns: str) -> Iterator[RedisIndex]:
    idx = RedisIndex(redis_url, namespace=ns)
    yield idx
    idx.close()


def forget_namespace(redis_url: str, ns: str) -> None:
    """What a restart without persistence does to one namespace: every key gone."""
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{ns}:*"))
    if keys:
        r.delete(*keys)
    r.close()


def test_worker_keys_is_the_same_picture_from_memory_and_redis(index: RedisIndex) -> None:
    memory = MemoryIndex()
    a, b = Worker("e0"), Worker("e1", 1)
    for idx in (memory, index):
        idx.store(M, a, [1, 2, 3, 2**64 - 1])
        idx.store(M, b, [2, 9])
        idx.store(M, b, [5], "CPU")
        idx.remove(M, a, [3])
    expected = {a: {1, 2, 2**64 - 1}, b: {2, 5, 9}}
    assert memory.worker_keys(M) == expected
    assert index.worker_keys(M) == expected
    assert index.worker_keys("other") == {} and memory.worker_keys("other") == {}


def test_lookup_without_redis_answers_no_hits_and_counts_it() -> None:
    idx = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", namespace="down")

    async def go() -> dict:
        try:
            return await idx.lookup(M, [1, 2, 3])
        finally:
            await idx.aclose()

    assert asyncio.run(go()) == {}
    assert idx.lookup_failures == 1


def test_state_lost_only_after_the_data_went(redis_url: str, index: RedisIndex, ns: str) -> None:
    assert index.state_lost() is False
    index.store(M, Worker("e0"), [1])
    assert index.state_lost() is False
    forget_namespace(redis_url, ns)
    assert index.state_lost() is True
    assert index.state_lost() is False


def test_indexer_rebuilds_quiet_workers_after_redis_lost_its_data(redis_url: str, index: RedisIndex, ns: str) -> None:
    engines = [EnginePublisher(), EnginePublisher()]
    workers = [Worker("e0"), Worker("e1")]
    specs = [StreamSpec(M, w, e.endpoint, e.replay_endpoint, topic="kv-events") for w, e in zip(workers, engines)]
    sub = FleetSubscriber(index, specs, metrics_registry=CollectorRegistry())
    sub.start()
    try:
        for e in engines:
            e.wait_subscribed()
        for i, e in enumerate(engines):
            for k in range(3):
                ev = BlockStored([100 * i + k], None, list(range(16)), 16, None, "GPU")
                e.publish(encode_batch(EventBatch(1.0 + k, [ev], 0), "0.33.0"))
        truth = {workers[0]: {0, 1, 2}, workers[1]: {100, 101, 102}}
        wait_for(lambda: index.worker_keys(M) == truth, "both engines indexed")
        assert index.state_lost() is False
        forget_namespace(redis_url, ns)
        assert index.worker_keys(M) == {}
        assert index.state_lost() is True
        sub.resync_all("test: Redis lost the index")
        wait_for(lambda: index.worker_keys(M) == truth, "both quiet engines rebuilt from their histories")
        assert all(st.index_resets == 1 for st in sub.stats().values())
    finally:
        sub.stop()
        for e in engines:
            e.close()
