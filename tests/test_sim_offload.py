"""The simulator's CPU offload tier (``--cpu-offload-blocks``), modelled on vLLM's native KV offloading.

A prompt evicted from the GPU but held in the CPU tier comes back as cached and pays a
PCIe load instead of its prefill; the tier's blocks are published with medium ``CPU``,
and an index fed by the events holds exactly what each tier holds. Without the flag
the engine publishes what it published before the tier existed, byte for byte.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import subprocess
import time

import httpx
import pytest

from indexer.events import BlockRemoved, BlockStored, decode_batch, encode_batch, parse_pub_frames
from indexer.hashing import BlockHasher
from indexer.index import MemoryIndex, Worker
from loadtest.sim.engine import Engine, EngineConfig
from loadtest.sim.generation import PlannedOutput
from loadtest.sim.publisher import to_batch
from support import KVROUTER, QWEN3_DIR, indexed_sim, random_conversations

MODEL = "qwen3"

GPU_ONLY_EVENTS_SHA256 = "b87727f9b4170da29390644ef6a40121e0e12ef809889100e856243502aa4a4e"
"""Digest of :func:`_drive_engine`'s published payloads, recorded on the engine before the CPU tier was added
(which freed every block to the free queue's tail: the 0.11-0.23 rule, ``uncached_first=False``)."""
UNCACHED_FIRST_EVENTS_SHA256 = "e6901a4d9e8e62085f639930093dbcd36656a7bd40124f1fc604e5ef47842169"
"""The same with vLLM >= 0.24's freeing rule (partial blocks reused first), recorded when that rule was added."""


def _drive_engine(config: EngineConfig) -> tuple[int, str]:
    """A fixed multi-turn workload stepped by hand (no wall clock): (event batches, sha256 of their payloads)."""
    hasher = BlockHasher("sha256", 16, "0", "0.33.0")
    batches: list = []
    engine = Engine(config, hasher, publish=batches.append)
    rng = random.Random(11)
    systems = [[rng.randrange(1, 150_000) for _ in range(rng.randrange(20, 120))] for _ in range(3)]
    histories: list[list[int]] = []
    sink: asyncio.Queue = asyncio.Queue()
    for step in range(400):
        if step % 3 == 0 and len(engine.waiting) < 4:
            suffix = [rng.randrange(1, 150_000) for _ in range(rng.randrange(5, 90))]
            if histories and rng.random() < 0.6:
                k = rng.randrange(len(histories))
                ids = histories[k] = (histories[k] + suffix)[-400:]
            else:
                ids = rng.choice(systems) + suffix
                histories.append(ids)
            out = [rng.randrange(1, 150_000) for _ in range(rng.randrange(1, 30))]
            engine.add(engine.make_request(ids, PlannedOutput(out, "length"), sink))
        scheduled, duration = engine.schedule(float(step))
        if scheduled:
            engine.complete(scheduled, float(step) + duration)
    digest = hashlib.sha256()
    for i, records in enumerate(batches):
        digest.update(encode_batch(to_batch(records, float(i), 16, True), "0.33.0"))
        digest.update(encode_batch(to_batch(records, float(i), 16, False), "0.22.0"))
    return len(batches), digest.hexdigest()


@pytest.mark.parametrize(("uncached_first", "expected"), [(False, (231, GPU_ONLY_EVENTS_SHA256)), (True, (222, UNCACHED_FIRST_EVENTS_SHA256))])
def test_without_offload_events_are_byte_identical_to_the_gpu_only_engine(uncached_first: bool, expected: tuple[int, str]) -> None:
    small = EngineConfig(num_blocks=48, max_num_batched_tokens=96, max_num_seqs=6, uncached_first=uncached_first)
    assert _drive_engine(small) == expected
    tiered = EngineConfig(num_blocks=48, max_num_batched_tokens=96, max_num_seqs=6, cpu_offload_blocks=200, uncached_first=uncached_first)
    assert _drive_engine(tiered)[1] != expected[1], "the workload must be one the tier changes"


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 150_000) for _ in range(n)]


def _metric_sum(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def test_prompt_evicted_from_gpu_but_held_in_cpu_is_cached_and_loads_between_gpu_hit_and_cold(sim_fleet) -> None:
    """Engine-time TTFT (the histogram's sum per request): GPU hit < CPU load < cold prefill.

    A 6,000-token prompt is 375 blocks; a 400-block pool holds one such prompt, so the
    next one evicts all but the head of the first from the GPU, and the CPU tier keeps
    both. Loading ~350 blocks costs ~350 x 84 us = 30 ms; prefilling them would cost 0.4 s.
    """
    sim = sim_fleet("--num-blocks", "400", "--cpu-offload-blocks", "2000")
    base = sim.http()
    a, b, cold = _ids(1, 6000), _ids(2, 6000), _ids(3, 6000)

    def run(ids: list[int]) -> tuple[int, float, float, float]:
        before = httpx.get(base + "/metrics").text
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
        client_s = time.monotonic() - t0
        assert r.status_code == 200, r.text
        after = httpx.get(base + "/metrics").text
        ttft = _metric_sum(after, "vllm:time_to_first_token_seconds_sum") - _metric_sum(before, "vllm:time_to_first_token_seconds_sum")
        loaded = _metric_sum(after, "vllm:external_prefix_cache_hits_total") - _metric_sum(before, "vllm:external_prefix_cache_hits_total")
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], ttft, loaded, client_s

    run(a)
    run(b)
    gpu_cached, gpu_ttft, gpu_loaded, _ = run(b)
    cpu_cached, cpu_ttft, cpu_loaded, cpu_client = run(a)
    cold_cached, cold_ttft, _, cold_client = run(cold)
    assert gpu_cached == cpu_cached == 5984 and cold_cached == 0
    assert gpu_loaded == 0 and 300 * 16 <= cpu_loaded <= 5984
    assert gpu_ttft < cpu_ttft < cold_ttft, (gpu_ttft, cpu_ttft, cold_ttft)
    assert abs((cpu_ttft - gpu_ttft) - cpu_loaded / 16 * 84e-6) < 0.01, (cpu_ttft, gpu_ttft, cpu_loaded)
    assert cold_ttft > 0.4 and cpu_client < cold_client / 2, (cpu_client, cold_client)
    cache = httpx.get(base + "/debug/cache").json()
    held_cpu = set(cache["cpu_block_hashes_int64"])
    assert len(held_cpu) == 3 * 375 and set(cache["block_hashes_int64"]) <= held_cpu


async def _tier_of(index: MemoryIndex, worker: Worker, keys: list[int]) -> list[str | None]:
    """The best tier the index attributes each key to for ``worker`` (None: not held)."""
    out = []
    for k in keys:
        tiers = (await index.lookup(MODEL, [k])).get(worker, {})
        out.append(next(iter(tiers), None))
    return out


def test_index_fed_by_events_holds_exactly_each_tier_after_eviction_in_both(sim_fleet) -> None:
    """The index's GPU and CPU key sets equal /debug/cache's two lists, proved with the Index API alone.

    With G, C the index's sets for a worker and g, c the engine's: ``block_counts`` gives
    |G| + |C| = |g| + |c|; every key of g looks up as GPU, so g is in G; after every copy of
    g is removed from GPU, every key of c looks up as CPU, so c is in C (and not in G).
    Hence G = g and C = c.
    """
    instances = 2
    sim = sim_fleet("--speedup", "10", "--num-blocks", "200", "--cpu-offload-blocks", "500",
                    "--hash-seed", "0", instances=instances)
    with indexed_sim(sim, MODEL) as (index, workers, monitor):
        asyncio.run(random_conversations(sim, MODEL, 20, seed=5, max_tokens=32, mean_gap_s=0.05))
        counts: dict[tuple[str, str], int] = {}
        while monitor.poll(300):
            for ev in decode_batch(parse_pub_frames(monitor.recv_multipart())[2]).events:
                if isinstance(ev, (BlockStored, BlockRemoved)):
                    key = (type(ev).__name__, ev.medium or "GPU")
                    counts[key] = counts.get(key, 0) + len(ev.block_hashes)
        time.sleep(1.0)
    assert counts.get(("BlockRemoved", "GPU"), 0) > 100 and counts.get(("BlockRemoved", "CPU"), 0) > 100, counts
    assert counts.get(("BlockStored", "CPU"), 0) > 500, counts
    for i, worker in enumerate(workers):
        cache = httpx.get(sim.http(i) + "/debug/cache").json()
        gpu, cpu = cache["block_hashes_int64"], cache["cpu_block_hashes_int64"]
        assert len(cpu) == 500, "the tier must have filled up"
        assert index.block_counts(MODEL).get(worker, 0) == len(gpu) + len(cpu)
        assert set(asyncio.run(_tier_of(index, worker, gpu))) == {"GPU"}
        for _ in range(cache["duplicate_blocks"] + 1):
            index.remove(MODEL, worker, gpu, "GPU")
        assert set(asyncio.run(_tier_of(index, worker, cpu))) == {"CPU"}
        index.remove(MODEL, worker, cpu, "CPU")
        assert worker not in index.block_counts(MODEL)


def test_offload_metrics_are_exported_only_with_a_tier(sim_fleet) -> None:
    plain = sim_fleet()
    tiered = sim_fleet("--cpu-offload-blocks", "64")
    assert "external_prefix_cache" not in httpx.get(plain.http() + "/metrics").text
    assert httpx.get(plain.http() + "/debug/cache").json()["cpu_block_hashes_int64"] == []
    httpx.post(tiered.http() + "/v1/completions", json={"model": MODEL, "prompt": _ids(9, 100), "max_tokens": 1}, timeout=30)
    text = httpx.get(tiered.http() + "/metrics").text
    assert _metric_sum(text, "vllm:external_prefix_cache_queries_total") == 100
    assert _metric_sum(text, "kvrouter_sim:cpu_offload_usage_perc") == 6 / 64


def test_negative_offload_size_is_refused_with_a_clear_error() -> None:
    args = [*KVROUTER, "sim", "--model", MODEL, "--tokenizer", str(QWEN3_DIR), "--cpu-offload-blocks", "-1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--cpu-offload-blocks must not be negative" in done.stderr
