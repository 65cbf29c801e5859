"""Graceful operations of ``kvrouter serve`` (issue 16): SIGTERM drains, SIGHUP reloads backends.

Real processes on loopback: the router as ``kvrouter serve``, a slow-streaming loopback
engine for the drain, and simulated engines (``kvrouter sim``, with KV events) for the
reloads. Each test is bounded by its own deadlines and stops what it started.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support import KVROUTER, QWEN3_DIR, LoopbackEngine, Proc, RouterProc, free_port, sse_events, wait_for, wait_http

pytestmark = pytest.mark.slow

MODEL = "qwen3"
ADMIN = {"authorization": "Bearer admin-key"}
COMMON = {"tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256", "hash_seed": "0", "vllm_version": "0.33.0"}


class SlowStreamEngine(LoopbackEngine):
    """Streams ``events`` SSE events ``gap_s`` apart, then ``[DONE]``: the bytes are fixed, so a
    client can check it got them all, unchanged."""

    def __init__(self, events: int, gap_s: float) -> None:
        super().__init__()
        self.events, self.gap_s = events, gap_s

    def body(self) -> list[bytes]:
        chunks = [b"data: " + json.dumps({"id": "c", "object": "text_completion", "choices": [
            {"index": 0, "text": f" tok{i}", "finish_reason": None}]}).encode() + b"\n\n" for i in range(self.events)]
        return chunks + [b"data: [DONE]\n\n"]

    def routes(self, app: Any) -> None:
        app.router.add_post("/v1/completions", self._completions)

    async def _completions(self, request: Any) -> Any:
        from aiohttp import web

        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in self.body():
            await resp.write(chunk)
            await asyncio.sleep(self.gap_s)
        await resp.write_eof()
        return resp


def drain_config(engine: LoopbackEngine, drain_timeout_s: float) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, **COMMON, "backends": [{"name": "slow", "url": engine.url}]}],
        "router": {"drain_timeout_s": drain_timeout_s, "health_interval_s": 0.5},
    }


class StreamReader(threading.Thread):
    """One streamed completion read to its end on a thread; ``started`` once its first bytes came."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.started = threading.Event()
        self.status: int | None = None
        self.raw = b""
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=30) as r:
                self.status = r.status_code
                for chunk in r.iter_raw():
                    self.raw += chunk
                    self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()


def refused_or_503(url: str) -> bool:
    try:
        r = httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return True
    return r.status_code == 503


def sigterm_while_streaming(engine: SlowStreamEngine, drain_timeout_s: float, tmp_path: Path) -> tuple[StreamReader, RouterProc, float]:
    """Start the router, start one stream, SIGTERM the router once the stream's first bytes came;
    returns the finished stream, the router and how long the router took to exit."""
    router = RouterProc("router", drain_config(engine, drain_timeout_s), tmp_path, log_level="info")
    try:
        reader = StreamReader(router.url)
        reader.start()
        assert reader.started.wait(20), router.log()
        signalled = time.monotonic()
        router.proc.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: refused_or_503(router.url), "the draining router to refuse new connections", timeout=3)
        assert refused_or_503(router.url)
        rc = router.proc.popen.wait(drain_timeout_s + 15)
        took = time.monotonic() - signalled
        reader.join(10)
        assert rc == 0, router.log()
        return reader, router, took
    finally:
        router.stop()


def test_sigterm_lets_an_in_flight_stream_finish_then_exits_0(tmp_path: Path) -> None:
    with SlowStreamEngine(events=12, gap_s=0.2) as engine:
        reader, router, took = sigterm_while_streaming(engine, 10.0, tmp_path)
    assert reader.error is None and reader.status == 200, (reader.error, router.log_path.read_text())
    assert reader.raw == b"".join(engine.body()), "the stream was not relayed byte for byte"
    assert took < 10.0, f"exited {took:.1f}s after SIGTERM, past the drain deadline"
    assert "draining: 1 request(s) in flight" in router.log_path.read_text()


def test_a_stream_longer_than_the_drain_deadline_ends_with_an_error_event(tmp_path: Path) -> None:
    with SlowStreamEngine(events=40, gap_s=0.25) as engine:
        reader, router, took = sigterm_while_streaming(engine, 1.5, tmp_path)
    assert reader.error is None and reader.status == 200, (reader.error, router.log_path.read_text())
    events, rest = sse_events(reader.raw)
    assert rest == b"", f"the stream ends inside an event: {rest!r}"
    error = json.loads(events[-1])["error"]
    assert error["code"] == "shutting_down", events[-1]
    assert all(b"[DONE]" not in e and b"error" not in e for e in events[:-1])
    assert 1 <= len(events) - 1 < 40
    assert took < 1.5 + 8.0, f"exited {took:.1f}s after SIGTERM"
    assert "drain deadline: 1 request(s)" in router.log_path.read_text()


# -- reloads ------------------------------------------------------------------------------------


def reload_config(sim: Any, engines: list[int]) -> dict[str, Any]:
    backends = [{"name": f"sim{i}", "url": sim.http(i), "kv_events": sim.kv(i), "kv_replay": sim.replay(i)} for i in engines]
    return {
        "models": [{"name": MODEL, **COMMON, "backends": backends}],
        "router": {"policy": "round_robin", "health_interval_s": 0.5, "admin_api_key": "admin-key"},
    }


def write_and_hup(router: RouterProc, tmp_path: Path, config: dict[str, Any] | str) -> None:
    text = config if isinstance(config, str) else yaml.safe_dump(config)
    (tmp_path / "router.yaml").write_text(text)
    router.proc.popen.send_signal(signal.SIGHUP)


def reloads(url: str, outcome: str) -> float:
    for line in httpx.get(url + "/metrics", headers={"authorization": "Bearer admin-key"}, timeout=5).text.splitlines():
        if line.startswith(f'kvrouter_config_reloads_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def backends(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(url + "/debug/backends", headers=ADMIN, timeout=5)
    r.raise_for_status()
    return {b["name"]: b for b in r.json()["backends"]}


def indexed(url: str) -> dict[str, int]:
    r = httpx.get(url + "/debug/index", params={"model": MODEL}, headers=ADMIN, timeout=5)
    r.raise_for_status()
    out: dict[str, int] = {}
    for w in r.json()["workers"]:
        out[w["backend"]] = out.get(w["backend"], 0) + len(w["keys"])
    return out


def complete(url: str, i: int, client: httpx.Client | None = None) -> tuple[int, str]:
    """One completion whose prompt fills a few blocks (so the engine's events store some)."""
    body = {"model": MODEL, "prompt": f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 12, "max_tokens": 4}
    r = (client or httpx).post(url + "/v1/completions", json=body, timeout=30)
    return r.status_code, r.headers.get("x-kvrouter-backend", "")


def test_sighup_adds_then_removes_a_backend_without_dropping_traffic(sim_fleet, tmp_path: Path) -> None:
    sim = sim_fleet("--speedup", "20", "--hash-seed", "0", "--mean-output-tokens", "16", instances=2)
    for i in range(2):
        wait_for(lambda i=i: httpx.get(sim.http(i) + "/health", timeout=2).status_code == 200, f"engine {i}", timeout=60)
    router = RouterProc("router", reload_config(sim, [0]), tmp_path, log_level="info")
    try:
        assert {complete(router.url, i)[1] for i in range(4)} == {"sim0"}

        write_and_hup(router, tmp_path, reload_config(sim, [0, 1]))
        wait_for(lambda: reloads(router.url, "applied") == 1, "the reload adding sim1", timeout=10)
        wait_for(lambda: backends(router.url).get("sim1", {}).get("connected") is True, "sim1's event stream", timeout=10)
        chosen = [complete(router.url, 10 + i) for i in range(6)]
        assert all(status == 200 for status, _ in chosen)
        assert {b for _, b in chosen} == {"sim0", "sim1"}, chosen
        wait_for(lambda: indexed(router.url).get("sim1", 0) > 0, "sim1's events in the index", timeout=10)
        assert indexed(router.url).get("sim0", 0) > 0

        # Traffic runs while sim0 is removed: nothing is dropped, nothing new goes to sim0.
        results: list[tuple[float, int, str, float]] = []
        stop = threading.Event()

        def traffic() -> None:
            with httpx.Client() as client:
                i = 100
                while not stop.is_set():
                    t = time.monotonic()
                    status, backend = complete(router.url, i, client)
                    results.append((t, status, backend, time.monotonic()))
                    i += 1

        threads = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        hup = time.monotonic()
        write_and_hup(router, tmp_path, reload_config(sim, [1]))
        wait_for(lambda: reloads(router.url, "applied") == 2, "the reload removing sim0", timeout=10)
        applied = time.monotonic()
        wait_for(lambda: "sim0" not in backends(router.url), "sim0 to be dropped", timeout=20)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        assert results and all(status == 200 for _, status, _, _ in results), [r for r in results if r[1] != 200]
        assert any(b == "sim0" and t < hup < end for t, _, b, end in results), "no request was on sim0 during the reload"
        late = [r for r in results if r[0] > applied]
        assert late and all(b == "sim1" for _, _, b, _ in late), late
        wait_for(lambda: "sim0" not in indexed(router.url), "sim0's entries to leave the index", timeout=10)
        assert indexed(router.url).get("sim1", 0) > 0
        live = [line for line in httpx.get(router.url + "/metrics", headers={"authorization": "Bearer admin-key"}, timeout=5).text.splitlines()
                if line.startswith(("kvrouter_backend_", "kvrouter_event_stream_last_seq", "kvrouter_event_stream_blocks"))]
        assert live and not [line for line in live if 'backend="sim0"' in line], "sim0's load and health series remain"
        assert "backend sim0 removed" in router.log()
    finally:
        router.stop()


def test_a_refused_reload_keeps_the_old_config_serving(sim_fleet, tmp_path: Path) -> None:
    sim = sim_fleet("--speedup", "20", "--hash-seed", "0", "--mean-output-tokens", "16", instances=1)
    wait_for(lambda: httpx.get(sim.http(0) + "/health", timeout=2).status_code == 200, "engine 0", timeout=60)
    good = reload_config(sim, [0])
    router = RouterProc("router", good, tmp_path, log_level="info")
    try:
        write_and_hup(router, tmp_path, "models: [unclosed\n")
        wait_for(lambda: reloads(router.url, "invalid") == 1, "the unreadable file's refusal", timeout=10)
        broken = reload_config(sim, [0])
        broken["models"][0]["backends"][0]["colour"] = "blue"
        write_and_hup(router, tmp_path, broken)
        wait_for(lambda: reloads(router.url, "invalid") == 2, "the invalid config's refusal", timeout=10)
        not_live = reload_config(sim, [0])
        not_live["models"][0]["block_size"] = 32
        write_and_hup(router, tmp_path, not_live)
        wait_for(lambda: reloads(router.url, "not_live") == 1, "the block_size change's refusal", timeout=10)

        assert router.proc.alive()
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200
        assert [complete(router.url, i) for i in range(3)] == [(200, "sim0")] * 3
        r = httpx.post(router.url + "/debug/route", headers=ADMIN, json={"model": MODEL, "prompt": "x " * 40}, timeout=10)
        assert r.json()["block_size"] == 16
        log = router.log()
        assert "colour" in log and "models.0.block_size changed, and only backends can change" in log
    finally:
        router.stop()


def test_reload_config_applies_a_changed_file_without_a_signal(sim_fleet, tmp_path: Path) -> None:
    sim = sim_fleet("--speedup", "20", "--hash-seed", "0", "--mean-output-tokens", "16", instances=2)
    for i in range(2):
        wait_for(lambda i=i: httpx.get(sim.http(i) + "/health", timeout=2).status_code == 200, f"engine {i}", timeout=60)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(reload_config(sim, [0])))
    port = free_port()
    args = KVROUTER + ["serve", "--config", str(path), "--port", str(port), "--reload-config"]
    with Proc(args, tmp_path / "router.log") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", timeout=120, proc=proc.popen)
        path.write_text(yaml.safe_dump(reload_config(sim, [0, 1])))
        wait_for(lambda: reloads(url, "applied") == 1, "the changed file to be applied", timeout=15)
        assert set(backends(url)) == {"sim0", "sim1"}
        assert {complete(url, i)[1] for i in range(4)} == {"sim0", "sim1"}
