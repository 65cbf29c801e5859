"""``kvrouter serve --config FILE [--port P] [--policy NAME] [--workers N] [--reload-config] [--otel]``: run the router.

uvicorn with uvloop and httptools (the fastest event loop and HTTP parser it offers);
access logs are off because they cost more than routing a short request. With one
worker (``--workers 1``) this is the whole router, in one process; with more, a
supervisor (:mod:`router.http.workers`) runs this same command once per worker, each with
its own ``SO_REUSEPORT`` socket on the port and the directory of the host's fleet-state ring.

``--otel``, or ``OTEL_TRACES_EXPORTER=otlp|console`` in the environment, turns on
OpenTelemetry tracing (:mod:`router.http.tracing`; each worker sets up its own exporter).

The GIL switch interval is lowered from 5 ms to 0.5 ms: the KV-event subscriber and the
tokenizer pool are CPU-bound threads, and with the default interval the event loop can
wait up to 5 ms for the GIL after each of its awaits, which shows up directly as
routing latency. The cost is a little more switching on the background threads.

Operations (:class:`Server`, :class:`ConfigReloader`):

- **SIGTERM drains.** The listener closes at once (new connections are refused), idle
  keep-alive connections are closed, ``/health`` answers 503 ``draining`` and a request
  arriving on a connection still open is refused with 503 ``shutting_down``. Requests in
  flight run on for up to ``router.drain_timeout_s``; what still runs then is cut (a
  stream ends with an error event, never silently), and the process exits 0. uvicorn
  would re-raise the signal after its own graceful shutdown (exit status -15); a drained
  router has done what SIGTERM asked, so it exits 0. SIGINT (Ctrl-C) keeps uvicorn's
  behaviour, a second one forcing the exit.
- **SIGHUP reloads** the ``--config`` file the server started with (the command line's
  ``--host``/``--port``/``--policy`` still applied). ``--reload-config`` also reloads it
  whenever it changes (polled every second; a change is taken once the file has stayed
  the same for one poll, so a half-written file is not read). Only backends may change:
  see :meth:`router.core.Router.reload`. A file that fails to load or validate is refused
  with a log line and ``kvrouter_config_reloads{outcome="invalid"}``; the router goes on
  with the config it has.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from router import metrics
from router.http import tracing
from router.http.guard import Limits, default_max_connections, guarded, raise_fd_limit
from kvconfig import Config, ConfigError, load_config
from router.policies import load_plugins, offered
from router.tuning import Tuning

if TYPE_CHECKING:
    from router.core import Router

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005
GC_THRESHOLD_0 = 20_000
"""The cyclic collector's first-generation threshold (Python's default is 700). A request
frees what it allocates by reference counting, but at 700 the collector still ran about
every 7 short requests, each pass scanning what the requests in flight hold: 12.6 us of
GC per short request under wrk, ~5.5% of a worker's CPU (measured with ``gc.callbacks``;
at 20,000 no collection ran in 32,000 requests). Cyclic garbage waits longer, which the
router makes little of."""
CUT_GRACE_S = 5.0
"""After the drain deadline cut what still ran, how long the cut answers get to reach their
clients before uvicorn cancels whatever is left."""
RELOAD_POLL_S = 1.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="fleet config (YAML)")
    parser.add_argument("--host", default=None, help="override router.host")
    parser.add_argument("--port", type=int, default=None, help="override router.port")
    load_plugins()
    parser.add_argument("--policy", choices=offered(), default=None, help="override router.policy for every model")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", choices=["text", "json"], default="text",
                        help="json: one JSON object per log line (ts, level, logger, worker, message, exc)")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                        help="one JSON line per request on stdout (default on; KVROUTER_ACCESS_LOG=0 turns it off)")
    parser.add_argument("--otel", action="store_true",
                        help="OpenTelemetry tracing: spans over OTLP (OTEL_EXPORTER_OTLP_ENDPOINT) unless "
                             "OTEL_TRACES_EXPORTER names another exporter; OTEL_TRACES_EXPORTER=otlp|console turns it on "
                             "too (needs the 'otel' extra; docs/operations.md)")
    parser.add_argument("--reload-config", action="store_true",
                        help="reload --config whenever the file changes (SIGHUP always reloads it): backends can be "
                             "added and removed without dropping traffic")
    parser.add_argument("--workers", type=int, default=None,
                        help="router processes on the port, sharing load and health (default: router.workers, else "
                             "KVROUTER_WORKERS, else the cores this process may use; 1: a single process)")
    # Set by the supervisor for each worker it starts (router/http/workers.py).
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shared-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--replica", default=None, help=argparse.SUPPRESS)
    # The lab's knobs as JSON (router/tuning.py): the bench and tests set them, operators do not.
    parser.add_argument("--tuning", default=None, help=argparse.SUPPRESS)


def read_tuning(raw: str | None) -> Tuning | None:
    """``--tuning``'s JSON (raises :class:`ConfigError` naming what is wrong)."""
    if raw is None:
        return None
    try:
        return Tuning.model_validate_json(raw)
    except ValueError as e:
        raise ConfigError(f"--tuning: {e}") from e


def read_config(args: argparse.Namespace) -> Config:
    """The ``--config`` file with the command line's overrides (raises :class:`ConfigError`)."""
    config = load_config(args.config)
    if args.port is not None:
        config.router.port = args.port
    if args.host is not None:
        config.router.host = args.host
    if args.policy is not None:
        config.router.policy = args.policy
        for m in config.models:
            m.policy = None
    return config


class ConfigReloader:
    """Re-reads the config on SIGHUP, and with ``watch`` whenever the file changes, and hands
    it to :meth:`router.core.Router.reload`."""

    def __init__(self, router: Router, read: Callable[[], Config], path: Path, watch: bool) -> None:
        self.router = router
        self.read = read
        self.path = path
        self.watch = watch
        self._tasks: set[asyncio.Task[str | None]] = set()

    def start(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: self._spawn(self.reload()))
        if self.watch:
            self._spawn(self._watch())

    def stop(self) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload while draining changes nothing
        for t in self._tasks:
            t.cancel()

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self) -> str:
        try:
            config = await asyncio.to_thread(self.read)
        except ConfigError as e:
            log.error("config reload refused, the old config keeps serving: %s", e)
            metrics.child(metrics.CONFIG_RELOADS, "invalid").inc()
            return "invalid"
        try:
            return await self.router.reload(config)
        except Exception:  # noqa: BLE001 - a bug in a reload must not end the router that serves
            log.exception("config reload failed")
            metrics.child(metrics.CONFIG_RELOADS, "failed").inc()
            return "failed"

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    async def _watch(self) -> None:
        seen = pending = self._stamp()
        while True:
            await asyncio.sleep(RELOAD_POLL_S)
            now = self._stamp()
            if now is not None and now != seen and now == pending:
                seen = now
                await self.reload()
            pending = now


class Server(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM and reloading on SIGHUP (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, router: Router, reloader: ConfigReloader) -> None:
        super().__init__(config)
        self.router = router
        self.reloader = reloader
        self.parent: int | None = None
        """A worker's supervisor: if it goes away, the worker drains (nobody else would stop it)."""
        self._watch: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM:
            self.should_exit = True  # not recorded for re-raising: a drained router exits 0
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.reloader.start()
            if self.parent is not None:
                self._watch = asyncio.create_task(self._watch_parent(self.parent))

    async def _watch_parent(self, parent: int) -> None:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.error("the supervisor (pid %d) is gone: draining", parent)
        self.handle_exit(signal.SIGTERM, None)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.started:
            self.reloader.stop()
        self.router.begin_drain()
        await super().shutdown(sockets)


def _access_to_stdout() -> None:
    """Access-log lines go to stdout as they are (JSON, one per line), the rest of the log to stderr."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("kvrouter.access")
    access.handlers[:] = [handler]
    access.setLevel(logging.INFO)
    access.propagate = False


class JsonFormatter(logging.Formatter):
    """``--log-format json``: a log line as one JSON object, for collectors that parse rather than grep."""

    def __init__(self, worker: int | None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                                   "message": record.getMessage()}
        if self.worker is not None:
            line["worker"] = self.worker
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def run(args: argparse.Namespace) -> int:
    worker = "" if args.worker_index is None else f"worker {args.worker_index} "
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s {worker}%(name)s: %(message)s")
    if args.log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter(args.worker_index))
    if args.access_log is not None:  # the environment carries it to the workers
        os.environ["KVROUTER_ACCESS_LOG"] = "1" if args.access_log else "0"
    _access_to_stdout()
    try:
        config = read_config(args)
        tuning = read_tuning(args.tuning)
        traces = tracing.exporters(args.otel)
        if traces:
            tracing.check(traces)
            os.environ["OTEL_TRACES_EXPORTER"] = ",".join(traces)  # what the workers read, --otel included
    except (ConfigError, tracing.TracingError) as e:
        print(e, file=sys.stderr)
        return 2
    if config.router.tenants:
        from router.http.tenants import Tenants

        try:
            Tenants(config.router)  # a tenant's missing key variable or file stops the start here, named
        except ValueError as e:
            print(f"{args.config}: {e}", file=sys.stderr)
            return 2
    if args.workers is not None and args.workers < 1:
        print(f"--workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    if tuning is not None and args.worker_index is None and (changed := tuning.model_dump(exclude_defaults=True)):
        log.warning("lab tuning in effect (--tuning, not the config): %s", changed)
    if args.worker_index is None:
        from router.http.workers import Supervisor, worker_count

        try:
            n = worker_count(args.workers, config)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        if n > 1:
            return Supervisor(args, config, n).run()
    from router.http.app import create_app

    if args.worker_index is not None:
        from router.http.workers import METRICS_DIR

        metrics.process_metrics().publish(Path(args.shared_dir) / METRICS_DIR)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the router can reload (its default would end the process)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.set_threshold(GC_THRESHOLD_0)
    # One prompt per encode call: rayon's pool adds threads (and scheduling) and no speed,
    # and it would run deferred tokenization outside the lowered-priority thread.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    problem = load_tokenizers(config)
    if problem is not None:
        print(f"{args.config}: {problem}", file=sys.stderr)
        return 3
    tracer = tracing.start(traces, args.worker_index) if traces else None
    try:
        app = create_app(config, tuning=tuning, tracer=tracer)
    except (ValueError, OSError) as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 2
    fds = raise_fd_limit()
    t = tuning or Tuning()
    limits = Limits(t.max_connections or default_max_connections(fds), t.client_timeout_s)
    server_config = uvicorn.Config(
        app,
        host=config.router.host,
        port=config.router.port,
        loop="uvloop",
        http=guarded(limits),
        access_log=False,  # the router writes its own (router/http/observe.py)
        log_level=args.log_level,
        **({"log_config": None} if args.log_format == "json" else {}),  # uvicorn's lines through the JSON handler too
        proxy_headers=False,  # nothing reads the client address; skips a header scan per request
        timeout_keep_alive=30,
        backlog=4096,
        timeout_graceful_shutdown=config.router.drain_timeout_s + CUT_GRACE_S,
    )
    server = Server(server_config, app.state.router, ConfigReloader(app.state.router, lambda: read_config(args),
                                                                    Path(args.config), args.reload_config))
    if args.worker_index is None:
        server.run()
    else:
        server.parent = os.getppid()
        server.run(sockets=[_join_workers(args, config, app.state.router)])
    return 0 if server.started else 3


def load_tokenizers(config: Config) -> str | None:
    """Load every model's local tokenizer before the server starts (the router finds them in
    the process's cache), or the one line naming the key that did not load: failing inside
    the server's start-up printed a 98-line traceback that never named it."""
    from router.prompt.prompt_fields import TokenizeError
    from router.prompt.tokenize import load_tokenizer

    for i, m in enumerate(config.models):
        if m.tokenizer_mode != "local":
            continue
        try:
            load_tokenizer(m.tokenizer)
        except TokenizeError as e:
            return f"models[{i}].tokenizer ({m.name}): {e}"
    return None


def _join_workers(args: argparse.Namespace, config: Config, router: Router) -> socket.socket:
    """A worker of ``serve --workers N``: attach the host's fleet-state ring and bind the port with
    SO_REUSEPORT. The socket is not listening yet: uvicorn's server listens on it once the
    router has started (tokenizers loaded, backends checked), so the kernel sends a
    starting or restarting worker no connection it could not answer for seconds."""
    from router.fleet.ring import Ring
    from router.http.workers import RING_FILE, reuseport_socket

    router.share(Ring.attach(Path(args.shared_dir) / RING_FILE, args.worker_index), args.worker_index, args.replica)
    return reuseport_socket(config.router.host, config.router.port)

