"""Prefix index cost: MemoryIndex and RedisIndex against a naive dict[int, set[Worker]], same run.

Fleet: ``--workers`` workers (default 8) each store ``--blocks`` blocks (default 50k)
through ``apply`` with real ``EventBatch`` objects of 4 BlockStored events x 16 blocks
(decoding is excluded: that is ``indexer.events``' cost). Every worker holds the first
1024 blocks of one long chain (a shared system prompt), worker 0 holds all 8192 of it,
and the rest of each worker's blocks are its own.

Measured, medians over ``--reps`` runs:

* ingest: stored blocks per second through ``apply``, then removed blocks per second;
* lookup: µs per ``await index.lookup`` for 64/512/8192-block chains, *hit* (the chain
  above: all workers match min(n, 1024), worker 0 matches n) and *miss* (unknown keys);
  for Redis also the script's own µs inside Redis (``INFO commandstats``) and the
  asyncio PING round trip, the client's floor on this machine;
* memory: bytes per indexed (block, worker), measured with tracemalloc for the Python
  indexes and as the growth of Redis' ``used_memory`` for Redis (the index's own
  ``memory_bytes()`` figure is printed beside it);
* clear: ms to clear one worker (worker 0, holding half its blocks after the removals).

A redis-server is started on a free loopback port for the run and stopped after.

    .venv/bin/python benchmarks/bench_index.py [--workers 8] [--blocks 50000] [--reps 3] [--no-redis]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence

import redis
import redis.asyncio as aredis

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, to_keys
from indexer.index import DEFAULT_MEDIUM, Hits, MemoryIndex, Worker
from indexer.redis_index import RedisIndex

MODEL = "bench"
CHAIN = 8192
SHARED = 1024
EVENTS_PER_BATCH = 4
BLOCKS_PER_EVENT = 16


class NaiveIndex:
    """The obvious index: ``dict[int, set[Worker]]`` plus a ``set`` of keys per worker for clear.

    Single medium only (the benchmark stores GPU blocks), same leading-prefix lookup.
    """

    def __init__(self) -> None:
        self.holders: dict[int, set[Worker]] = {}
        self.by_worker: dict[Worker, set[int]] = {}

    def apply(self, model: str, worker: Worker, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                mine = self.by_worker.setdefault(worker, set())
                for k in to_keys(ev.block_hashes):
                    self.holders.setdefault(k, set()).add(worker)
                    mine.add(k)
            elif isinstance(ev, BlockRemoved):
                mine = self.by_worker.get(worker, set())
                for k in to_keys(ev.block_hashes):
                    s = self.holders.get(k)
                    if s is not None:
                        s.discard(worker)
                        if not s:
                            del self.holders[k]
                    mine.discard(k)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(model, worker)

    def clear(self, model: str, worker: Worker) -> None:
        for k in self.by_worker.pop(worker, set()):
            s = self.holders.get(k)
            if s is not None:
                s.discard(worker)
                if not s:
                    del self.holders[k]

    async def lookup(self, model: str, keys: Sequence[int]) -> Hits:
        alive = set(self.by_worker)
        hits: Hits = {}
        empty: set[Worker] = set()
        for i, k in enumerate(keys):
            holders = self.holders.get(k, empty)
            for w in alive - holders:
                if i:
                    hits[w] = {DEFAULT_MEDIUM: i}
            alive &= holders
            if not alive:
                break
        else:
            for w in alive:
                hits[w] = {DEFAULT_MEDIUM: len(keys)}
        return hits


def fleet(n_workers: int, blocks: int, seed: int) -> tuple[list[int], dict[Worker, list[list[int]]]]:
    """The long chain and, per worker, its stored keys in events of 16 blocks."""
    rng = random.Random(seed)
    chain = [rng.getrandbits(64) for _ in range(CHAIN)]
    plan: dict[Worker, list[list[int]]] = {}
    for w in range(n_workers):
        held = chain[: CHAIN if w == 0 else SHARED]
        keys = held + [rng.getrandbits(64) for _ in range(max(0, blocks - len(held)))]
        plan[Worker(f"engine-{w}")] = [keys[i : i + BLOCKS_PER_EVENT] for i in range(0, len(keys), BLOCKS_PER_EVENT)]
    return chain, plan


def batches(plan: dict[Worker, list[list[int]]], kind: type) -> list[tuple[Worker, EventBatch]]:
    """Round-robin over workers, as a fleet's streams interleave."""
    out: list[tuple[Worker, EventBatch]] = []
    per_worker = {
        w: [
            EventBatch(
                ts=0.0,
                events=[
                    BlockStored(block_hashes=e, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None, medium="GPU")
                    if kind is BlockStored
                    else BlockRemoved(block_hashes=e, medium="GPU")
                    for e in events[i : i + EVENTS_PER_BATCH]
                ],
                data_parallel_rank=0,
            )
            for i in range(0, len(events), EVENTS_PER_BATCH)
        ]
        for w, events in plan.items()
    }
    longest = max(len(b) for b in per_worker.values())
    for i in range(longest):
        for w, bs in per_worker.items():
            if i < len(bs):
                out.append((w, bs[i]))
    return out


def ingest(index: object, work: list[tuple[Worker, EventBatch]]) -> float:
    """Seconds to apply every batch."""
    apply = index.apply  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for w, b in work:
        apply(MODEL, w, b)
    return time.perf_counter() - t0


def lookup_us(index: object, keys: list[int], reps: int, server: redis.Redis | None = None) -> tuple[float, float]:
    """Median µs per ``await index.lookup`` and, for Redis (``server`` given), µs per lookup script inside Redis.

    The second figure comes from ``INFO commandstats`` (``usec_per_call`` of EVALSHA):
    it separates the script's own cost from the client's round trip.
    """

    async def go() -> tuple[float, float]:
        await index.lookup(MODEL, keys)  # type: ignore[attr-defined]
        if server is not None:
            server.config_resetstat()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            await index.lookup(MODEL, keys)  # type: ignore[attr-defined]
            times.append((time.perf_counter_ns() - t0) / 1000)
        inside = 0.0
        if server is not None:
            inside = server.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
        if isinstance(index, RedisIndex):
            await index.aclose()
        return statistics.median(times), inside

    return asyncio.run(go())


def ping_us(url: str, reps: int = 301) -> float:
    """Median µs of an asyncio redis-py PING: the round trip no lookup can beat on this machine."""

    async def go() -> float:
        client = aredis.Redis.from_url(url)
        await client.ping()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            await client.ping()
            times.append((time.perf_counter_ns() - t0) / 1000)
        await client.aclose()
        return statistics.median(times)

    return asyncio.run(go())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (run with --no-redis)")
    port = free_port()
    d = tempfile.mkdtemp(prefix="bench-redis-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", d],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("redis-server did not start")
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def python_bytes(make: Callable[[], object], plan: dict[Worker, list[list[int]]]) -> tuple[float, int]:
    """tracemalloc growth of an index after ingesting ``plan`` (events freed first), and its own estimate.

    The events are built from fresh int objects and dropped after ingest, so the key
    objects the index keeps are charged to it, as they are when events come off the wire.
    """
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    fresh = {w: [[int(str(k)) for k in e] for e in events] for w, events in plan.items()}
    work = batches(fresh, BlockStored)
    del fresh
    index = make()
    ingest(index, work)
    del work
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    own = index.memory_bytes() if hasattr(index, "memory_bytes") else 0  # type: ignore[attr-defined]
    return used, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=50_000, help="blocks stored per worker")
    ap.add_argument("--reps", type=int, default=3, help="ingest repetitions (lookups run 31-301 times)")
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args()

    chain, plan = fleet(args.workers, args.blocks, seed=1)
    entries = sum(len(e) for events in plan.values() for e in events)
    stores = batches(plan, BlockStored)
    removes = batches({w: events[len(events) // 2 :] for w, events in plan.items()}, BlockRemoved)
    removed_blocks = sum(len(ev.block_hashes) for _, b in removes for ev in b.events)
    miss = [random.getrandbits(64) for _ in range(CHAIN)]
    print(f"fleet: {args.workers} workers x {args.blocks} blocks = {entries} (block, worker) entries; "
          f"batches of {EVENTS_PER_BATCH}x{BLOCKS_PER_EVENT} blocks")

    redis_proc = None
    makers: dict[str, Callable[[], object]] = {"naive": NaiveIndex, "memory": MemoryIndex}
    if not args.no_redis:
        redis_proc, url = start_redis()
        server = redis.Redis.from_url(url)
        counter = iter(range(1_000_000))
        makers["redis"] = lambda: RedisIndex(url, namespace=f"bench{next(counter)}")

    results: dict[str, dict[str, float]] = {}
    try:
        for name, make in makers.items():
            r: dict[str, float] = {}
            store_s, remove_s = [], []
            for rep in range(args.reps):
                if name == "redis":
                    server.flushall()
                    mem0 = server.info("memory")["used_memory"]
                index = make()
                store_s.append(ingest(index, stores))
                if rep == 0:
                    if name == "redis":
                        r["bytes"] = (server.info("memory")["used_memory"] - mem0) / entries
                        r["own_bytes"] = index.memory_bytes() / entries  # type: ignore[attr-defined]
                    stats = server if name == "redis" else None
                    for n in (64, 512, CHAIN):
                        reps = 301 if n <= 512 else 31
                        r[f"hit{n}"], r[f"hit{n}_in"] = lookup_us(index, chain[:n], reps, stats)
                        r[f"miss{n}"], r[f"miss{n}_in"] = lookup_us(index, miss[:n], reps, stats)
                    if name == "redis":
                        r["ping"] = ping_us(url)
                    got = asyncio.run(_check(index, chain[:512]))
                    assert len(got) == args.workers and all(v == {"GPU": 512} for v in got.values()), got
                remove_s.append(ingest(index, removes))
                t0 = time.perf_counter()
                index.clear(MODEL, Worker("engine-0"))  # type: ignore[attr-defined]
                r.setdefault("clear_ms", (time.perf_counter() - t0) * 1000)
                if name == "redis":
                    index.close()  # type: ignore[attr-defined]
                del index
                gc.collect()
            r["store_eps"] = entries / statistics.median(store_s)
            r["remove_eps"] = removed_blocks / statistics.median(remove_s)
            if name != "redis":
                used, own = python_bytes(make, plan)
                r["bytes"] = used / entries
                r["own_bytes"] = own / entries
            results[name] = r
            print(f"  {name}: done")
    finally:
        if redis_proc is not None:
            server.close()
            redis_proc.terminate()
            redis_proc.wait(10)

    report(results)


async def _check(index: object, keys: list[int]) -> Hits:
    hits = await index.lookup(MODEL, keys)  # type: ignore[attr-defined]
    if isinstance(index, RedisIndex):
        await index.aclose()
    return hits


def report(results: dict[str, dict[str, float]]) -> None:
    names = list(results)
    naive = results["naive"]
    rows: list[tuple[str, str, Callable[[float], str], bool]] = [
        ("ingest stored blocks/s", "store_eps", lambda v: f"{v:,.0f}", True),
        ("ingest removed blocks/s", "remove_eps", lambda v: f"{v:,.0f}", True),
    ]
    for n in (64, 512, CHAIN):
        rows.append((f"lookup {n} hit (µs)", f"hit{n}", lambda v: f"{v:,.1f}", False))
        rows.append((f"lookup {n} miss (µs)", f"miss{n}", lambda v: f"{v:,.1f}", False))
    if "redis" in results:
        for n in (64, 512, CHAIN):
            rows.append((f"  redis: lookup {n} hit inside Redis (µs)", f"hit{n}_in", lambda v: f"{v:,.1f}", False))
            rows.append((f"  redis: lookup {n} miss inside Redis (µs)", f"miss{n}_in", lambda v: f"{v:,.1f}", False))
        rows.append(("  redis: asyncio PING round trip (µs)", "ping", lambda v: f"{v:,.1f}", False))
    rows += [
        ("bytes per (block, worker), measured", "bytes", lambda v: f"{v:,.1f}", False),
        ("bytes per (block, worker), memory_bytes()", "own_bytes", lambda v: f"{v:,.1f}" if v else "-", False),
        ("clear one worker (ms)", "clear_ms", lambda v: f"{v:,.1f}", False),
    ]
    head = f"{'':44}" + "".join(f"{n:>14}" for n in names) + "".join(f"{'vs naive ' + n:>18}" for n in names[1:])
    print(head)
    for label, key, fmt, higher_better in rows:
        line = f"{label:44}" + "".join(f"{fmt(results[n][key]) if results[n].get(key) else '-':>14}" for n in names)
        for n in names[1:]:
            base, v = naive.get(key, 0), results[n].get(key, 0)
            ratio = (v / base if higher_better else base / v) if base and v else 0
            line += f"{(f'{ratio:.2f}x' if ratio else '-'):>18}"
        print(line)
    print("(ratios: how many times better than naive; >1 is better)")


if __name__ == "__main__":
    main()
