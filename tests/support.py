"""Helpers for tests that start real processes on loopback: free ports, readiness, cleanup.

``free_ports`` and ``wait_http`` are re-exported from :mod:`loadtest.fleet`, so the tests and
the bench wait for children the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
import zmq

from indexer.index import MemoryIndex, Worker
from indexer.subscriber import FleetSubscriber, StreamSpec
from loadtest.fleet import Child
from loadtest.fleet import free_port_run as free_ports
from loadtest.fleet import wait_http

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
GOLDEN = FIXTURES / "golden"
QWEN3_DIR = REPO / "loadtest" / "data" / "tokenizers" / "qwen3"
KVROUTER = [sys.executable, "-m", "router.cli"]

FUZZ_FULL = os.environ.get("KVROUTER_FUZZ_FULL", "") not in ("", "0")
"""``KVROUTER_FUZZ_FULL=1``: the fuzz suites (tests/test_fuzz_*.py) run their full case
counts (issue 17: 10,000 HTTP requests, 100,000 event payloads) instead of the bounded
ones ``make test`` runs."""


def fuzz_cases(bounded: int, full: int) -> int:
    """How many cases a fuzz test runs: ``full`` under ``KVROUTER_FUZZ_FULL=1``, else ``bounded``."""
    return full if FUZZ_FULL else bounded


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not open after {timeout}s")


class Proc(Child):
    """A :class:`loadtest.fleet.Child` for tests: named after its log file, always stopped on exit.

    Output goes to a log file so a failing test can show it (``proc.log()``).
    """

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path = REPO):
        super().__init__(log_path.stem, args, log_path, env, cwd)

    def log(self) -> str:
        return self.log_tail(8000)

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sub_socket(endpoint: str) -> zmq.Socket:
    """A SUB socket on every topic of ``endpoint``, given 0.3 s to connect (ZMQ drops what a late SUB missed)."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    time.sleep(0.3)
    return sock


@contextmanager
def indexed_sim(sim: Any, model: str) -> Iterator[tuple[MemoryIndex, list[Worker], zmq.Socket]]:
    """A :class:`MemoryIndex` fed by every engine of ``sim`` (worker ``sim{i}``), and a SUB on engine 0's events.

    Both are closed on exit, so a failing assertion inside the block leaks neither.
    """
    index = MemoryIndex()
    workers = [Worker(f"sim{i}", 0) for i in range(sim.instances)]
    subscriber = FleetSubscriber(index, [StreamSpec(model, w, sim.kv(i), sim.replay(i)) for i, w in enumerate(workers)])
    subscriber.start()
    monitor = sub_socket(sim.kv(0))
    try:
        yield index, workers, monitor
    finally:
        monitor.close()
        subscriber.stop()


async def random_conversations(sim: Any, model: str, wall_s: float, *, seed: int, max_tokens: int,
                               mean_gap_s: float) -> None:
    """Multi-turn conversations over 4 shared system prompts, spread at random over the engines.

    No prompt repeats exactly (every turn appends a fresh suffix): vLLM would recompute the
    last block of a fully cached prompt into a second block with the same hash.
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 150_000) for _ in range(rng.randrange(40, 400))] for _ in range(4)]
    histories: list[list[int]] = []
    deadline = time.monotonic() + wall_s

    async def one(client: httpx.AsyncClient, i: int, ids: list[int]) -> None:
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens}
        r = await client.post(sim.http(i) + "/v1/completions", json=body)
        assert r.status_code == 200, r.text

    async with httpx.AsyncClient(timeout=60) as client:
        tasks = []
        while time.monotonic() < deadline:
            suffix = [rng.randrange(1, 150_000) for _ in range(rng.randrange(5, 300))]
            if histories and rng.random() < 0.5:
                k = rng.randrange(len(histories))
                ids = histories[k] = (histories[k] + suffix)[-1500:]
            else:
                ids = rng.choice(systems) + suffix
                if len(histories) < 30:
                    histories.append(ids)
            tasks.append(asyncio.create_task(one(client, rng.randrange(sim.instances), ids)))
            await asyncio.sleep(rng.expovariate(1.0 / mean_gap_s))
        await asyncio.gather(*tasks)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``cond`` every 5 ms until it holds; ``TimeoutError`` naming ``what`` if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)
    raise TimeoutError(f"timed out waiting for {what}")


def access_lines(log: Path, count: int = 0, path: str = "", timeout: float = 10.0) -> list[dict[str, Any]]:
    """The access-log lines (JSON objects, one a line) in the router's log ``log`` for paths that
    start with ``path``, once there are ``count``: a line is written after the answer's last byte
    goes out, so a client can hold an answer a moment before its line exists."""
    lines: list[dict[str, Any]] = []

    def enough() -> bool:
        nonlocal lines
        text = log.read_text(errors="replace") if log.exists() else ""
        lines = [json.loads(line) for line in text.splitlines() if line.startswith('{"request_id"')]
        lines = [line for line in lines if line["path"].startswith(path)]
        return len(lines) >= count

    wait_for(enough, f"{count} access-log lines for {path or 'any path'}", timeout=timeout)
    return lines


class RouterProc:
    """``kvrouter serve`` on a free loopback port with the given config (a dict, written as YAML)."""

    def __init__(self, name: str, config: dict[str, Any], tmp: Path, env: dict[str, str] | None = None,
                 log_level: str = "debug", tuning: dict[str, Any] | None = None, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.log_path = tmp / f"{name}.log"
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        args = KVROUTER + ["serve", "--config", str(path), "--port", str(self.port), "--log-level", log_level, *(extra_args or [])]
        if tuning is not None:
            args += ["--tuning", json.dumps(tuning)]
        self.proc = Proc(args, self.log_path, env=env)
        workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
        try:
            wait_http(self.url + "/health", timeout=120, proc=self.proc.popen)
            if workers > 1:
                self._wait_workers(workers, (config.get("router") or {}).get("admin_api_key"))
        except BaseException:  # no caller holds the process yet: stop it here, or it outlives the test
            self.proc.stop()
            raise

    def _wait_workers(self, n: int, admin_key: str | None) -> None:
        """``/health`` answers once the first worker listens; each worker binds its own
        SO_REUSEPORT socket when its startup ends, so until the last one has, the kernel
        gives every connection to the others. Tests that count on connections spreading
        over the workers start once each has answered one."""
        seen: set[int] = set()
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

        def all_listen() -> bool:
            try:
                seen.add(httpx.get(self.url + "/debug/backends", headers=headers, timeout=5).raise_for_status().json()["worker"])
            except httpx.TransportError:
                pass
            return len(seen) == n

        wait_for(all_listen, f"all {n} workers to listen", timeout=120)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        self.proc._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.stop()


def openai_error(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error body; AssertionError naming what is wrong otherwise."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise AssertionError(f"error body is not JSON: {body[:300]!r}") from None
    error = doc.get("error") if isinstance(doc, dict) else None
    assert isinstance(error, dict), f"error body has no error object: {body[:300]!r}"
    assert isinstance(error.get("message"), str) and isinstance(error.get("type"), str) and "code" in error, body[:300]
    return error


def sse_events(raw: bytes) -> tuple[list[bytes], bytes]:
    """The ``data`` of each event of an SSE body, and the bytes after the last complete event.

    Parsed as the WHATWG algorithm does (lines end with CRLF, LF or CR; an empty line
    dispatches; ``data:`` lines join with LF; an event without data is not dispatched),
    so what it returns is what a conforming client would see."""
    events: list[bytes] = []
    data: list[bytes] = []
    i, n, start, event_end = 0, len(raw), 0, 0
    while i < n:
        c = raw[i]
        if c not in (10, 13):
            i += 1
            continue
        line = raw[start:i]
        i += 2 if c == 13 and i + 1 < n and raw[i + 1] == 10 else 1
        start = i
        if not line:
            if data:
                events.append(b"\n".join(data))
            data = []
            event_end = i
            continue
        field, _, value = line.partition(b":")
        if field == b"data":
            data.append(value[1:] if value.startswith(b" ") else value)
    return events, raw[event_end:]


def golden_batches() -> list[bytes]:
    """The 0.33 block-manager trace's batches up to (not including) its final prefix-cache reset."""
    import json

    out = []
    for line in (GOLDEN / "blockmanager_trace_vllm-0.33.0.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["kind"] == "events":
            if d["op"] == "reset_prefix_cache":
                break
            out.append(bytes.fromhex(d["payload_hex"]))
    return out


def mutate_bytes(rng: random.Random, data: bytes, splice_from: list[bytes]) -> bytes:
    """1-4 byte-level mutations of ``data``: bit flips, byte sets, truncation, insertion, deletion,
    or a splice onto the tail of another payload from ``splice_from`` (the event fuzzers' mutator)."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2:
            del b[rng.randrange(len(b) + 1) :]
        elif op == 3:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 9))
        elif op == 4 and b:
            i = rng.randrange(len(b))
            del b[i : i + rng.randint(1, 16)]
        else:
            other = rng.choice(splice_from)
            b = b[: rng.randrange(len(b) + 1)] + other[rng.randrange(len(other) + 1) :]
    return bytes(b)


class LoopbackEngine:
    """An OpenAI-shaped engine on a loopback port, served by aiohttp from a thread of its own,
    for tests that need an engine to answer in ways the simulator does not (record headers,
    cut or mangle streams). A subclass adds its endpoints in :meth:`routes`; ``/health`` and
    ``/v1/models`` answer like an engine with nothing to say."""

    APP_OPTIONS: dict[str, Any] = {}
    RUNNER_OPTIONS: dict[str, Any] = {}

    def __init__(self) -> None:
        from aiohttp import web

        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self, app: Any) -> None:
        raise NotImplementedError

    async def _health(self, _: Any) -> Any:
        from aiohttp import web

        return web.json_response({})

    async def _models(self, _: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": []})

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application(**self.APP_OPTIONS)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.routes(app)
        self._runner = web.AppRunner(app, access_log=None, **self.RUNNER_OPTIONS)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> Any:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        """Stop listening (the engine goes away); the thread stays until :meth:`__exit__`."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._runner = None

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus exposition's samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
