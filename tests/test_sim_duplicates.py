"""An index fed by a simulated engine's events stays exact when the engine caches one hash twice.

vLLM recomputes the last block of a fully cached prompt (it never schedules zero prompt
tokens), so an identical prompt of an exact multiple of ``block_size`` tokens, sent again,
fills a *second* block with the same hash: ``BlockStored`` is published again, and later
one ``BlockRemoved`` per copy evicted. The older copy sits earlier in the free queue, so
eviction takes it first while the engine still holds the hash in the newer one: the
moment an index with set semantics forgets a block the engine holds.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import zmq

from indexer.events import BlockRemoved, BlockStored, decode_batch, parse_pub_frames, to_keys
from indexer.index import MemoryIndex, Worker
from indexer.subscriber import FleetSubscriber, StreamSpec

MODEL = "qwen3"
WORKER = Worker("sim0", 0)
BLOCK = 16
VLLM = "0.22.0"


def _complete(base: str, ids: list[int]) -> None:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "ignore_eos": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def _index_keys_equal(index: MemoryIndex, held: set[int]) -> bool:
    """The index holds exactly ``held`` for the worker: the same number of keys, and each of them."""
    if index.block_counts(MODEL).get(WORKER, 0) != len(held):
        return False
    return all(asyncio.run(index.lookup(MODEL, [k])).get(WORKER) for k in held)


def _drain(sock: zmq.Socket) -> tuple[list[int], list[int]]:
    """Keys of the BlockStored and BlockRemoved events received so far (the index has them already)."""
    stored: list[int] = []
    removed: list[int] = []
    while sock.poll(50):
        _, _, payload = parse_pub_frames(sock.recv_multipart())
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                stored += to_keys(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                removed += to_keys(ev.block_hashes)
    return stored, removed


def test_index_equals_engine_cache_through_duplicate_blocks_and_their_eviction(sim_fleet) -> None:
    """Each round: a 4-block prompt twice (its last block cached twice), then one-block requests
    (15 tokens: they fill no block, so cache nothing) that each evict at most one cached block,
    checking the index against the engine after each."""
    # vLLM 0.22's free queue: a finished request's blocks all go to its tail, so a request
    # that caches nothing still takes (and evicts) the least recently used block. From 0.24
    # its uncached block goes back to the head and the next such request reuses it, evicting
    # nothing, which would leave this test no way to drain the pool block by block.
    sim = sim_fleet("--speedup", "20", "--num-blocks", "40", "--hash-seed", "0", "--vllm-version", VLLM)
    base = sim.http()
    index = MemoryIndex()
    subscriber = FleetSubscriber(index, [StreamSpec(MODEL, WORKER, sim.kv(), sim.replay(), vllm_version=VLLM)])
    subscriber.start()
    monitor = zmq.Context.instance().socket(zmq.SUB)
    monitor.setsockopt(zmq.SUBSCRIBE, b"")
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(sim.kv())
    time.sleep(0.3)
    rng = random.Random(11)
    rounds, kept_by_second_copy, evicted = 3, 0, 0

    def settled() -> dict:
        """The engine's cache once the index agrees with it (a finished request's events are in flight briefly)."""
        deadline = time.monotonic() + 10
        while True:
            cache = httpx.get(base + "/debug/cache").json()
            held = set(cache["block_hashes_int64"])
            if _index_keys_equal(index, held):
                return cache
            assert time.monotonic() < deadline, (
                f"index ({index.block_counts(MODEL)}) != engine cache ({len(held)} blocks, "
                f"{cache['duplicate_blocks']} duplicates)"
            )
            time.sleep(0.05)

    try:
        for _ in range(rounds):
            prompt = [rng.randrange(1, 150_000) for _ in range(4 * BLOCK)]
            _complete(base, prompt)
            first = settled()
            _drain(monitor)
            _complete(base, prompt)
            cache = settled()
            again, _ = _drain(monitor)
            assert len(again) == 1 and again[0] in first["block_hashes_int64"], again
            assert cache["duplicate_blocks"] == first["duplicate_blocks"] + 1
            twice = again[0]
            removed: set[int] = set()
            for _ in range(45):
                _complete(base, [rng.randrange(1, 150_000) for _ in range(BLOCK - 1)])
                cache = settled()
                _, gone = _drain(monitor)
                removed.update(gone)
                evicted += len(gone)
                if twice in removed and twice in cache["block_hashes_int64"]:
                    kept_by_second_copy += 1
            assert twice not in cache["block_hashes_int64"], "the round must evict both copies"
    finally:
        monitor.close()
        subscriber.stop()
    assert evicted == rounds * 5, "every round evicts its 4 prompt blocks and the second copy"
    assert kept_by_second_copy >= rounds, "a copy must be evicted while the engine still holds its hash in another"
