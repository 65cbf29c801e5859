"""The latency model shows what a real engine shows: cache hits and queueing in TTFT, and it keeps time."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest
import yaml
from support import KVROUTER, QWEN3_DIR, Proc, free_port, wait_http

MODEL = "qwen3"


async def _ttft_and_e2e(client: httpx.AsyncClient, base: str, ids: list[int], max_tokens: int) -> tuple[float, float]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    ttft = None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.monotonic() - t0
    assert ttft is not None
    return ttft, time.monotonic() - t0


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 150_000) for _ in range(n)]


def _metric_sum(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def test_same_prompt_is_faster_the_second_time(sim_fleet) -> None:
    sim = sim_fleet("--speedup", "1")
    prompt = _ids(1, 4000)

    async def go() -> tuple[float, float]:
        async with httpx.AsyncClient(timeout=30) as c:
            first, _ = await _ttft_and_e2e(c, sim.http(), prompt, 1)
            second, _ = await _ttft_and_e2e(c, sim.http(), prompt, 1)
            return first, second

    first, second = asyncio.run(go())
    # 4000 uncached tokens: ~0.32 s; then 16 tokens: ~0.02 s (the block holding the last token).
    assert first > 0.25 and second < first / 2, (first, second)


def test_an_idle_engine_answers_at_the_bench_floor(sim_fleet) -> None:
    """The bench's TTFT floor (LatencyModel.prefill_alone_s) is what an idle engine shows."""
    from loadtest.sim.latency import LatencyModel

    sim = sim_fleet("--speedup", "1", "--max-num-batched-tokens", "2048")

    async def go() -> float:
        async with httpx.AsyncClient(timeout=30) as c:
            await _ttft_and_e2e(c, sim.http(), _ids(7, 16), 1)  # warm the HTTP path
            return (await _ttft_and_e2e(c, sim.http(), _ids(8, 5000), 1))[0]

    ttft = asyncio.run(go())
    floor = LatencyModel().prefill_alone_s(5000, 2048)  # 3 chunks: 3 x 20 ms + 5000 x 74.1 us = 0.43 s
    assert floor == pytest.approx(0.4305)
    # At most one step waiting for the loop, plus HTTP and KV-read time on top (and a busy host's).
    assert floor <= ttft < floor + 0.3, (ttft, floor)


def test_ttft_grows_with_queue_depth(sim_fleet) -> None:
    sim = sim_fleet("--speedup", "4")

    async def go() -> tuple[float, list[float]]:
        async with httpx.AsyncClient(timeout=60) as c:
            alone, _ = await _ttft_and_e2e(c, sim.http(), _ids(100, 2000), 1)
            tasks = []
            for i in range(16):
                tasks.append(asyncio.create_task(_ttft_and_e2e(c, sim.http(), _ids(200 + i, 2000), 1)))
                await asyncio.sleep(0.002)
            return alone, [t for t, _ in await asyncio.gather(*tasks)]

    alone, queued = asyncio.run(go())
    # 16 x 2000 uncached tokens share an 8192-token budget: four prefill steps, the last
    # requests wait for all of them.
    assert max(queued) > 3 * alone, (alone, queued)
    assert sorted(queued)[-4:][0] > 2 * sorted(queued)[:4][-1], queued


def _router_in_front(sim, tmp_path, instances: int) -> Proc:
    """``kvrouter serve`` (kv_aware, events on) in front of every engine of ``sim``."""
    port = free_port()
    backends = [{"name": f"sim-{i}", "url": sim.http(i), "kv_events": sim.kv(i), "kv_replay": sim.replay(i)}
                for i in range(instances)]
    cfg = {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "hash_seed": "0", "backends": backends}],
           "router": {"port": port, "policy": "kv_aware"}}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc([*KVROUTER, "serve", "--config", str(path)], tmp_path / "router.log")
    wait_http(f"http://127.0.0.1:{port}/health", timeout=90, proc=proc.popen)
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


def test_eight_instances_at_8x_keep_modelled_time_near_wall_time(sim_fleet, tmp_path) -> None:
    """The engines' clock keeps up while the router and the load generator share the machine
    (within 30% on 2 cores: a speedup applied wrongly is off by 2x or more)."""
    speedup, instances = 8.0, 8
    sim = sim_fleet("--speedup", str(speedup), "--hash-seed", "0", instances=instances)
    router = _router_in_front(sim, tmp_path, instances)

    async def go() -> list[float]:
        rng = random.Random(3)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as c:
            tasks = []
            deadline = time.monotonic() + 20
            n = 0
            while time.monotonic() < deadline:
                ids = _ids(1000 + n, rng.randrange(200, 2000))
                tasks.append(asyncio.create_task(_ttft_and_e2e(c, router.url, ids, 128)))
                n += 1
                await asyncio.sleep(rng.expovariate(8.0))
            return [e2e for _, e2e in await asyncio.gather(*tasks)]

    try:
        wall = asyncio.run(go())
    finally:
        router.stop()
    modelled = sum(_metric_sum(httpx.get(sim.http(i) + "/metrics").text, "vllm:e2e_request_latency_seconds_sum")
                   for i in range(instances))
    count = sum(_metric_sum(httpx.get(sim.http(i) + "/metrics").text, "vllm:e2e_request_latency_seconds_count")
                for i in range(instances))
    assert count == len(wall) > 100
    ratio = sum(wall) * speedup / modelled
    assert 0.85 < ratio < 1.3, f"wall x speedup / modelled = {ratio:.3f}"
