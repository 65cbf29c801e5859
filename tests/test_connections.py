"""Client connections the router can afford (router/http/guard.py), on real ``kvrouter serve`` processes.

Silent, slow-header and slow-body connections are closed within the client timeout; a head
over 64 KiB gets 431; at the connection limit a new connection takes the place of the oldest
one without a request under way; and under ``ulimit -n 1024`` a router
holding 1,100 silent connections still answers ``/health``. Every refusal is counted.
"""

from __future__ import annotations

import json
import re
import resource
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support import QWEN3_DIR, Proc, RouterProc, free_port, wait_http
from test_big_prompts import QuickEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "m"
TIMEOUT_S = 1.0


def config(url: str, **router: Any) -> dict[str, Any]:
    return {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16,
                        "backends": [{"name": "a", "url": url}]}],
            "router": {"health_interval_s": 5.0, **router}}


@pytest.fixture(scope="module")
def engine() -> Iterator[QuickEngine]:
    with QuickEngine() as e:
        yield e


@pytest.fixture(scope="module")
def router(engine: QuickEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    r = RouterProc("guarded", config(engine.url), tmp_path_factory.mktemp("conn"), log_level="info",
                   tuning={"client_timeout_s": TIMEOUT_S, "max_connections": 40})
    yield r
    r.stop()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the router closes ``s`` within ``seconds`` (what it sent first is skipped)."""
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def refused(url: str, reason: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'kvrouter_connections_refused_total\{reason="(\w+)"\} (\S+)', line)
        if m and m.group(1) == reason:
            return float(m.group(2))
    return 0.0


def raise_own_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))


def test_silent_slow_header_and_slow_body_connections_are_closed(router: RouterProc) -> None:
    before = refused(router.url, "header_timeout"), refused(router.url, "body_timeout")
    silent = [connect(router.url) for _ in range(10)]
    slow_head = connect(router.url)
    slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    slow_body = connect(router.url)
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{\"model\": ")
    started = time.monotonic()
    for s in [*silent, slow_head]:
        assert closed_within(s, TIMEOUT_S + 3 - (time.monotonic() - started))
    answer = b""
    slow_body.settimeout(TIMEOUT_S + 3)
    try:
        while chunk := slow_body.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    assert time.monotonic() - started < TIMEOUT_S + 3
    assert b" 200 " not in answer.split(b"\r\n", 1)[0]
    assert refused(router.url, "header_timeout") - before[0] >= 11
    assert refused(router.url, "body_timeout") - before[1] >= 1
    assert "Traceback" not in router.log()


def test_a_head_over_64_kib_gets_431(router: RouterProc) -> None:
    s = connect(router.url)
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (100 << 10) + b"\r\n\r\n")
    s.settimeout(10)
    answer = b""
    try:
        while chunk := s.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert refused(router.url, "head_too_large") >= 1


def test_at_the_limit_a_new_connection_takes_a_silent_ones_place(router: RouterProc) -> None:
    before = refused(router.url, "evicted")
    silent = [connect(router.url) for _ in range(60)]  # over max_connections (40)
    try:
        for _ in range(5):
            assert httpx.get(router.url + "/health", timeout=5).status_code == 200
        assert refused(router.url, "evicted") - before >= 20
    finally:
        for s in silent:
            s.close()


def test_under_ulimit_1024_1100_silent_connections_leave_health_answering(engine: QuickEngine, tmp_path: Path) -> None:
    raise_own_fd_limit(4096)
    port = free_port()
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(config(engine.url)))
    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
               "sys.argv = ['kvrouter'] + sys.argv[1:]; runpy.run_module('router.cli', run_name='__main__')")
    args = [sys.executable, "-c", limited, "serve", "--config", str(path), "--port", str(port), "--log-level", "info",
            "--tuning", json.dumps({"client_timeout_s": 60.0})]
    url = f"http://127.0.0.1:{port}"
    with Proc(args, tmp_path / "r.log") as proc:
        wait_http(url + "/health", timeout=120, proc=proc.popen)
        silent = []
        try:
            for _ in range(1100):
                silent.append(connect(url))
            for _ in range(5):
                r = httpx.get(url + "/health", timeout=5)
                assert r.status_code == 200 and json.loads(r.text)["status"] == "ok"
            assert refused(url, "evicted") >= 1100 - (1024 - 256)
        finally:
            for s in silent:
                s.close()
        assert "Traceback" not in proc.log()
