"""DNS discovery against a real DNS server: dnsmasq on loopback, records changed through its
``addn-hosts`` file and SIGHUP, as a headless Service's records change when pods come and go.

The engines are real ``kvrouter sim`` processes, each on its own loopback address
(127.0.0.2, 127.0.0.3, ...) and all on the same ports, as pods behind one Service are.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.fleet import scrape_labelled
from support import KVROUTER, QWEN3_DIR, Proc, RouterProc, free_port, free_ports, wait_for, wait_http

pytestmark = pytest.mark.slow

NAME = "engines.kvr.test"
MODEL = "qwen3-sim"


class Dns:
    """dnsmasq answering ``NAME`` from a hosts file, on a free loopback port."""

    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        if not Path(exe).exists():
            pytest.fail("dnsmasq is not installed: `make test` installs dnsmasq-base with apt-get")
        self.exe = exe
        self.hosts = tmp / "hosts"
        self.port = free_port()
        self.tmp = tmp
        self.proc: Proc | None = None

    def serve(self, addresses: list[str]) -> None:
        self.set(addresses)
        # -u root: dnsmasq drops to nobody by default, who cannot read a test's private tmp dir.
        self.proc = Proc([self.exe, "-k", "-C", "/dev/null", "-u", "root", f"--port={self.port}",
                          "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
                          f"--addn-hosts={self.hosts}", "--pid-file=", "--log-facility=-"],
                         self.tmp / f"dnsmasq-{time.monotonic_ns()}.log")
        wait_for(lambda: self.proc is not None and "started" in self.proc.log(), "dnsmasq to start", timeout=10)

    def set(self, addresses: list[str]) -> None:
        """Replace the name's records (read again on SIGHUP)."""
        self.hosts.write_text("".join(f"{a} {NAME}\n" for a in addresses))
        if self.proc is not None:
            self.proc.popen.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


class Engines:
    """One ``kvrouter sim`` per loopback address, every one on the same three ports."""

    def __init__(self, tmp: Path) -> None:
        base = free_ports(3)
        self.port, self.kv, self.replay = base, base + 1, base + 2
        self.tmp = tmp
        self.procs: dict[str, Proc] = {}

    def start(self, address: str) -> None:
        self.procs[address] = Proc([*KVROUTER, "sim", "--host", address, "--port", str(self.port), "--model", MODEL,
                                    "--tokenizer", str(QWEN3_DIR), "--kv-events-port", str(self.kv),
                                    "--replay-port", str(self.replay), "--speedup", "1"],
                                   self.tmp / f"sim-{address}.log")

    def wait(self) -> None:
        for address, proc in self.procs.items():
            wait_http(f"http://{address}:{self.port}/health", timeout=90, proc=proc.popen)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Dns, Engines]]:
    dns, engines = Dns(tmp_path), Engines(tmp_path)
    try:
        yield dns, engines
    finally:
        dns.stop()
        engines.stop()


def config(dns: Dns, engines: Engines) -> dict[str, Any]:
    return {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "backends": [], "discovery": {
        "dns": NAME, "port": engines.port, "kv_events_port": engines.kv, "kv_replay_port": engines.replay,
        "interval_s": 0.3, "nameserver": f"127.0.0.1:{dns.port}"}}],
            "router": {"health_interval_s": 0.5, "expose_decision_headers": True}}


def backends(router: RouterProc) -> dict[str, dict[str, Any]]:
    r = httpx.get(router.url + "/debug/backends", timeout=10)
    return {b["name"]: b for b in r.json()["backends"]}


def ready(router: RouterProc, names: set[str]) -> bool:
    """Exactly ``names`` are the backends, each healthy with its event stream connected."""
    seen = backends(router)
    return set(seen) == names and all(seen[n]["healthy"] and seen[n]["connected"] for n in names)


async def traffic(url: str, stop: asyncio.Event, seed: int) -> list[tuple[int, str, bool]]:
    """Streamed completions, 4 at a time, until ``stop``: (status, backend, whether the stream ended in [DONE]).
    Each prompt is new (nothing cached anywhere), so kv_aware weighs only the queued prefill and a
    joining engine, idle, is chosen; cached prompts would rightly stay where they are cached."""
    out: list[tuple[int, str, bool]] = []

    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": f"request {seed}-{i} " + "some shared words " * 40, "max_tokens": 24,
                "stream": True}
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            raw = await r.aread()
            out.append((r.status_code, r.headers.get("x-kvrouter-backend", ""), raw.rstrip().endswith(b"[DONE]")))

    async def lane(lane_no: int) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            i = lane_no
            while not stop.is_set():
                await one(c, i)
                i += 4

    lanes = [asyncio.create_task(lane(n)) for n in range(4)]
    await stop.wait()
    await asyncio.gather(*lanes)
    return out


def test_engines_join_and_leave_as_dns_says_and_none_of_the_traffic_fails(fleet: tuple[Dns, Engines],
                                                                          tmp_path: Path) -> None:
    """An address added to the name becomes a backend, health-checked and its events
    followed, then chosen; one removed mid-traffic leaves after its requests end, and no
    request fails on the way."""
    dns, engines = fleet
    for a in ("127.0.0.2", "127.0.0.3"):
        engines.start(a)
    engines.wait()
    dns.serve(["127.0.0.2"])
    router = RouterProc("router", config(dns, engines), tmp_path)
    try:
        a, b = f"127.0.0.2:{engines.port}", f"127.0.0.3:{engines.port}"
        wait_for(lambda: ready(router, {a}), "the first engine to be found", timeout=20)
        assert httpx.get(router.url + "/readyz", timeout=5).status_code == 200

        async def run() -> list[tuple[int, str, bool]]:
            stop = asyncio.Event()
            task = asyncio.create_task(traffic(router.url, stop, seed=1))
            await asyncio.sleep(1.0)
            dns.set(["127.0.0.2", "127.0.0.3"])
            deadline = time.monotonic() + 20
            while not ready(router, {a, b}) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(3.0)  # traffic on both
            dns.set(["127.0.0.2"])  # the second engine leaves, its requests in flight
            await asyncio.sleep(2.0)
            stop.set()
            return await task

        results = asyncio.run(run())
        assert results and all(status == 200 and done for status, _, done in results), \
            [r for r in results if r[0] != 200 or not r[2]]
        assert {backend for _, backend, _ in results} == {a, b}, "the added engine was never chosen"
        wait_for(lambda: set(backends(router)) == {a}, "the removed engine to leave", timeout=20)
        route = httpx.post(router.url + "/debug/route", json={"model": MODEL, "prompt": "session 1-1 x"}, timeout=10)
        assert [c["backend"] for c in route.json()["candidates"]] == [a]
        lookups = scrape_labelled(router.url + "/metrics", "kvrouter_discovery_lookups_total", "outcome")
        assert lookups.get("ok", 0) >= 3, lookups
    finally:
        router.stop()


def test_a_dns_outage_keeps_the_last_set_and_is_logged_once(fleet: tuple[Dns, Engines], tmp_path: Path) -> None:
    """With the DNS server gone the router keeps routing to what it found last, counts each
    failed lookup and says so once; when the server answers again it says that once too."""
    dns, engines = fleet
    engines.start("127.0.0.2")
    engines.wait()
    dns.serve(["127.0.0.2"])
    router = RouterProc("router", config(dns, engines), tmp_path)
    try:
        a = f"127.0.0.2:{engines.port}"
        wait_for(lambda: ready(router, {a}), "the engine to be found", timeout=20)
        dns.stop()
        wait_for(lambda: scrape_labelled(router.url + "/metrics", "kvrouter_discovery_lookups_total",
                                         "outcome").get("error", 0) >= 5, "five failed lookups", timeout=30)
        assert set(backends(router)) == {a}
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 200 and r.headers["x-kvrouter-backend"] == a, r.text
        assert router.log().count("keeping the 1 backend(s) found last") == 1, router.log()
        dns.serve(["127.0.0.2"])
        wait_for(lambda: "answers again" in router.log(), "the recovery to be logged", timeout=20)
        assert router.log().count("answers again") == 1
    finally:
        router.stop()
