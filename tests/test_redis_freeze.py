"""A frozen Redis index costs requests almost nothing: the lookup breaker routes without it.

A real ``kvrouter serve`` on a Redis index (a redis-server of this test's own, so it can be
stopped with SIGSTOP: it then accepts connections and never answers, the worst case) in
front of two engines that answer at once. While Redis is frozen, requests are routed on
load alone and counted in ``kvrouter_index_lookup_failures_total``; only a probe after each
back-off waits for the lookup timeout, so the median latency barely moves.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import QWEN3_DIR, Proc, RouterProc, free_port, wait_port
from test_big_prompts import QuickEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "m"


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[tuple[Proc, str]]:
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is not installed: `make test` installs it with apt-get"
    port = free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    with Proc(args, tmp_path / "redis.log") as proc:
        wait_port(port, timeout=20)
        try:
            yield proc, f"redis://127.0.0.1:{port}/0"
        finally:
            proc.popen.send_signal(signal.SIGCONT)


def latencies(client: httpx.Client, n: int, tag: str) -> list[float]:
    out = []
    for i in range(n):
        prompt = f"{tag} {i} " + " ".join(f"word{j}" for j in range(60))
        started = time.monotonic()
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        out.append(time.monotonic() - started)
        assert r.status_code == 200, r.text
    return out


def failures(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvrouter_index_lookup_failures_total "):
            return float(line.split()[-1])
    return 0.0


def test_a_frozen_redis_raises_the_median_by_at_most_50_ms(tmp_path: Path, redis_proc: tuple[Proc, str]) -> None:
    proc, url = redis_proc
    with QuickEngine() as a, QuickEngine() as b:
        config = {
            "index": url,
            "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16,
                        "backends": [{"name": "a", "url": a.url}, {"name": "b", "url": b.url}]}],
            "router": {"health_interval_s": 1.0},
        }
        router = RouterProc("router", config, tmp_path, log_level="info")
        try:
            with httpx.Client(base_url=router.url, timeout=30) as client:
                latencies(client, 10, "warm")
                before = statistics.median(latencies(client, 30, "before"))
                failed = failures(client)
                proc.popen.send_signal(signal.SIGSTOP)
                try:
                    during = statistics.median(latencies(client, 40, "frozen"))
                finally:
                    proc.popen.send_signal(signal.SIGCONT)
                assert during - before < 0.050, (before, during)
                assert failures(client) - failed >= 30  # routed without the index, counted
                deadline = time.monotonic() + 60  # the breaker's back-off ends and a probe finds Redis again
                while "Redis index answers again" not in router.log():
                    assert time.monotonic() < deadline, router.log()[-2000:]
                    latencies(client, 1, "after")
                    time.sleep(0.2)
            assert "Traceback" not in router.log()
        finally:
            router.stop()
