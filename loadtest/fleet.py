"""A simulated fleet and a router as child processes: free ports, readiness, always stopped.

Shared by ``kvrouter bench``, ``kvrouter loadtest`` and ``kvrouter demo``. Everything
runs on loopback; every child writes its output to a log file in the work directory
(shown when it fails to come up), and every child is stopped on exit, including on
Ctrl-C, because the context managers own them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

import httpx
import yaml

from loadtest.workloads import DEFAULT_TOKENIZER

KVROUTER = [sys.executable, "-m", "router.cli"]
LAB_POLICIES = {"KVROUTER_POLICY_MODULES": "loadtest.policies"}
"""The environment of the routers the lab starts: they also offer the bench's exact-state
policies (:mod:`loadtest.policies`), which a router in production does not."""
REPO_ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


class FleetError(RuntimeError):
    """A child process did not come up (the message holds the tail of its log)."""


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it assigns itself (``bind`` to 0, outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port_run(n: int, host: str = "127.0.0.1", low: int = 20_000) -> int:
    """The first of ``n`` consecutive loopback ports that were all free a moment ago, drawn
    at random below the ephemeral range.

    A port is picked here and bound later by a child. Ports the kernel assigns (``bind`` to
    0, the source port of every outgoing connection, including a reader reconnecting to a
    dead port, which on loopback can connect to itself) come from the ephemeral range, so a
    pick made there could be taken before the child binds it: concurrent runs and busy
    clients collided. Below that range only another explicit pick can take it, and random
    bases make two concurrent runs' picks meet rarely (a child's "address already in use"
    is then reported as such)."""
    import random

    high = min(ephemeral_ports()[0], 65535)
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(low, high - n)
        socks = []
        try:
            for p in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise FleetError(f"no run of {n} free ports in {low}..{high}")


class Child:
    """One child process with its log file; :meth:`stop` terminates, then kills after a grace.

    ``group=True`` starts it in a process group (and session) of its own and signals the
    whole group: a real vLLM server forks an engine-core process that would outlive a killed
    parent. Such a child no longer gets the terminal's Ctrl-C, so it is also started with a
    parent-death signal: if this process dies without stopping it, the kernel sends it
    SIGTERM (and vLLM's server then stops its engine core). ``unset`` names variables of
    this process's environment the child must not inherit.
    """

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path = REPO_ROOT, *, group: bool = False, unset: tuple[str, ...] = ()) -> None:
        self.name = name
        self.args = args
        self.log_path = log_path
        self.group = group
        self._log = open(log_path, "wb")
        full_env = {k: v for k, v in os.environ.items() if k not in unset}
        full_env |= {"PYTHONUNBUFFERED": "1", **(env or {})}
        if group and sys.platform == "linux":
            args = [sys.executable, "-c", _DIE_WITH_PARENT, *args]
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                      cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=group)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self._signal(signal.SIGTERM)

    def wait_or_kill(self, grace: float) -> None:
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.popen.wait(grace)

    def stop(self, grace: float = 5.0) -> None:
        if self.popen.poll() is None:
            self.terminate()
            self.wait_or_kill(grace)
        if self.group:
            self._signal(signal.SIGKILL)  # whatever of the group outlived its leader
        if not self._log.closed:
            self._log.close()

    def _signal(self, sig: signal.Signals) -> None:
        try:
            if self.group:
                os.killpg(self.popen.pid, sig)
            else:
                self.popen.send_signal(sig)
        except ProcessLookupError:
            pass


_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
    "os.getppid() == 1 and sys.exit(1); "  # the parent died before prctl
    "os.execvp(sys.argv[1], sys.argv[1:])"
)
"""Exec the real command with a parent-death signal set (a ``preexec_fn`` is unsafe in a
process with threads, which the bench and the tests have)."""

PORT_RETRIES = 3


def _with_port_retries(start: Callable[[], T]) -> T:
    """``start()`` again on fresh ports when a child lost a port race.

    Free ports are found by binding and releasing them, so another process on the
    machine can take one before the child binds it; that is retried, nothing else is.
    """
    for attempt in range(PORT_RETRIES):
        try:
            return start()
        except FleetError as e:
            if "Address already in use" not in str(e) or attempt == PORT_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200; raise :class:`FleetError` early if ``proc`` died.

    The one readiness poll: :class:`Fleet`, :class:`Router` and the tests (``tests/support.py``) use it.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise FleetError(f"exited with {proc.returncode} before {url} was ready")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise FleetError(f"{url} not ready after {timeout:.0f}s (last: {last!r})")


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and every descendant alive now (a router's
    workers, a vLLM server's engine core). psutil is imported here, not at the top: it comes
    with the ``loadtest`` extra, and this module is imported by every lab command's ``--help``."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class _Supervised:
    """One child process, started once and always stopped: the lifecycle :class:`Fleet` and
    :class:`Router` share. A subclass's ``_spawn`` starts ``self.child`` and names the URLs
    that answer 200 once it is ready."""

    child: Child | None = None

    def _spawn(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 120.0) -> Self:
        """Start once: ``with Fleet(...).start()`` enters an already started child."""
        if self.child is not None and self.child.alive():
            return self
        return _with_port_retries(lambda: self._start(timeout_s))

    def _start(self, timeout_s: float) -> Self:
        urls = self._spawn()
        assert self.child is not None
        try:
            for url in urls:
                wait_http(url, timeout_s, self.child.popen)
        except FleetError as e:
            message = f"{self.child.name}: {e}:\n{self.child.log_tail()}"
            self.stop()
            raise FleetError(message) from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    url: str
    kv_events: str
    kv_replay: str


@dataclass(slots=True)
class FleetSpec:
    """The simulated engines: ``backends`` engines of one model, with the sim's own defaults
    for everything left ``None``."""

    backends: int = 4
    model: str = "qwen3-sim"
    tokenizer: str = str(DEFAULT_TOKENIZER)
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = "0"
    vllm_version: str = "0.33.0"
    speedup: float = 1.0
    num_blocks: int | None = None
    cpu_offload_blocks: int = 0
    """Blocks of each engine's CPU offload tier (``--cpu-offload-blocks``; 0: GPU only)."""
    sim_args: list[str] = field(default_factory=list)


class EngineFleet:
    """What the bench, the tests and the router need of any fleet: its engines and one model.

    ``spec`` carries the model's hashing settings under :class:`FleetSpec`'s names, so a
    router config is written the same way for simulated and real engines.
    """

    spec: Any
    engines: list[Engine]

    def model_config(self) -> dict[str, Any]:
        """The ``models[]`` entry (:class:`kvconfig.Model` shape) serving this fleet."""
        s = self.spec
        return {
            "name": s.model, "tokenizer": s.tokenizer, "block_size": s.block_size, "hash_algo": s.hash_algo,
            "hash_seed": s.hash_seed, "vllm_version": s.vllm_version,
            "backends": [{"name": e.name, "url": e.url, "kv_events": e.kv_events, "kv_replay": e.kv_replay}
                         for e in self.engines],
        }

    def router_config(self, policy: str, port: int, weights: dict[str, Any] | None = None, workers: int = 1,
                      settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """A whole router config for this fleet with one policy (one router process unless
        ``workers`` says otherwise: the bench compares policies, not process counts);
        ``settings``: more ``router`` keys (e.g. ``expose_decision_headers``)."""
        router: dict[str, Any] = {**(settings or {}), "host": "127.0.0.1", "port": port, "policy": policy,
                                  "workers": workers}
        if weights:
            router["weights"] = weights
        return {"models": [self.model_config()], "router": router, "index": "memory"}

    def reset_caches(self) -> None:
        """Empty every engine's prefix cache (vLLM's ``POST /reset_prefix_cache``).

        vLLM refuses (``{"success": false}``) while a request holds blocks; a run must not
        start on a cache the last one left, so that is an error, not a warning.
        """
        for e in self.engines:
            r = httpx.post(e.url + "/reset_prefix_cache", timeout=30.0)
            r.raise_for_status()
            if r.headers.get("content-type", "").startswith("application/json") and r.json().get("success") is False:
                raise FleetError(f"{e.name} refused to reset its prefix cache (a request still holds blocks)")


class Fleet(EngineFleet, _Supervised):
    """``kvrouter sim --instances K`` in one child process; engine i on consecutive ports."""

    def __init__(self, spec: FleetSpec, workdir: Path, *, name: str = "sim") -> None:
        self.spec = spec
        self.workdir = workdir
        self.name = name
        self.engines: list[Engine] = []

    def _spawn(self) -> list[str]:
        s = self.spec
        self.workdir.mkdir(parents=True, exist_ok=True)
        base = free_port_run(3 * s.backends)
        http, events, replay = base, base + s.backends, base + 2 * s.backends
        args = [*KVROUTER, "sim", "--port", str(http), "--model", s.model, "--tokenizer", s.tokenizer,
                "--kv-events-port", str(events), "--replay-port", str(replay), "--instances", str(s.backends),
                "--block-size", str(s.block_size), "--hash-algo", s.hash_algo, "--vllm-version", s.vllm_version,
                "--speedup", str(s.speedup)]
        if s.hash_seed is not None:
            args += ["--hash-seed", s.hash_seed]
        if s.num_blocks is not None:
            args += ["--num-blocks", str(s.num_blocks)]
        if s.cpu_offload_blocks:
            args += ["--cpu-offload-blocks", str(s.cpu_offload_blocks)]
        args += s.sim_args
        self.child = Child(self.name, args, self.workdir / f"{self.name}.log")
        self.engines = [
            Engine(f"engine-{i}", f"http://127.0.0.1:{http + i}", f"tcp://127.0.0.1:{events + i}",
                   f"tcp://127.0.0.1:{replay + i}")
            for i in range(s.backends)
        ]
        return [e.url + "/health" for e in self.engines]


class _RouterProcess(_Supervised):
    """A router child on a loopback port (``port`` is picked when it spawns)."""

    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Router(_RouterProcess):
    """``kvrouter serve`` for a :class:`Fleet` with one policy, on a free port."""

    def __init__(self, fleet: EngineFleet, policy: str, workdir: Path, *, weights: dict[str, Any] | None = None,
                 workers: int = 1, settings: dict[str, Any] | None = None,
                 tuning: dict[str, Any] | None = None) -> None:
        self.fleet = fleet
        self.policy = policy
        self.workdir = workdir
        self.weights = weights
        self.workers = workers
        self.settings = settings
        self.tuning = tuning

    def _spawn(self) -> list[str]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port_run(1)
        cfg_path = self.workdir / f"router-{self.policy}.yaml"
        cfg_path.write_text(yaml.safe_dump(self.fleet.router_config(self.policy, self.port, self.weights, self.workers,
                                                                 self.settings)))
        args = [*KVROUTER, "serve", "--config", str(cfg_path), "--port", str(self.port), "--policy", self.policy]
        if self.tuning:
            args += ["--tuning", json.dumps(self.tuning)]
        self.child = Child(f"router-{self.policy}", args, self.workdir / f"router-{self.policy}.log", LAB_POLICIES)
        return [self.url + "/health"]

    def _start(self, timeout_s: float) -> Self:
        super()._start(timeout_s)
        self._wait_for_event_streams(min(timeout_s, 10.0))
        return self

    def _wait_for_event_streams(self, timeout_s: float) -> None:
        """Return once the router follows every engine's KV-event stream (best effort): until
        then kv_aware decides without events (reason ``no_events``), which measures the
        router's start-up, not the policy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                backends = httpx.get(self.url + "/debug/backends", timeout=2.0).json()["backends"]
                if all(b.get("connected") for b in backends):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.05)


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """A ``/metrics`` page as ``{name{labels}: value}`` summed over label sets per sample name.

    Samples are keyed by bare name (labels dropped, values summed), which is what the
    bench needs: one engine per URL, one router.
    """
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url, timeout=timeout_s)
    r.raise_for_status()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def scrape_labelled(url: str, sample: str, label: str, timeout_s: float = 5.0) -> dict[str, float]:
    """One sample on a ``/metrics`` page, summed per value of one of its labels
    (``kvrouter_routing_decisions_total`` by ``reason``, a histogram's ``_bucket`` by ``le``)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url, timeout=timeout_s)
    r.raise_for_status()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == sample and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + float(s.value)
    return out


def scrape_buckets(url: str, histogram: str, timeout_s: float = 5.0) -> dict[float, float]:
    """Cumulative bucket counts ``{le: count}`` of one histogram on a ``/metrics`` page, summed over label sets."""
    return {float(le): n for le, n in scrape_labelled(url, histogram + "_bucket", "le", timeout_s).items()}


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding rank ``q``.

    A rank in the ``+Inf`` bucket returns the highest finite bound, as Prometheus does.
    """
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    prev_le, prev_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le
