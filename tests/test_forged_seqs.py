"""Forged sequence numbers on an engine's KV-event stream (real ZMQ on loopback).

ZMQ is unauthenticated, so whoever reaches a subscriber can send a batch with any seq. A
seq far ahead (2**64-1, 1e12) or going back without the engine having restarted must not
clear what the index holds for the worker, nor (its batch carrying hashes that do not
verify) switch the worker to re-hash mode: it is counted as suspect and dropped. A real
restart (the engine's seq back to 0, its replay no longer holding what was applied) still
clears the worker, and so does a restart without a replay endpoint once several batches
continue from the new seq.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry

from indexer.events import BlockStored, EventBatch, build_pub_frames, encode_batch
from indexer.hashing import BlockHasher
from indexer.index import MemoryIndex, Worker
from indexer.subscriber import CORROBORATING_BATCHES, FleetSubscriber, StreamSpec
from indexer.verify import SETTLE_AFTER, HashVerifier
from kvpub import EnginePublisher
from support import wait_for

MODEL = "m"
WORKER = Worker("engine-0", 0)
LABELS = {"backend": "engine-0", "dp_rank": "0"}
HASHER = BlockHasher("sha256", 16, "0", "0.33.0")
TOKENS = list(range(16 * 6))
KEYS = HASHER.hash_blocks_int64(TOKENS)
"""The engine's chain: batch i stores block i, so its history is KEYS[:5] and its next batch KEYS[5]."""


def stored(keys: list[int], ts: float = 1.0) -> bytes:
    return encode_batch(EventBatch(ts, [BlockStored(keys, None, [], 16, None, "GPU")], 0), "0.33.0")


def block(i: int, ts: float) -> bytes:
    """The engine's batch storing block ``i`` of its chain, with its tokens (so it verifies)."""
    ev = BlockStored([KEYS[i]], KEYS[i - 1] if i else None, TOKENS[16 * i : 16 * (i + 1)], 16, None, "GPU")
    return encode_batch(EventBatch(ts, [ev], 0), "0.33.0")


FORGED = encode_batch(EventBatch(9.0, [BlockStored(list(range(666, 682)), None, list(range(1000, 1000 + 16 * 16)), 16,
                                                   None, "GPU")], 0), "0.33.0")
"""A forged batch: 16 blocks whose hashes are not those of their tokens."""


def held(index: MemoryIndex, keys: list[int]) -> set[int]:
    async def run() -> set[int]:
        return {k for k in keys if (await index.lookup(MODEL, [k])).get(WORKER)}

    return asyncio.run(run())


@contextmanager
def engine_with_history(replay: bool = True) -> Iterator[tuple[EnginePublisher, MemoryIndex, FleetSubscriber,
                                                               CollectorRegistry]]:
    """An engine that published blocks KEYS[:5] (seqs 0..4), hash-verified, and buffers only
    its last two batches, as a long-running engine holds only recent history: a worker
    cleared and re-synchronised from its replay would lose KEYS[:3]."""
    pub = EnginePublisher(buffer_steps=2, replay=replay)
    index = MemoryIndex()
    registry = CollectorRegistry()
    spec = StreamSpec(MODEL, WORKER, pub.endpoint, pub.replay_endpoint, topic="kv-events")
    verifier = HashVerifier(HASHER, settle_after=SETTLE_AFTER)
    sub = FleetSubscriber(index, [spec], verifiers={MODEL: verifier}, metrics_registry=registry, tail_probe_s=60.0)
    sub.start()
    try:
        pub.wait_subscribed()
        if replay:
            wait_for(lambda: pub.replay_requests == [0], "the connect-time replay request")
        for i in range(5):
            pub.publish(block(i, ts=float(i)))
        wait_for(lambda: sub.stats()[WORKER].last_seq == 4, "the engine's history applied")
        yield pub, index, sub, registry
    finally:
        sub.stop()
        pub.close()


def suspect(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("kvrouter_kv_event_suspect_seqs_total", {**LABELS, "reason": reason}) or 0.0


@pytest.mark.parametrize(("forged_seq", "reason"), [(2**64 - 1, "jump"), (10**12, "jump"), (2, "backwards")],
                         ids=["2^64-1", "1e12", "backwards"])
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_forged_seq_does_not_clear_the_worker(forged_seq: int, reason: str, replay: bool) -> None:
    with engine_with_history(replay) as (pub, index, sub, registry):
        pub.send_raw(build_pub_frames(pub.topic, forged_seq, FORGED))
        wait_for(lambda: suspect(registry, reason) == 1 or sub.stats()[WORKER].restarts + sub.stats()[WORKER].lost > 0,
                 "the forged seq dealt with: counted as suspect, or taken for a restart or a loss")
        assert held(index, KEYS[:5] + [666]) == set(KEYS[:5]), "the worker was cleared"
        assert not sub.stats()[WORKER].rehash_mode, "the forged hashes switched the worker to re-hash mode"
        pub.publish(block(5, ts=5.0))
        wait_for(lambda: sub.stats()[WORKER].last_seq == 5, "the engine's next batch applied")
        assert held(index, KEYS + [666]) == set(KEYS)
        stats = sub.stats()[WORKER]
        assert stats.restarts == stats.lost == 0 and stats.suspect_seqs == 1, stats
        assert stats.verify_match == 6 and stats.verify_mismatch == 0 and not stats.rehash_mode, stats


def test_a_real_restart_still_clears_the_worker() -> None:
    """The engine's seq goes back to 0 and its replay no longer holds the batch applied last."""
    with engine_with_history() as (pub, index, sub, registry):
        pub.seq = 0
        pub.forget_history()
        pub.publish(stored([200], ts=50.0))
        wait_for(lambda: held(index, [200]) == {200}, "the restarted engine's batch applied")
        assert held(index, KEYS[:5]) == set()
        assert sub.stats()[WORKER].restarts == 1 and suspect(registry, "backwards") == 0


def test_a_real_restart_without_a_replay_endpoint_is_taken_once_batches_continue_from_it() -> None:
    with engine_with_history(replay=False) as (pub, index, sub, registry):
        pub.seq = 0
        for i in range(CORROBORATING_BATCHES):
            pub.publish(stored([200 + i], ts=50.0 + i))
        keys = list(range(200, 200 + CORROBORATING_BATCHES))
        wait_for(lambda: held(index, keys) == set(keys), "the restarted engine's batches applied")
        assert held(index, KEYS[:5]) == set()
        stats = sub.stats()[WORKER]
        assert stats.restarts == 1 and stats.last_seq == CORROBORATING_BATCHES - 1
