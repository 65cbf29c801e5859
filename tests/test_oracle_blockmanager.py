"""The index answers exactly what vLLM's own block manager answered (golden traces).

Each ``blockmanager_trace_*.jsonl`` was recorded from vLLM's real ``KVCacheManager``:
event batches interleaved with probes that carry vLLM's own ``num_computed_tokens``.
The batches go through the real path (a ZMQ publisher on loopback, the
:class:`FleetSubscriber`, the index); at each probe, the leading-block count the index
gives the worker, capped like vLLM (``docs/vllm-facts.md`` §2), must equal vLLM's answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest

from indexer.hashing import BlockHasher, to_int64
from indexer.index import MemoryIndex, Worker
from indexer.redis_index import RedisIndex
from indexer.subscriber import FleetSubscriber, StreamSpec
from kvpub import EnginePublisher
from support import GOLDEN

TRACES = sorted(GOLDEN.glob("blockmanager_trace_*.jsonl"))
MODEL = "Qwen/Qwen3-0.6B"
WORKER = Worker("engine-0", 0)


def test_every_golden_trace_is_present() -> None:
    assert len(TRACES) == 10


def wait_applied(sub: FleetSubscriber, seq: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = sub.stats().get(WORKER)
        if stats is not None and stats.last_seq == seq:
            return
        time.sleep(0.001)
    raise TimeoutError(f"seq {seq} not applied within {timeout}s: {sub.stats().get(WORKER)}")


def replay_trace(path: Path, index, verifier=None) -> tuple[int, int]:
    """Publish the trace's batches, check every probe; returns (probes, non-zero hits)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    meta = lines[0]
    assert meta["kind"] == "meta"
    hasher = BlockHasher(meta["hash_algo"], meta["block_size"], meta["pythonhashseed"], meta["vllm_version"])
    assert hasher.none_hash.hex() == meta["none_hash_hex"]
    pub = EnginePublisher(replay=False, vllm_version=meta["vllm_version"])
    spec = StreamSpec(MODEL, WORKER, pub.endpoint, None, topic="kv-events", vllm_version=meta["vllm_version"])
    sub = FleetSubscriber(index, [spec], verifiers={MODEL: verifier} if verifier else None)
    sub.start()
    probes = hits = 0
    last_seq = None
    try:
        pub.wait_subscribed()
        for line in lines[1:]:
            if line["kind"] == "events":
                seq = pub.publish(bytes.fromhex(line["payload_hex"]))
                assert seq == line["seq"]
                last_seq = seq
                continue
            assert line["kind"] == "probe"
            if last_seq is not None:
                wait_applied(sub, last_seq)
            block_hashes = hasher.hash_blocks(line["token_ids"], lora=line["lora"], cache_salt=line["cache_salt"])
            assert [d.hex() for d in block_hashes] == line["block_hashes_hex"]
            found = asyncio.run(index.lookup(MODEL, [to_int64(d) for d in block_hashes]))
            n = sum(found.get(WORKER, {}).values())
            size = line["block_size"]
            predicted = min(n, (len(line["token_ids"]) - 1) // size) * size
            assert predicted == line["vllm_num_computed_tokens"], (path.name, probes, line["probe_kind"], n)
            assert n == line["num_full_blocks_cached"], (path.name, probes, line["probe_kind"])
            probes += 1
            hits += predicted > 0
        stats = sub.stats()[WORKER]
        assert stats.gaps == stats.lost == stats.restarts == stats.malformed == 0
        assert stats.batches == meta["n_events_lines"]
    finally:
        sub.stop()
        pub.close()
    assert probes == meta["n_probes"]
    return probes, hits


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem.removeprefix("blockmanager_trace_"))
def test_memory_index_matches_vllm(path: Path) -> None:
    probes, hits = replay_trace(path, MemoryIndex())
    assert hits > 100


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem.removeprefix("blockmanager_trace_"))
def test_redis_index_matches_vllm(path: Path, redis_url: str) -> None:
    index = RedisIndex(redis_url, namespace=f"oracle-{uuid.uuid4().hex[:8]}")
    try:
        probes, hits = replay_trace(path, index)
        assert hits > 100
    finally:
        index.close()
