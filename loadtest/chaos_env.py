"""The processes a chaos scenario breaks: engines, routers, Redis and the indexer, one child each.

:class:`loadtest.fleet.Fleet` runs every simulated engine in one ``kvrouter sim``
process, which a signal cannot fault one engine of. Here each engine is a process of
its own on fixed ports, so SIGKILL, SIGSTOP and a restart hit exactly one engine and a
restarted engine comes back where the routers expect it, with an empty cache and its
publisher's seq back at 0 (what a real vLLM restart does). Routers and Redis are
children too, for the same reason. Every child goes through :class:`loadtest.fleet.Child`
(log file, stop with a grace, killed on exit) and :func:`loadtest.fleet.wait_http`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.fleet import KVROUTER, LAB_POLICIES, Child, Engine, EngineFleet, FleetError, FleetSpec, free_port_run, wait_http


def _wait_port(port: int, timeout_s: float, child: Child) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise FleetError(f"{child.name} exited before port {port} opened:\n{child.log_tail()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise FleetError(f"{child.name}: port {port} not open after {timeout_s:.0f}s")


PORT_TAKEN = "address already in use"


def _start_http(name: str, child: Child, health_url: str, timeout_s: float) -> Child:
    """Wait for a started child's ``health_url``; a port another process took meanwhile fails
    at once (the log says so) instead of after ``timeout_s``, and the child is stopped."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                wait_http(health_url, min(2.0, max(0.1, deadline - time.monotonic())), child.popen)
                return child
            except FleetError as e:
                tail = child.log_tail()
                if PORT_TAKEN in tail or time.monotonic() >= deadline or not child.alive():
                    raise FleetError(f"{name}: {e}:\n{tail}") from None
    except BaseException:
        child.stop()
        raise


def process_usage(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of a live process, read from ``/proc``."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class EngineProc:
    """One simulated engine (``kvrouter sim --instances 1``) on ports that survive a restart."""

    def __init__(self, index: int, spec: FleetSpec, workdir: Path, http: int, kv: int, replay: int) -> None:
        self.index = index
        self.spec = spec
        self.workdir = workdir
        self.engine = Engine(f"engine-{index}", f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{kv}",
                             f"tcp://127.0.0.1:{replay}")
        self.ports = (http, kv, replay)
        self.child: Child | None = None
        self.starts = 0

    @property
    def name(self) -> str:
        return self.engine.name

    def start(self, timeout_s: float = 90.0) -> None:
        self.spawn()
        self.wait(timeout_s)

    def wait(self, timeout_s: float = 90.0) -> None:
        assert self.child is not None
        self.child = _start_http(self.name, self.child, self.engine.url + "/health", timeout_s)

    def spawn(self) -> None:
        s = self.spec
        http, kv, replay = self.ports
        args = [*KVROUTER, "sim", "--port", str(http), "--model", s.model, "--tokenizer", s.tokenizer,
                "--kv-events-port", str(kv), "--replay-port", str(replay), "--block-size", str(s.block_size),
                "--hash-algo", s.hash_algo, "--vllm-version", s.vllm_version, "--speedup", str(s.speedup),
                "--seed", str(self.index + 100 * self.starts)]
        if s.hash_seed is not None:
            args += ["--hash-seed", s.hash_seed]
        if s.num_blocks is not None:
            args += ["--num-blocks", str(s.num_blocks)]
        args += s.sim_args
        self.starts += 1
        self.child = Child(self.name, args, self.workdir / f"{self.name}.{self.starts}.log")

    def signal(self, sig: signal.Signals) -> None:
        assert self.child is not None
        self.child.popen.send_signal(sig)
        if sig == signal.SIGKILL:
            self.child.popen.wait(10)

    def restart(self) -> None:
        """Kill and start again on the same ports: empty cache, publisher seq from 0."""
        self.signal(signal.SIGKILL)
        self.start()

    def fault(self, **update: Any) -> None:
        """``POST /debug/fault`` (:mod:`loadtest.sim.faults`)."""
        httpx.post(self.engine.url + "/debug/fault", json=update, timeout=10.0).raise_for_status()

    def cache(self) -> set[int]:
        """The engine's true cache: every block it holds, as unsigned 64-bit index keys."""
        doc = httpx.get(self.engine.url + "/debug/cache", timeout=10.0).json()
        mask = (1 << 64) - 1
        return {h & mask for h in (*doc["block_hashes_int64"], *doc.get("cpu_block_hashes_int64", ()))}

    def stop(self) -> None:
        if self.child is not None:
            if self.child.alive():
                self.child.popen.send_signal(signal.SIGCONT)
            self.child.stop()


class ChaosFleet(EngineFleet):
    """K engines, one process each, on a run of free ports chosen once."""

    def __init__(self, spec: FleetSpec, workdir: Path) -> None:
        self.spec = spec
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self._place()

    def _place(self) -> None:
        k = self.spec.backends
        base = free_port_run(3 * k)
        self.procs = [EngineProc(i, self.spec, self.workdir, base + i, base + k + i, base + 2 * k + i) for i in range(k)]
        self.engines = [p.engine for p in self.procs]

    def start(self, attempts: int = 3) -> ChaosFleet:
        """Start every engine; on a port lost to another process, all again on fresh ports."""
        for attempt in range(attempts):
            try:
                for p in self.procs:
                    p.spawn()
                for p in self.procs:
                    p.wait()
                return self
            except FleetError as e:
                self.stop()
                if PORT_TAKEN not in str(e) or attempt == attempts - 1:
                    raise
                self._place()
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def truth(self) -> dict[str, set[int]]:
        return {p.name: p.cache() for p in self.procs if p.child is not None and p.child.alive()}

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


class _Restartable:
    """A process a scenario kills outright (SIGKILL, no goodbye) and starts again later."""

    child: Child | None = None

    def kill(self) -> None:
        assert self.child is not None
        self.child.popen.send_signal(signal.SIGKILL)
        self.child.popen.wait(10)

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


class RouterChild(_Restartable):
    """``kvrouter serve`` on a fixed port (a killed replica comes back on it), config as YAML."""

    def __init__(self, name: str, config: dict[str, Any], workdir: Path, tuning: dict[str, Any] | None = None) -> None:
        """``tuning``: the lab's knobs (router/tuning.py), passed as ``--tuning``."""
        self.name = name
        self.tuning = tuning
        self.port = free_port_run(1)
        # One process per router unless the config asks for workers: chaos reads one
        # router's /debug/index and health timeline.
        self.config = {**config, "router": {"workers": 1, **config["router"], "port": self.port}}
        self.workdir = workdir
        self.child: Child | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.popen.pid

    def start(self, timeout_s: float = 120.0) -> RouterChild:
        path = self.workdir / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self.starts += 1
        args = [*KVROUTER, "serve", "--config", str(path), "--port", str(self.port), "--log-level", "info"]
        if self.tuning:
            args += ["--tuning", json.dumps(self.tuning)]
        self.child = _start_http(self.name, Child(self.name, args, self.workdir / f"{self.name}.{self.starts}.log",
                                                  LAB_POLICIES),
                                 self.url + "/health", timeout_s)
        return self

    def wait_streams(self, timeout_s: float = 20.0) -> None:
        """Until the router follows every engine's event stream (routers that subscribe)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(b.get("connected") for b in self.backends()):
                return
            time.sleep(0.1)

    def backends(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/debug/backends", timeout=10.0).json()["backends"]

    def index_keys(self, model: str) -> dict[str, set[int]]:
        doc = httpx.get(self.url + "/debug/index", params={"model": model}, timeout=30.0).json()
        out: dict[str, set[int]] = {}
        for w in doc["workers"]:
            out.setdefault(w["backend"], set()).update(w["keys"])
        return out

    def usage(self) -> tuple[int, int]:
        return process_usage(self.pid)


class RedisChild(_Restartable):
    """A ``redis-server`` without persistence: a restart comes back empty, as a cache does."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FleetError("redis-server is not installed (make redis installs it)")
        self.exe = exe
        self.port = free_port_run(1)
        self.workdir = workdir
        self.child: Child | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisChild:
        self.starts += 1
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]
        self.child = Child(f"redis.{self.starts}", args, self.workdir / f"redis.{self.starts}.log")
        _wait_port(self.port, 20.0, self.child)
        return self



class IndexerChild:
    """``kvrouter indexer`` writing the fleet's events into Redis."""

    def __init__(self, config_path: Path, workdir: Path) -> None:
        self.port = free_port_run(1)
        args = [*KVROUTER, "indexer", "--config", str(config_path), "--port", str(self.port), "--log-level", "info"]
        self.child = Child("indexer", args, workdir / "indexer.log")
        try:
            wait_http(f"http://127.0.0.1:{self.port}/health", 60.0, self.child.popen)
        except FleetError as e:
            self.child.stop()
            raise FleetError(f"indexer: {e}:\n{self.child.log_tail()}") from None

    def stop(self) -> None:
        self.child.stop()
