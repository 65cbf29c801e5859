"""``kvrouter serve --workers N``: N router processes on one port, under a small supervisor.

The shape is gunicorn's and uvicorn's (``uvicorn --workers``): a parent that routes
nothing starts N worker processes, forwards signals to them and restarts one that
dies; the kernel spreads connections over the workers. There is no balancer in front.

**How connections are spread: SO_REUSEPORT.** Each worker opens its own listening socket
on the port with ``SO_REUSEPORT``, and Linux hashes every new connection to one of the
listeners. The other common way, one socket bound by the parent and inherited by every
worker (gunicorn, ``uvicorn --workers``), lets whichever worker's ``accept`` wins the
wake-up take the connection. Measured on this 2-core machine with
``benchmarks/bench_workers.py accept`` (2 uvloop workers, 400 connections of 5 requests,
medians of 5 rounds), both spread evenly: the busier worker took 0.510 of the
connections with SO_REUSEPORT and 0.540 with one shared socket at 32 connections at a
time and 200 us of CPU per request, 0.527 and 0.515 at 4 at a time and 50 us. The
numbers do not decide it; SO_REUSEPORT is kept because each worker has an accept queue
of its own (no wake-up of every idle worker for each connection, no inherited file
descriptors to pass), at one known cost: connections still waiting in the queue of a
worker that dies or closes its socket are reset instead of going to another worker (on
SIGTERM every worker closes its socket at once, so new connections are refused either
way). A worker listens only once its router has started, so a restarting worker is sent
no connection while it loads its tokenizers. The supervisor keeps a bound, non-listening
socket on the port, which reserves it (port 0 resolves to one port for every worker)
without receiving connections.

**What workers share** (the fleet-state log, :mod:`router.fleet.log`, through a ring per
worker in shared memory, :mod:`router.fleet.ring`): each backend's load (every worker's
tickets, so kv_aware weighs every request, not 1/N of them), the policies' recent
decisions, and one health verdict per backend (worker 0 checks, the others follow). ``/metrics`` sums every worker's series
(through snapshots in the run directory's ``metrics/``: see :mod:`router.http.worker_metrics`).
Each worker follows the engines' KV-event streams itself with the in-memory index, or
reads the Redis index ``kvrouter indexer`` fills: docs/scaling.md gives the measured costs
of both.

**Signals.** SIGTERM: forwarded to every worker, each drains as a single router does
(:mod:`router.http.server`), and the supervisor exits 0 once all of them exited 0. SIGINT
likewise. SIGHUP: forwarded; each worker re-reads the config file (the log names backends,
so workers that reload a moment apart agree).

**Restarts.** A worker that exits while the supervisor is not stopping is restarted
after a back-off (:data:`FIRST_BACKOFF_S`, doubling to :data:`MAX_BACKOFF_S`, back to
the first after :data:`STABLE_S` of life); its ring's generation is bumped when it dies (its
requests died with it: the other workers drop its load at once, no phantom load) and ``kvrouter_worker_restarts`` counts it. A worker that
exits with status 2 or 3 (its config did not load, its router did not start) stops the
supervisor with that status: a restart would fail the same way.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import FrameType

from kvconfig import Config
from router.fleet.ring import Ring

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_S = 30.0
POLL_S = 0.1
FATAL = (2, 3)
"""A worker's exit statuses that stop the supervisor: 2, its config did not load; 3, its
router did not start (a tokenizer that does not load). A restart would fail the same way
(gunicorn's boot error does the same)."""
RING_FILE = "fleet"
METRICS_DIR = "metrics"


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def default_workers(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may use: its CPU affinity (else the machine's cores), capped by
    its cgroup's CPU quota rounded up (``cpu.max``; a pod limited to 2 CPUs on a 96-core node
    would otherwise fork 96 workers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpus(cpu_max)
    return max(1, min(cores, quota)) if quota is not None else cores


def cgroup_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """The CPUs a cgroup v2 quota allows (``"QUOTA PERIOD"``, rounded up), None without one."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def worker_count(cli: int | None, config: Config) -> int:
    """``--workers``, else ``KVROUTER_WORKERS``, else ``router.workers``, else the cores
    (raises ValueError on a bad variable)."""
    if cli is not None:
        return cli
    env = os.environ.get("KVROUTER_WORKERS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"KVROUTER_WORKERS must be a whole number of at least 1, got {env!r}") from None
        if n < 1:
            raise ValueError(f"KVROUTER_WORKERS must be at least 1, got {n}")
        return n
    if config.router.workers is not None:
        return config.router.workers
    return default_workers()


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT``, not listening yet (a
    worker's server listens on it once started; the supervisor's never does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def _reserve(host: str, port: int) -> socket.socket:
    """The supervisor's non-listening SO_REUSEPORT socket on the port, after checking that
    nothing listens there: SO_REUSEPORT would let a second router started on the same port
    by mistake join the first one's group silently (connections split between two
    routers). A bind without SO_REUSEPORT fails on a port with any listener, SO_REUSEPORT
    or not (SO_REUSEADDR only lets it past connections in TIME_WAIT, so a restart works)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    return reuseport_socket(host, port)


def _worker_preexec() -> None:
    """In the worker before it runs: SIGHUP ignored until its router can reload (a reload
    forwarded while it starts must not end it; it reads the config file at start anyway),
    and a process group of its own, so a terminal's Ctrl-C reaches the supervisor alone
    and each worker gets one SIGINT, forwarded (a second one would cut its drain short)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.setpgid(0, 0)


class Supervisor:
    """Starts, watches, signals and restarts the workers (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, config: Config, n: int) -> None:
        self.args = args
        self.config = config
        self.n = n
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.started_at = [0.0] * n
        self.backoff = [FIRST_BACKOFF_S] * n
        self.restart_at: list[float | None] = [None] * n
        self.stopping: int | None = None
        self.exit_codes: dict[int, int] = {}
        self.replica = uuid.uuid4().hex[:12]

    def run(self) -> int:
        if not hasattr(socket, "SO_REUSEPORT"):
            print("--workers above 1 needs SO_REUSEPORT (Linux, BSD); run with --workers 1", file=sys.stderr)
            return 2
        shm = Path("/dev/shm")
        rundir = Path(tempfile.mkdtemp(prefix="kvrouter-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
        try:
            (rundir / METRICS_DIR).mkdir()
            self.ring = Ring.create(rundir / RING_FILE, self.n)
            settings = self.config.router
            try:
                holder = _reserve(settings.host, settings.port)
            except OSError as e:
                print(f"cannot bind {settings.host}:{settings.port}: {e}", file=sys.stderr)
                return 2
            self.port = holder.getsockname()[1]
            self.rundir = rundir
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, self._on_signal)
            log.info("supervisor %d: %d workers on %s:%d (SO_REUSEPORT)", os.getpid(), self.n, settings.host, self.port)
            for i in range(self.n):
                self._spawn(i)
            code = self._watch()
            holder.close()
            self.ring.close()
            return code
        finally:
            shutil.rmtree(rundir, ignore_errors=True)

    def _on_signal(self, sig: int, _: FrameType | None) -> None:
        if sig == signal.SIGHUP:
            log.info("SIGHUP: every worker reloads the config")
        elif self.stopping is None:
            self.stopping = sig
            log.info("%s: stopping the workers (each drains)", signal.Signals(sig).name)
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(sig)

    def _command(self, i: int) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "router.cli", "serve", "--config", a.config, "--host", self.config.router.host,
               "--port", str(self.port), "--log-level", a.log_level, "--log-format", a.log_format, "--workers", "1",
               "--worker-index", str(i), "--shared-dir", str(self.rundir), "--replica", self.replica]
        if a.policy is not None:
            cmd += ["--policy", a.policy]
        if a.tuning is not None:
            cmd += ["--tuning", a.tuning]
        if a.reload_config:
            cmd.append("--reload-config")
        return cmd

    def _spawn(self, i: int) -> None:
        self.ring.new_generation(i)
        self.procs[i] = subprocess.Popen(self._command(i), stdin=subprocess.DEVNULL,
                                         preexec_fn=_worker_preexec)
        self.started_at[i] = time.monotonic()
        self.restart_at[i] = None
        log.info("worker %d started (pid %d)", i, self.procs[i].pid)  # type: ignore[union-attr]
        if self.stopping is not None:  # the signal came while it was being started: it was not forwarded to it
            self.procs[i].send_signal(self.stopping)  # type: ignore[union-attr]

    def _watch(self) -> int:
        while True:
            now = time.monotonic()
            for i, p in enumerate(self.procs):
                if p is not None and (code := p.poll()) is not None:
                    self._exited(i, p, code, now)
                if self.procs[i] is None and self.stopping is None and (at := self.restart_at[i]) is not None and now >= at:
                    self._spawn(i)
            if self.stopping is not None and all(p is None for p in self.procs):
                bad = {i: c for i, c in self.exit_codes.items() if c != 0}
                if bad:
                    log.warning("workers exited with %s", bad)
                return 0 if not bad else next((c for c in bad.values() if c in FATAL), 1)
            if any(c in FATAL for c in self.exit_codes.values()) and self.stopping is None:
                log.error("a worker could not start (its config or tokenizer did not load): stopping")
                self._on_signal(signal.SIGTERM, None)
            time.sleep(POLL_S)

    def _exited(self, i: int, p: subprocess.Popen[bytes], code: int, now: float) -> None:
        self.procs[i] = None
        self.ring.new_generation(i, restarted=self.stopping is None and code not in FATAL)  # its requests died with it
        if self.stopping is not None:
            # Killed by the forwarded signal itself: it had not installed its handlers, so
            # it was still starting and served nothing.
            self.exit_codes[i] = 0 if code == -self.stopping else code
            log.info("worker %d exited (%d)", i, code)
            return
        if code in FATAL:
            self.exit_codes[i] = code
            return
        lived = now - self.started_at[i]
        if lived >= STABLE_S:
            self.backoff[i] = FIRST_BACKOFF_S
        delay = self.backoff[i]
        self.backoff[i] = min(MAX_BACKOFF_S, delay * 2)
        self.restart_at[i] = now + delay
        log.warning("worker %d (pid %d) died with status %d after %.1fs: restarting in %.1fs", i, p.pid, code, lived, delay)
