"""What only RedisIndex promises: one round trip per lookup and per write, clear without SCAN, shared by replicas."""

from __future__ import annotations

import asyncio
import random
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from indexer.index import Worker
from indexer.redis_index import RedisIndex
from support import Proc, free_port, wait_port
from test_index import Reference, batch, removed, stored

M = "qwen3"
A = Worker("a")
B = Worker("b", 1)


@pytest.fixture
def ns() -> str:
    return f"test-{uuid.uuid4().hex}"


@pytest.fixture
def server(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


@pytest.fixture
def index(redis_url: str, ns: str) -> Iterator[RedisIndex]:
    idx = RedisIndex(redis_url, namespace=ns)
    yield idx
    idx.close()


def lookup(idx: RedisIndex, keys: list[int], model: str = M) -> dict:
    async def go() -> dict:
        try:
            return await idx.lookup(model, keys)
        finally:
            await idx.aclose()

    return asyncio.run(go())


def calls(server: redis.Redis) -> dict[str, int]:
    stats = server.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items() if not k.startswith("cmdstat_config")}


def test_lookup_for_every_worker_is_one_script_call(index: RedisIndex, server: redis.Redis) -> None:
    chain = [random.getrandbits(64) for _ in range(512)]
    for i in range(6):
        index.store(M, Worker(f"w{i}"), chain[: 80 * (i + 1)])
    index.store(M, A, chain[:10], "CPU")
    index.store(M, Worker("w0"), chain[:8])

    async def go() -> dict:
        await index.lookup(M, chain)
        server.config_resetstat()
        hits = await index.lookup(M, chain)
        await index.aclose()
        return hits

    hits = asyncio.run(go())
    assert hits == {**{Worker(f"w{i}"): {"GPU": min(80 * (i + 1), 512)} for i in range(6)}, A: {"CPU": 10}}
    made = calls(server)
    assert made["evalsha"] == 1
    assert set(made) <= {"evalsha", "hgetall", "smembers", "hmget"}, made
    assert made["hgetall"] == 1
    assert made["hmget"] == 2 * 4, "one HMGET per (medium, chunk of 16, 64, 256, 176 keys), not per worker"


def test_clear_removes_the_workers_keys_without_scanning_in_bounded_steps(index: RedisIndex, server: redis.Redis, ns: str) -> None:
    index.store(M, A, list(range(1, 20_001)))
    index.store(M, A, list(range(1, 9_001)))
    index.store(M, A, [5, 5], "CPU")
    index.store(M, B, [1, 2])
    server.config_resetstat()
    index.clear(M, A)
    made = calls(server)
    assert not {"scan", "keys", "sscan", "hscan"} & set(made), made
    assert made["evalsha"] == 5, "20,001 logged keys drained at most 4,096 per script call"
    left = sorted(k.decode() for k in server.keys(f"{ns}:*"))
    p = f"{ns}:{{{M}}}:"
    assert left == [f"{ns}:models", f"{p}h:GPU\n0", f"{p}l:1\nGPU", f"{p}m", f"{p}n", f"{p}reg"]
    assert lookup(index, [1, 2]) == {B: {"GPU": 2}}


def test_router_replicas_share_one_index(redis_url: str, index: RedisIndex, ns: str) -> None:
    replica = RedisIndex(redis_url, namespace=ns)
    try:
        index.store(M, A, [1, 2, 3])
        assert lookup(replica, [1, 2, 3]) == {A: {"GPU": 3}}
        replica.clear(M, A)
        assert lookup(index, [1, 2, 3]) == {}
    finally:
        replica.close()


def test_namespaces_do_not_see_each_other(redis_url: str, index: RedisIndex) -> None:
    other = RedisIndex(redis_url, namespace=f"test-{uuid.uuid4().hex}")
    try:
        index.store(M, A, [1])
        assert lookup(other, [1]) == {}
        assert other.block_counts(M) == {}
    finally:
        other.close()


def test_memory_bytes_sums_memory_usage_of_the_namespace(index: RedisIndex, server: redis.Redis, ns: str) -> None:
    index.store(M, A, [random.getrandbits(64) for _ in range(2000)])
    index.store(M, B, [random.getrandbits(64) for _ in range(100)], "CPU")
    expected = sum(server.memory_usage(k) for k in server.keys(f"{ns}:*"))
    assert index.memory_bytes() == expected
    assert expected > 2000 * 8


def test_lookup_works_from_a_new_event_loop(index: RedisIndex) -> None:
    index.store(M, A, [1, 2])
    for _ in range(3):
        assert lookup(index, [1, 2]) == {A: {"GPU": 2}}


def test_backend_names_survive_the_wire(index: RedisIndex) -> None:
    odd = Worker('gpu-ñ "7"\\n', 3)
    index.store(M, odd, [1])
    assert lookup(index, [1]) == {odd: {"GPU": 1}}
    assert index.block_counts(M) == {odd: 1}
    index.clear(M, odd)
    assert index.block_counts(M) == {}


def test_a_medium_with_a_newline_is_rejected(index: RedisIndex) -> None:
    with pytest.raises(ValueError, match="newline"):
        index.store(M, A, [1], "GP\nU")


def test_lookup_script_runs_on_a_read_only_replica(index: RedisIndex, redis_url: str, ns: str, tmp_path: Path) -> None:
    """The lookup script is flagged no-writes, so routers may read from replicas."""
    exe = shutil.which("redis-server")
    assert exe is not None
    primary_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    port = free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path), "--replicaof", "127.0.0.1", str(primary_port)]
    index.store(M, A, [1, 2, 3])
    with Proc(args, tmp_path / "replica.log") as proc:
        wait_port(port, timeout=20)
        replica_url = f"redis://127.0.0.1:{port}/0"
        r = redis.Redis.from_url(replica_url)
        try:
            deadline = time.monotonic() + 20
            while r.info("replication").get("master_link_status") != "up" or not r.exists(f"{ns}:models"):
                assert time.monotonic() < deadline, proc.log()
                time.sleep(0.05)
        finally:
            r.close()
        reader = RedisIndex(replica_url, namespace=ns)
        try:
            assert lookup(reader, [1, 2, 3, 4]) == {A: {"GPU": 3}}
        finally:
            reader.close()


def test_a_batch_of_writes_is_one_script_call(index: RedisIndex, server: redis.Redis) -> None:
    index.store(M, A, [1])
    server.config_resetstat()
    index.apply(M, A, batch(stored([1, 2, 3]), removed([1]), stored([4], "CPU"), removed([9]), stored([2])))
    made = calls(server)
    assert made["evalsha"] == 1
    assert "script|load" not in made and "script|exists" not in made, made
    assert lookup(index, [1, 2, 3]) == {A: {"GPU": 3}}


def test_extra_copies_live_in_a_side_hash_that_goes_with_the_last_extra(index: RedisIndex, server: redis.Redis, ns: str) -> None:
    extras = f"{ns}:{{{M}}}:x:0\nGPU"
    index.store(M, A, [1, 2])
    assert not server.exists(extras)
    index.store(M, A, [2, 2])
    assert server.hgetall(extras) == {(2).to_bytes(8, "big"): b"2"}
    index.remove(M, A, [2, 2])
    assert not server.exists(extras)
    assert lookup(index, [1, 2]) == {A: {"GPU": 2}}
    assert index.block_counts(M) == {A: 2}


def test_writes_survive_a_flushed_script_cache(index: RedisIndex, server: redis.Redis) -> None:
    index.store(M, A, [1, 2])
    server.script_flush()
    index.store(M, A, [2])
    index.remove(M, A, [2])
    assert lookup(index, [1, 2]) == {A: {"GPU": 2}}


@pytest.mark.parametrize("n", [16, 17, 80, 81, 336, 337, 1360, 1361, 5456, 5457])
def test_matches_end_exactly_at_the_lookup_chunk_boundaries(index: RedisIndex, n: int) -> None:
    """Lookup chunks grow 16, 64, 256, 1024, 4096, 4096: a match ending on either side of a boundary."""
    keys = [random.getrandbits(64) for _ in range(n + 20)]
    index.store(M, A, keys[:n])
    index.store(M, B, keys[: n - 1], "CPU")
    assert lookup(index, keys) == {A: {"GPU": n}, B: {"CPU": n - 1}}


def test_more_workers_than_one_mask_page_holds(index: RedisIndex) -> None:
    """Slots 0..31 share one mask hash per medium and 32.. the next; slot 31 is the sign bit of a 32-bit mask."""
    chain = [random.getrandbits(64) for _ in range(120)]
    workers = [Worker(f"w{i}", i % 3) for i in range(70)]
    for i, w in enumerate(workers):
        index.store(M, w, chain[: i + 1], "CPU" if i % 5 == 0 else "GPU")
    want = {w: {"CPU" if i % 5 == 0 else "GPU": i + 1} for i, w in enumerate(workers)}
    assert lookup(index, chain) == want
    index.store(M, workers[31], chain[:40], "CPU")
    want[workers[31]] = {"GPU": 32, "CPU": 8}
    assert lookup(index, chain) == want
    assert index.block_counts(M) == {w: i + 1 + (40 if i == 31 else 0) for i, w in enumerate(workers)}
    for w in workers[::2]:
        index.clear(M, w)
    assert lookup(index, chain) == {w: per for w, per in want.items() if w not in workers[::2]}


def test_a_cleared_slot_is_reused_without_its_old_bits(index: RedisIndex, server: redis.Redis, ns: str) -> None:
    index.store(M, A, [1, 2, 3])
    index.store(M, A, [4], "CPU")
    index.clear(M, A)
    c = Worker("c")
    index.store(M, c, [9])
    assert server.hget(f"{ns}:{{{M}}}:reg", '["c",0]') == b"0"
    assert lookup(index, [1, 2, 3, 4]) == {}
    assert lookup(index, [9]) == {c: {"GPU": 1}}
    assert index.block_counts(M) == {c: 1}


def test_a_drain_left_unfinished_is_invisible_and_resumed_by_the_next_write(index: RedisIndex, server: redis.Redis, ns: str) -> None:
    """As if the process clearing a worker died after the first bounded step."""
    p = f"{ns}:{{{M}}}:"
    index.store(M, A, list(range(1, 101)))
    index.store(M, B, list(range(1, 4)))
    index._write_script(keys=[p + "reg"], args=[p, 2048, 10, "c", '["a",0]', "", 0, 0])
    assert server.hkeys(p + "d") == [b"0"]
    assert server.llen(p + "l:0\nGPU") == 90
    assert lookup(index, list(range(1, 101))) == {B: {"GPU": 3}}
    index.store(M, A, [1])
    assert server.hget(p + "reg", '["a",0]') == b"2", "a draining slot is not reused"
    assert not server.exists(p + "d") and not server.exists(p + "l:0\nGPU")
    assert lookup(index, list(range(1, 101))) == {A: {"GPU": 1}, B: {"GPU": 3}}
    assert server.hlen(p + "h:GPU\n0") == 3


@pytest.mark.parametrize("seed", [1, 2])
def test_random_operations_over_two_mask_pages_agree_with_the_reference(index: RedisIndex, seed: int) -> None:
    rng = random.Random(seed)
    ref = Reference()
    workers = [Worker(f"w{i}") for i in range(40)]
    chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 60))] for _ in range(4)]
    for step in range(400):
        w = rng.choice(workers)
        chain = rng.choice(chains)
        a = rng.randrange(len(chain))
        keys = chain[a : a + rng.randint(1, 30)]
        medium = rng.choice(["GPU", "GPU", "CPU"])
        r = rng.random()
        if r < 0.55:
            index.store(M, w, keys, medium)
            ref.store(w, keys, medium)
        elif r < 0.95:
            index.remove(M, w, keys, medium)
            ref.remove(w, keys, medium)
        else:
            index.clear(M, w)
            ref.clear(w)
        if step % 20 == 0:
            for chain in chains:
                assert lookup(index, chain) == ref.lookup(chain), f"step {step}"
    expected = {}
    for (w, _), held in ref.held.items():
        if held:
            expected[w] = expected.get(w, 0) + len(held)
    assert index.block_counts(M) == expected


def test_churn_keeps_the_clear_logs_bounded(index: RedisIndex, server: redis.Redis, ns: str) -> None:
    """Removes leave their keys in the worker's log; writes rotate the log a chunk at a time to drop them."""
    p = f"{ns}:{{{M}}}:"
    rng = random.Random(1)
    for _ in range(60):
        keys = [rng.getrandbits(64) for _ in range(1000)]
        index.store(M, A, keys)
        index.remove(M, A, keys[:990])
    assert index.block_counts(M) == {A: 600}
    assert server.llen(p + "l:0\nGPU") <= 2 * 600 + 2 * 2048
    index.clear(M, A)
    assert index.block_counts(M) == {}
    assert not server.exists(p + "h:GPU\n0") and not server.exists(p + "l:0\nGPU")


def test_a_log_whose_keys_are_all_removed_goes_with_them(index: RedisIndex, server: redis.Redis, ns: str) -> None:
    p = f"{ns}:{{{M}}}:"
    index.store(M, A, [1, 2, 3])
    index.store(M, A, [1, 2])
    index.remove(M, A, [1, 2, 3])
    assert server.llen(p + "l:0\nGPU") == 3
    index.remove(M, A, [1, 2])
    assert sorted(k.decode() for k in server.keys(f"{ns}:*")) == [f"{ns}:models", f"{p}m", f"{p}reg"]
