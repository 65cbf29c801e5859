"""Kubernetes probes, ``GET /v1/models/{id}`` and the worker count under a CPU quota.

``/livez`` says the process and its loop answer, whatever the fleet; ``/readyz`` says the
router can route (every model has a healthy backend) and is not draining (a draining router
has closed its listener: tests/test_graceful.py). On a real ``kvrouter serve`` in front of
:class:`SlowEngine`: both with the fleet up and with every backend down.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web

from router.http.workers import cgroup_cpus, default_workers
from support import QWEN3_DIR, LoopbackEngine, RouterProc, openai_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "m"


class SlowEngine(LoopbackEngine):
    """Answers at once, or after 4 s for the prompt ``"slow"``."""

    async def _answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("prompt") == "slow":
            await asyncio.sleep(4)
        return web.json_response({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._answer)


def start(engine: SlowEngine, tmp: Path) -> RouterProc:
    config = {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16,
                          "lora_adapters": [{"name": "m-lora", "path": "/adapters/x", "id": 1}],
                          "backends": [{"name": "a", "url": engine.url}]}],
              "router": {"health_interval_s": 0.5, "drain_timeout_s": 10}}
    return RouterProc("probes", config, tmp, log_level="info")


@pytest.fixture
def engine() -> Iterator[SlowEngine]:
    with SlowEngine() as e:
        yield e


def status(client: httpx.Client, path: str) -> int:
    return client.get(path).status_code


def test_models_by_id_and_the_openai_sdks_retrieve(engine: SlowEngine, tmp_path: Path) -> None:
    router = start(engine, tmp_path)
    try:
        assert httpx.get(router.url + "/v1/models/m").json()["id"] == "m"
        assert httpx.get(router.url + "/v1/models/m-lora").json()["parent"] == "m"
        r = httpx.get(router.url + "/v1/models/nope")
        assert r.status_code == 404 and openai_error(r.content)["code"] == "model_not_found"
        sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        assert sdk.models.retrieve("m").id == "m"
    finally:
        router.stop()


def test_livez_stays_up_while_readyz_follows_the_fleet_and_the_drain(engine: SlowEngine, tmp_path: Path) -> None:
    router = start(engine, tmp_path)
    try:
        with httpx.Client(base_url=router.url, timeout=30) as client:
            assert status(client, "/livez") == 200 and status(client, "/readyz") == 200

            engine.stop()  # every backend down
            deadline = time.monotonic() + 15
            while status(client, "/readyz") != 503:
                assert time.monotonic() < deadline, "readyz still 200 with every backend down"
                time.sleep(0.2)
            assert status(client, "/livez") == 200 and status(client, "/health") == 503
    finally:
        router.stop()


def test_the_default_worker_count_respects_the_cgroup_cpu_quota(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    cores = len(os.sched_getaffinity(0))
    cpu_max.write_text("150000 100000\n")
    assert cgroup_cpus(cpu_max) == 2 and default_workers(cpu_max) == min(cores, 2)
    cpu_max.write_text("50000 100000\n")
    assert default_workers(cpu_max) == 1
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpus(cpu_max) is None and default_workers(cpu_max) == cores
    assert default_workers(tmp_path / "absent") == cores


@pytest.mark.parametrize("tokenizer", ["/nonexistent/tokenizer", "someorg/no-such-model-kvr"])
def test_a_tokenizer_that_cannot_load_is_one_line_naming_the_key(tmp_path: Path, tokenizer: str) -> None:
    """It was a 98-line traceback ending in "Repo id must be in the form 'repo_name'", and an
    unreachable hub id hung for 50 s."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "tokenizer": tokenizer,
                                                "backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}]}))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--workers", "1"],
                          capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 20
    assert done.returncode == 3
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "models[0].tokenizer (m)" in lines[0] and repr(tokenizer) in lines[0], lines
    assert "PyTorch" not in done.stderr
