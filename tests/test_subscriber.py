"""FleetSubscriber behaviours beyond loss and restarts (tests/test_chaos_events.py has those)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry

from indexer.events import AllBlocksCleared, BlockStored, EventBatch, encode_batch
from indexer.hashing import BlockHasher
from indexer.index import MemoryIndex, Worker
from indexer.subscriber import MAX_BATCH_BLOCKS, FleetSubscriber, StreamSpec, offset_endpoint, specs_from_config
from indexer.verify import HashVerifier
from kvpub import EnginePublisher
from kvconfig import parse_config
from support import wait_for

MODEL = "m"
W0 = Worker("engine-0", 0)
W1 = Worker("engine-1", 0)


def stored(keys: list[int], ts: float = 1.0, version: str = "0.33.0") -> bytes:
    ev = BlockStored(keys, None, list(range(16 * len(keys))), 16, None, "GPU")
    return encode_batch(EventBatch(ts, [ev], 0), version)


def has(index: MemoryIndex, key: int, worker: Worker = W0) -> bool:
    return bool(asyncio.run(index.lookup(MODEL, [key])).get(worker))


def spec(pub: EnginePublisher, worker: Worker = W0) -> StreamSpec:
    return StreamSpec(MODEL, worker, pub.endpoint, pub.replay_endpoint, topic=pub.topic.decode(),
                      vllm_version=pub.vllm_version)


@contextmanager
def two_engines() -> Iterator[tuple[EnginePublisher, EnginePublisher, MemoryIndex, FleetSubscriber]]:
    """Publishers for W0 and W1 feeding one index, both subscribed before the block runs; all closed after."""
    a, b = EnginePublisher(), EnginePublisher()
    index = MemoryIndex()
    sub = FleetSubscriber(index, [spec(a), spec(b, W1)])
    sub.start()
    try:
        a.wait_subscribed()
        b.wait_subscribed()
        yield a, b, index, sub
    finally:
        sub.stop()
        a.close()
        b.close()


def config(**backend) -> object:
    return parse_config({"models": [{"name": "m", "tokenizer": "t", "backends": [{"name": "b", "url": "http://h:1", **backend}]}]})


def test_specs_follow_data_parallel_ranks() -> None:
    specs = specs_from_config(config(kv_events="tcp://10.0.0.1:5557", kv_replay="tcp://10.0.0.1:5600", data_parallel_size=3))
    assert [(s.worker, s.endpoint, s.replay_endpoint) for s in specs] == [
        (Worker("b", r), f"tcp://10.0.0.1:{5557 + r}", f"tcp://10.0.0.1:{5600 + r}") for r in range(3)
    ]
    assert specs_from_config(config()) == []
    assert offset_endpoint("tcp://[::1]:7000", 2) == "tcp://[::1]:7002"


def test_a_bind_address_is_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="bind address"):
        specs_from_config(config(kv_events="tcp://*:5557"))


def test_connecting_late_loads_the_engines_buffered_history() -> None:
    pub = EnginePublisher()
    for i in range(5):
        pub.publish(stored([i]), send=False)
    index = MemoryIndex()
    sub = FleetSubscriber(index, [spec(pub)])
    sub.start()
    try:
        wait_for(lambda: sub.stats()[W0].last_seq == 4, "history replayed on connect")
        assert all(has(index, i) for i in range(5))
        assert sub.stats()[W0].lost == 0 and sub.stats()[W0].connected
    finally:
        sub.stop()
        pub.close()


def test_a_replay_the_engines_router_drops_in_part_is_asked_again_not_lost() -> None:
    """A replay longer than the engine's ROUTER send high-water mark (ZMQ's default, 1000, in
    vLLM; 50 here) loses the messages sent while the pipe is full, and with them often the
    end marker. Those holes lie inside what the engine holds: the subscriber asks again from
    the first one and loses nothing, where it used to clear the worker for each."""
    pub = EnginePublisher(replay_sndhwm=50)
    n = 6_000
    for i in range(n):
        pub.publish(stored([i]), send=False)
    index = MemoryIndex()
    sub = FleetSubscriber(index, [spec(pub)], replay_timeout_s=1.0)
    sub.start()
    try:
        wait_for(lambda: sub.stats()[W0].last_seq == n - 1, "the whole history replayed", timeout=60.0)
        st = sub.stats()[W0]
        assert st.lost == 0 and st.batches == n, st
        assert st.refills > 0, "the high-water mark dropped nothing: the test lost its point"
        assert all(has(index, i) for i in range(0, n, 97)) and has(index, n - 1)
    finally:
        sub.stop()
        pub.close()


@pytest.mark.parametrize("version", ["0.11.0", "0.22.0", "0.28.0"])
def test_replay_works_with_every_reply_framing(version: str) -> None:
    pub = EnginePublisher(vllm_version=version)
    for i in range(3):
        pub.publish(stored([10 + i], version=version), send=False)
    index = MemoryIndex()
    sub = FleetSubscriber(index, [spec(pub)])
    sub.start()
    try:
        wait_for(lambda: sub.stats()[W0].last_seq == 2, f"replay framed like vLLM {version}")
        assert all(has(index, 10 + i) for i in range(3))
    finally:
        sub.stop()
        pub.close()


def test_all_blocks_cleared_clears_only_that_worker() -> None:
    with two_engines() as (a, b, index, _):
        a.publish(stored([1]))
        b.publish(stored([1]))
        wait_for(lambda: has(index, 1) and has(index, 1, W1), "both workers hold block 1")
        a.publish(encode_batch(EventBatch(2.0, [AllBlocksCleared()], 0), "0.33.0"))
        wait_for(lambda: not has(index, 1), "worker 0 cleared")
        assert has(index, 1, W1)


def test_a_backend_removed_from_the_config_is_purged() -> None:
    with two_engines() as (a, b, index, sub):
        a.publish(stored([1]))
        b.publish(stored([2]))
        wait_for(lambda: has(index, 1) and has(index, 2, W1), "both applied")
        sub.update_specs([spec(a)])
        wait_for(lambda: not has(index, 2, W1), "removed backend purged")
        assert has(index, 1) and set(sub.stats()) == {W0}


def test_marked_dead_worker_is_purged_and_resynchronised_when_it_speaks_again() -> None:
    pub = EnginePublisher()
    index = MemoryIndex()
    sub = FleetSubscriber(index, [spec(pub)])
    sub.start()
    try:
        pub.wait_subscribed()
        pub.publish(stored([1]))
        wait_for(lambda: has(index, 1), "applied")
        sub.mark_dead(W0)
        wait_for(lambda: not has(index, 1), "purged")
        assert sub.stats()[W0].dead and sub.stats()[W0].purges == 1
        pub.publish(stored([2]))
        wait_for(lambda: has(index, 2) and has(index, 1), "resynchronised from the engine's buffer")
        assert not sub.stats()[W0].dead
    finally:
        sub.stop()
        pub.close()


def test_worker_disconnected_past_the_grace_period_is_purged() -> None:
    pub = EnginePublisher()
    index = MemoryIndex()
    sub = FleetSubscriber(index, [spec(pub)], dead_grace_s=0.5)
    sub.start()
    try:
        pub.wait_subscribed()
        pub.publish(stored([1]))
        wait_for(lambda: has(index, 1), "applied")
        pub.close()
        wait_for(lambda: not sub.stats()[W0].connected, "disconnect seen")
        assert has(index, 1)
        wait_for(lambda: not has(index, 1), "purged after the grace period")
        assert sub.stats()[W0].dead
    finally:
        sub.stop()


def test_idle_connected_engine_is_never_purged() -> None:
    pub = EnginePublisher()
    index = MemoryIndex()
    sub = FleetSubscriber(index, [spec(pub)], dead_grace_s=0.3, tail_probe_s=0.1)
    sub.start()
    try:
        pub.wait_subscribed()
        pub.publish(stored([1]))
        wait_for(lambda: sub.stats()[W0].probes >= 5, "several idle probes")
        stats = sub.stats()[W0]
        assert has(index, 1) and not stats.dead and stats.restarts == stats.lost == 0
    finally:
        sub.stop()
        pub.close()


def test_rehash_mode_shows_in_stats_and_metrics() -> None:
    engine = BlockHasher("sha256", 16, "1", "0.33.0")
    router = BlockHasher("sha256", 16, "0", "0.33.0")
    tokens = list(range(16 * 10))
    payload = encode_batch(EventBatch(1.0, [BlockStored(engine.hash_blocks_int64(tokens), None, tokens, 16, None, "GPU")], 0), "0.33.0")
    pub = EnginePublisher()
    index = MemoryIndex()
    registry = CollectorRegistry()
    sub = FleetSubscriber(index, [spec(pub)], verifiers={MODEL: HashVerifier(router)}, metrics_registry=registry)
    sub.start()
    try:
        pub.wait_subscribed()
        pub.publish(payload)
        wait_for(lambda: sub.stats()[W0].rehash_mode, "re-hash mode")
        stats = sub.stats()[W0]
        assert stats.verify_mismatch == 10 and stats.verify_match == 0
        assert "hash_seed='1'" in (stats.rehash_reason or "")
        assert registry.get_sample_value("kvrouter_kv_rehash_mode", {"backend": "engine-0", "dp_rank": "0"}) == 1
        found = asyncio.run(index.lookup(MODEL, router.hash_blocks_int64(tokens)))
        assert found == {W0: {"GPU": 10}}
    finally:
        sub.stop()
        pub.close()


def test_stop_returns_promptly_with_unreachable_endpoints() -> None:
    sub = FleetSubscriber(MemoryIndex(), [StreamSpec(MODEL, W0, "tcp://127.0.0.1:9", "tcp://127.0.0.1:9")])
    sub.start()
    assert sub.running
    t0 = time.monotonic()
    sub.stop()
    assert time.monotonic() - t0 < 2.0 and not sub.running


def test_an_oversized_batch_is_skipped_and_counted_and_the_stream_goes_on() -> None:
    """A forged publisher's batch of 2M keys (17 MiB, well-formed): dropped unread (over
    MAX_EVENT_BYTES), counted as malformed, and the next batch still applies; the other
    engine's stream is untouched."""
    huge = encode_batch(EventBatch(1.0, [BlockStored(list(range(1 << 40, (1 << 40) + 2_000_000)), None, [], 16, None,
                                                     "GPU")], 0), "0.33.0")
    with two_engines() as (a, b, index, sub):
        a.publish(huge)
        a.publish(stored([7]))
        b.publish(stored([8]))
        wait_for(lambda: has(index, 7) and has(index, 8, W1), "the batches after the oversized one applied")
        assert sub.stats()[W0].malformed == 1 and sub.stats()[W1].malformed == 0
        assert not has(index, 1 << 40)


def flood_batches(n: int, per: int, base: int = 1 << 40) -> list[bytes]:
    """``n`` well-formed batches of ``per`` distinct made-up keys each, no tokens: what a forger sends."""
    return [encode_batch(EventBatch(1.0, [BlockStored(list(range(base + i * per, base + (i + 1) * per)), None, [], 16,
                                                       None, "GPU")], 0), "0.33.0") for i in range(n)]


def test_a_forged_flood_is_capped_and_the_other_stream_stays_current(caplog: pytest.LogCaptureFixture) -> None:
    """A forger on engine-0's stream sends 5M keys in 100 well-formed batches of 50k (450 KB,
    far under MAX_EVENT_BYTES). Engine-0 keeps at most its cap of keys (twice its capacity),
    the newest, and the drops are counted and logged once; a batch engine-1 publishes while
    the flood is being applied is applied before the flood is through (one thread serves
    both streams; how long it waits is benchmarks/bench_flood.py's to measure)."""
    capacity, n, per = 50_000, 100, 50_000
    flood = flood_batches(n, per)
    a, b = EnginePublisher(), EnginePublisher()
    index = MemoryIndex()
    index.caps.set_capacity(W0, {"GPU": capacity})
    registry = CollectorRegistry()
    sub = FleetSubscriber(index, [spec(a), spec(b, W1)], metrics_registry=registry)
    sub.start()
    try:
        a.wait_subscribed()
        b.wait_subscribed()
        for payload in flood:
            a.publish(payload)
        wait_for(lambda: (sub.stats()[W0].last_seq or 0) >= 10, "the flood under way")
        b.publish(stored([7]))
        wait_for(lambda: index.block_counts(MODEL).get(W1) == 1, "engine-1's batch applied", timeout=30.0)
        applied_then = sub.stats()[W0].last_seq
        wait_for(lambda: sub.stats()[W0].batches == n, "the whole flood applied", timeout=120.0)
        assert applied_then is not None and applied_then < n - 1, applied_then
        assert index.block_counts(MODEL) == {W0: 2 * capacity, W1: 1}
        newest = (1 << 40) + n * per - 1
        assert has(index, newest) and not has(index, 1 << 40)
        st = sub.stats()[W0]
        assert st.capped == n * per - 2 * capacity and st.over_cap and st.malformed == 0
        assert registry.get_sample_value("kvrouter_kv_event_keys_capped_total",
                                         {"backend": "engine-0", "dp_rank": "0"}) == n * per - 2 * capacity
        assert registry.get_sample_value("kvrouter_kv_event_keys_capped_total",
                                         {"backend": "engine-1", "dp_rank": "0"}) is None
        warned = [r for r in caplog.records if "more keys than the worker's cap" in r.getMessage()]
        assert len(warned) == 1, "logged once when the worker passed its cap, not once per batch"
        a.publish(encode_batch(EventBatch(2.0, [AllBlocksCleared()], 0), "0.33.0"))
        a.publish(stored([8]))
        wait_for(lambda: has(index, 8), "the worker cleared and storing again")
        assert index.block_counts(MODEL)[W0] == 1 and not sub.stats()[W0].over_cap
    finally:
        sub.stop()
        a.close()
        b.close()


def test_a_batch_stores_at_most_max_batch_blocks_whatever_the_cap() -> None:
    """With the engine's capacity unknown the cap is ~2M keys, so a forged batch of three
    100k-block events would be verified and stored whole: only its first MAX_BATCH_BLOCKS
    blocks are (a vLLM step never stores that many), the rest counted as capped."""
    per = 100_000
    events = [BlockStored(list(range((1 << 40) + i * per, (1 << 40) + (i + 1) * per)), None, [], 16, None, "GPU")
              for i in range(3)]
    with two_engines() as (a, _, index, sub):
        a.publish(encode_batch(EventBatch(1.0, events, 0), "0.33.0"))
        wait_for(lambda: sub.stats()[W0].batches == 1, "applied")
        assert index.block_counts(MODEL) == {W0: MAX_BATCH_BLOCKS}
        assert sub.stats()[W0].capped == 3 * per - MAX_BATCH_BLOCKS
        assert has(index, (1 << 40) + MAX_BATCH_BLOCKS - 1) and not has(index, (1 << 40) + MAX_BATCH_BLOCKS)


def test_a_worker_stores_into_at_most_four_tiers() -> None:
    """Each tier has its own cap, so forged tier names would multiply it: a fifth tier is refused, counted."""
    media = ["GPU", "CPU", "T3", "T4", "T5", "T6"]
    events = [BlockStored([100 + i, 200 + i], None, [], 16, None, m) for i, m in enumerate(media)]
    with two_engines() as (a, _, index, sub):
        a.publish(encode_batch(EventBatch(1.0, events, 0), "0.33.0"))
        wait_for(lambda: sub.stats()[W0].batches == 1, "applied")
        assert index.block_counts(MODEL) == {W0: 8}
        assert sub.stats()[W0].capped == 4 and sub.stats()[W0].over_cap
        assert has(index, 103) and not has(index, 104)
        a.publish(encode_batch(EventBatch(2.0, [AllBlocksCleared(), events[5]], 0), "0.33.0"))
        wait_for(lambda: has(index, 105), "a cleared worker may name new tiers")


def test_an_event_longer_than_the_cap_is_cut_before_it_is_verified() -> None:
    """Only its first ``cap`` blocks (the head of its chain) can stay in the index, so only
    those are verified: a forged 200k-block event costs the cap's work, not its own."""
    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    tokens = list(range(16 * 30))
    keys = hasher.hash_blocks_int64(tokens)
    pub = EnginePublisher()
    index = MemoryIndex()
    index.caps.set_capacity(W0, {"GPU": 5})
    sub = FleetSubscriber(index, [spec(pub)], verifiers={MODEL: HashVerifier(hasher)})
    sub.start()
    try:
        pub.wait_subscribed()
        pub.publish(encode_batch(EventBatch(1.0, [BlockStored(keys[:10], None, tokens[:160], 16, None, "GPU")], 0),
                                 "0.33.0"))
        pub.publish(encode_batch(EventBatch(1.0, [BlockStored(keys[10:], keys[9], tokens[160:], 16, None, "GPU")], 0),
                                 "0.33.0"))
        pub.publish(flood_batches(1, 200_000)[0])
        wait_for(lambda: sub.stats()[W0].batches == 3, "applied")
        st = sub.stats()[W0]
        assert st.verify_match == 20 and st.verify_mismatch == 0, "the cut event's head still chains to its parent"
        assert st.verify_unverifiable == 10, st
        assert st.capped == 10 + 10 + 200_000 and index.block_counts(MODEL) == {W0: 10}
    finally:
        sub.stop()
        pub.close()
