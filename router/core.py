"""The router's live state and its lifecycle: what starts, what runs beside requests, what stops.

:class:`Router` builds the request path's stages once (:mod:`router.request_path`) and
owns what lives as long as the process: the models, the backends' pools and health loop,
the load tracker, the index and the KV-event subscriber that fills it, the background
thread, and the tasks beside the requests (health checks, ``/metrics`` scrapes,
``max_model_len`` discovery). It decides nothing itself.

Two operations change it while it serves:

- **drain** (:meth:`Router.begin_drain`, on SIGTERM): ``/health`` answers 503 and new
  requests are refused while the server stops accepting connections; the requests in
  flight run on for at most ``router.drain_timeout_s``, then are cut (an open stream ends
  with an error event, :class:`router.http.errors.ShuttingDown`).
- **reload** (:meth:`Router.reload`, on SIGHUP): a re-read config may add and remove
  backends, nothing else (anything else needs a restart and the reload is refused whole).
  An added backend gets its session, a health check and its event stream before it can
  be chosen; a removed one is no candidate from that moment, its requests in flight run
  to their end, and only then are its event stream, index entries, policy memory, load
  and connections dropped (:meth:`Router._retire`).
- **discovery** (``models[].discovery``, :mod:`router.fleet.discovery`): the backends a DNS
  name lists are added and removed through the same path, merged with the file's.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from indexer.index import Index, MemoryIndex, Worker
from router import metrics
from router.admission import ModelQueue
from router.background import MAX_SETTLING, Background
from router.fleet.backends import BackendPool
from kvconfig import Backend, Config
from router.http.errors import NoHealthyBackend
from router.fleet.gauges import FleetCollector
from router.fleet.load import Capacity, LoadTracker
from router.fleet.scrape import scrape_forever
from router.plans import Planner
from router.prompt.prompt_ids import IdSource
from router.http.proxy import Upstreams
from router.request_path import RequestPath
from router.runtime import ModelRuntime, Models
from router.settle import Settler
from router.tuning import Tuning

if TYPE_CHECKING:
    from indexer.subscriber import StreamSpec
    from router.fleet.process import FleetLog
    from router.fleet.ring import Ring

log = logging.getLogger(__name__)

RETIRE_POLL_S = 0.1


class Router:
    """The router's live state: models, backends, load, index and event subscriber."""

    def __init__(self, config: Config, index: Index | None = None, tuning: Tuning | None = None) -> None:
        self.config = config
        self.static = config
        """The config as the file gave it: :attr:`config` is it with the discovered backends."""
        self.discovered: dict[str, list[Backend]] = {}
        """Each model's backends discovery found last (:mod:`router.fleet.discovery`)."""
        self.settings = config.router
        self.tuning = t = tuning or Tuning()
        """The lab's knobs (:mod:`router.tuning`): not in the config file."""
        self.pool = BackendPool(config, t)
        self.loads = LoadTracker(list(self.pool.backends))
        self.loads.on_capacity = self._take_capacity
        self.index: Index = index if index is not None else make_index(config.index_url, config.index_namespace)
        self.models = Models(config, t)
        # Two workers: tokenization holds the GIL for its Python part (template rendering), so
        # more threads would only contend with the event loop for it.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.background = Background(MAX_SETTLING)
        """Work a request leaves behind once sent, on one low-priority thread (:mod:`router.background`)."""
        self.settler = Settler(self.background, self.pool)
        self.streams = metrics.StreamView()
        self.stream_registry = CollectorRegistry(auto_describe=True)
        """The subscriber's own series, exposed through :class:`router.fleet.gauges.FleetCollector` so
        that several routers can live in one process (tests) without name clashes."""
        planner = Planner(
            IdSource(self.executor, self.pool, t.inline_tokenize_bytes, t.tokenize_pending_bytes),
            defer=t.defer_cold_prompts, inline_bytes=t.inline_tokenize_bytes,
            busy=lambda: self.background.full,
        )
        upstreams = Upstreams(self.pool, self.loads, self.settings.retries)
        self.path = RequestPath(self.settings, self.models, self.index, self.loads, upstreams, planner, self.settler,
                                self.streams, queues=self._queues())
        self._tasks: list[asyncio.Task[None]] = []
        self._unregister_metrics: Any = None
        self.draining = False
        self._drain_started = 0.0
        self._reload_lock = asyncio.Lock()
        self._followed: list[StreamSpec] = []
        """The event streams the subscriber follows (each a worker of a backend and a model)."""
        self._retiring: set[str] = set()
        """Backends a reload removed whose requests in flight have not all ended yet (their
        event streams are followed until then)."""
        self.worker = 0
        self.replica = uuid.uuid4().hex[:12]
        self.ring: Ring | None = None
        self.fleet: FleetLog | None = None
        """The fleet-state log this process shares with the router's others (:mod:`router.fleet.log`)."""

    def share(self, ring: Ring, worker: int, replica: str) -> None:
        """Worker ``worker`` of a ``serve --workers N`` supervisor: the fleet-state log shared
        with the host's other workers through ``ring`` (call before :meth:`start`)."""
        self.ring, self.worker, self.replica = ring, worker, replica

    def _share_fleet_state(self) -> None:
        """Append this process's records to the fleet-state log and fold the others': through
        the host's ring (workers), and through Redis (replicas, ``router.fleet_state``)."""
        from router.fleet.log import TTL_S, FleetState
        from router.fleet.process import FleetLog

        url = self.config.fleet_state_url()
        stream = None
        if url is not None:
            from router.fleet.stream import FleetStream

            stream = FleetStream(url, self.config.index_namespace, self.replica, self.worker, TTL_S)
        if self.ring is None and stream is None:
            return
        state = FleetState({rt.name: rt.prefixes for rt in self.models if rt.prefixes is not None})
        self.fleet = FleetLog(state, self.loads.snapshot, host=self.ring, fleet=stream)
        self.loads.share(self.fleet)
        if self.ring is not None:
            self.pool.share(self.fleet, self.worker, self.ring.n_workers)
        self.path.stream = stream

    async def start(self) -> None:
        await self.models.load_tokenizers(self.executor)
        if self._subscribes():
            from indexer.subscriber import specs_from_config

            self._follow(specs_from_config(self.config))
        else:
            await warn_if_unfilled(self.index, self.config)
            if any(rt.has_events for rt in self.models):
                self._tasks.append(asyncio.create_task(self._watch_index_feed()))
        self._unregister_metrics = metrics.register_fleet(
            FleetCollector(self.pool, self.loads, self.streams.stats, self.stream_registry, self.background,
                                   self.ring)
        )
        self._share_fleet_state()
        self.pool.open()
        await self.pool.check_all()
        for rt in self.models:
            if rt.engines is not None:
                await rt.engines.start()
        self._tasks += [
            asyncio.create_task(self.pool.health_forever(self._forget_backend)),
            asyncio.create_task(scrape_forever(self.pool, self.loads, self.tuning.metrics_scrape_interval_s)),
            asyncio.create_task(self._discover_max_model_len()),
        ]
        for m in self.config.models:
            if m.discovery is not None:
                from router.fleet.discovery import Follower

                self._tasks.append(asyncio.create_task(Follower(m.name, m.discovery, self.rediscover).run_forever()))
        if self.fleet is not None:
            from router.fleet.backends import FOLLOW_S

            self._tasks.append(asyncio.create_task(self.fleet.run_forever(FOLLOW_S)))
        # What exists now (the imports, the tokenizers: over a million objects) lives as long
        # as the router: out of the collector's sight, a full collection scans only what
        # routing allocates. Unfrozen, each took ~50 ms, a stall of every request in flight.
        gc.freeze()

    def _follow(self, specs: list[StreamSpec]) -> None:
        """Follow exactly ``specs``' event streams (a worker left out is purged from the index)."""
        self._followed = specs
        if self.streams.subscriber is not None:
            self.streams.subscriber.update_specs(specs)
            return
        from indexer.subscriber import FleetSubscriber
        from indexer.verify import SETTLE_AFTER, HashVerifier

        verifiers = {
            rt.name: HashVerifier(rt.hasher, {a.name: a.path for a in rt.config.lora_adapters}, settle_after=SETTLE_AFTER,
                                  caps=self.index.caps)
            for rt in self.models
        }
        self.streams.subscriber = FleetSubscriber(self.index, specs, verifiers=verifiers, metrics_registry=self.stream_registry)
        self.streams.subscriber.start()

    def begin_drain(self) -> None:
        """Stop taking requests and give those in flight ``router.drain_timeout_s`` to finish
        (the server stops accepting connections; see :mod:`router.http.server`)."""
        if self.draining:
            return
        self.draining = True
        self._drain_started = time.monotonic()
        in_flight = self.loads.total_in_flight()
        metrics.DRAIN_IN_FLIGHT.set(in_flight)
        log.warning("draining: %d request(s) in flight, %.1fs to finish", in_flight, self.settings.drain_timeout_s)
        self._tasks.append(asyncio.create_task(self._cut_at_deadline()))

    async def _cut_at_deadline(self) -> None:
        await asyncio.sleep(self.settings.drain_timeout_s)
        cut = sum(b.abort_in_flight(shutting_down=True) for b in self.pool.backends.values())
        if cut:
            log.warning("drain deadline: %d request(s) still running were ended with a shutting_down error", cut)

    def _queues(self) -> dict[str, ModelQueue]:
        """Each model's admission queue, when ``router.queue_busy_tokens`` turns it on."""
        busy = self.settings.queue_busy_tokens
        if busy is None:
            return {}
        pool = self.pool

        def routable(rt: ModelRuntime) -> Callable[[], list[str]]:
            return lambda: [b for b in rt.backends if pool.get(b).routable]

        return {rt.name: ModelQueue(rt.name, routable(rt), self.loads, busy, self.settings.queue_max_waiting,
                                    self.settings.queue_timeout_s, self.tuning.queue_heavy_fraction,
                                    self.tuning.queue_heavy_subset)
                for rt in self.models}

    async def stop(self) -> None:
        if self.draining:
            log.info("drained in %.2fs", time.monotonic() - self._drain_started)
        for q in self.path.queues.values():
            q.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.streams.subscriber is not None:
            await asyncio.to_thread(self.streams.subscriber.stop)
        if self.fleet is not None:
            await self.fleet.aclose()
        if self._unregister_metrics is not None:
            self._unregister_metrics()
        await self.pool.aclose()
        for rt in self.models:
            if rt.engines is not None:
                await rt.engines.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.background.shutdown()
        close = getattr(self.index, "aclose", None)
        if close is not None:
            await close()

    async def reload(self, new: Config) -> str:
        """Apply a re-read config whose only changes are backends added to or removed from
        models; returns the outcome (``kvrouter_config_reloads``). Refused whole, the old
        config serving on, when anything else changed, when a backend kept its name but
        changed its definition (give the new one a new name), or when an added backend's
        removal has not finished."""
        async with self._reload_lock:
            outcome = await self._reload(self._with_discovered(new))
            if outcome in ("applied", "unchanged"):
                self.static = new
        metrics.child(metrics.CONFIG_RELOADS, outcome).inc()
        return outcome

    async def rediscover(self, model: str, found: list[Backend]) -> str:
        """Take ``found`` as ``model``'s discovered backends, through the reload's path; returns
        its outcome (the last set stays in force when it is not applied)."""
        async with self._reload_lock:
            before = self.discovered.get(model, [])
            self.discovered[model] = found
            outcome = await self._reload(self._with_discovered(self.static))
            if outcome not in ("applied", "unchanged"):
                self.discovered[model] = before
        return outcome

    def _with_discovered(self, config: Config) -> Config:
        """``config`` with each model's discovered backends after its own (a name the file lists wins)."""
        if not self.discovered:
            return config
        models = []
        for m in config.models:
            mine = {b.name for b in m.backends}
            extra = [b for b in self.discovered.get(m.name, []) if b.name not in mine] if m.discovery else []
            models.append(m.model_copy(update={"backends": m.backends + extra}) if extra else m)
        return config.model_copy(update={"models": models})

    async def _reload(self, new: Config) -> str:
        old = self.config
        fixed = _differences(_fixed_part(old), _fixed_part(new))
        if fixed:
            log.error("config reload refused: %s changed, and only backends can change without a restart (models, "
                      "tokenizers, router settings and the index stay as they were started); the old config keeps "
                      "serving", ", ".join(sorted(fixed)))
            return "not_live"
        before = {b.name: b for m in old.models for b in m.backends}
        after = {b.name: b for m in new.models for b in m.backends}
        changed = sorted(n for n in before.keys() & after.keys() if before[n] != after[n])
        if changed:
            log.error("config reload refused: backend(s) %s changed their definition; remove them and add the "
                      "new ones under new names. The old config keeps serving", ", ".join(changed))
            return "not_live"
        if [[b.name for b in m.backends] for m in new.models] == [[b.name for b in m.backends] for m in old.models]:
            log.info("config reload: no backend added or removed")
            return "unchanged"
        busy = sorted(after.keys() & self._retiring)
        if busy:
            log.error("config reload refused: backend(s) %s are still being removed (requests in flight); "
                      "retry once they are gone", ", ".join(busy))
            return "busy"
        from indexer.subscriber import specs_from_config

        try:
            specs = specs_from_config(new)
        except ValueError as e:
            log.error("config reload refused: %s. The old config keeps serving", e)
            return "invalid"
        added = [after[n] for n in after if n not in before]
        removed = [n for n in before if n not in after]
        for b in added:
            self.loads.add(b.name)
        await asyncio.gather(*(self.pool.add(b) for b in added))
        for rt, m in zip(self.models, new.models):
            gone = set(rt.backends) - {b.name for b in m.backends}
            rt.config = m
            rt.backends = [b.name for b in m.backends]
            rt.has_events = any(b.kv_events for b in m.backends)
            if rt.memory is not None:
                for name in gone:
                    rt.memory.forget(name)
        self.config = new
        self._retiring.update(removed)
        if self._subscribes() or self.streams.subscriber is not None:
            self._follow(specs + [s for s in self._followed if s.worker.backend in self._retiring])
        for name in removed:
            self._tasks.append(asyncio.create_task(self._retire(name)))
        log.info("config reloaded: backends added: %s; removed: %s (dropped once their requests in flight end)",
                 ", ".join(b.name for b in added) or "none", ", ".join(removed) or "none")
        return "applied"

    async def _retire(self, name: str) -> None:
        """A removed backend, once its last request in flight has ended: its event stream
        stops and its workers leave the index, then its load and connections go."""
        load = self.loads.own(name)
        while load.in_flight:
            await asyncio.sleep(RETIRE_POLL_S)
        self._retiring.discard(name)
        if self.streams.subscriber is not None:
            self._follow([s for s in self._followed if s.worker.backend != name])
        await self.pool.remove(name)
        self.loads.remove(name)
        log.info("backend %s removed: its requests ended; its event stream stops and its index entries are purged", name)

    def _subscribes(self) -> bool:
        wanted = self.tuning.subscribe_events
        if wanted is None:
            wanted = self.config.index == "memory"
        return wanted and any(rt.has_events for rt in self.models)

    async def _watch_index_feed(self) -> None:
        """A router that follows no event stream (``kvrouter indexer`` fills its Redis index):
        a model counts as fed by events while the index holds blocks of its backends, so a
        miss is a ``no_hit`` (nobody holds the prefix), not ``no_events`` (the router is
        blind). Checked every health interval, off the request path."""
        while True:
            fed: set[str] = set()
            for rt in self.models:
                try:
                    held = await asyncio.to_thread(self.index.block_counts, rt.name)
                except Exception as e:  # noqa: BLE001 - Redis down: lookups fail over already; say blind
                    log.debug("index feed check for %s failed: %r", rt.name, e)
                    continue
                if any(w.backend in rt.backends for w in held):
                    fed.add(rt.name)
            self.path.fed_models.clear()
            self.path.fed_models.update(fed)
            await asyncio.sleep(self.settings.health_interval_s)

    def _take_capacity(self, name: str, capacity: Capacity) -> None:
        """A scrape read backend ``name``'s KV-cache capacity (tokens per tier, by DP rank): the
        index caps each of its workers' keys at it (:class:`indexer.index.KeyCaps`), in the
        model's blocks (one key per ``block_size`` tokens, whatever the engine's pool uses)."""
        block_size = next((rt.config.block_size for rt in self.models if name in rt.backends), None)
        backend = self.pool.backends.get(name)
        if block_size is None or backend is None:
            return
        every = range(backend.config.data_parallel_size)
        for engine, tiers in capacity.items():
            blocks = {medium: tokens // block_size for medium, tokens in tiers.items()}
            for rank in every if engine == "" else [int(engine)] if engine.isdigit() else []:
                self.index.caps.set_capacity(Worker(name, rank), blocks)

    def _forget_backend(self, name: str) -> None:
        """An ejected backend's cache is presumed gone (restart): drop what the router knew."""
        subscriber = self.streams.subscriber
        for rt in self.models:
            if name not in rt.backends:
                continue
            if rt.memory is not None:
                rt.memory.forget(name)
            if subscriber is not None:
                for rank in range(self.pool.get(name).config.data_parallel_size):
                    subscriber.mark_dead(Worker(name, rank))

    async def _discover_max_model_len(self) -> None:
        """Models without ``max_model_len`` in the config take it from a backend's /v1/models."""
        for rt in self.models:
            if rt.max_model_len is None:
                rt.max_model_len = await self.pool.max_model_len(rt.name, rt.backends)

    def sharing(self) -> dict[str, Any]:
        """Who shares this router's state (``/debug/backends``): the answering worker, the
        worker count, and whether replicas share it through Redis."""
        out: dict[str, Any] = {}
        if self.ring is not None:
            out |= {"worker": self.worker, "pid": os.getpid(), "workers": self.ring.n_workers,
                    "worker_restarts": self.ring.restarts}
        if self.path.stream is not None:
            out["replica"] = self.replica
        return out

    def can_route(self) -> bool:
        return all(any(self.pool.get(n).routable for n in rt.backends) for rt in self.models)

    def pick_any(self, body: dict[str, Any]) -> tuple[ModelRuntime, list[str]]:
        """Backends for pass-through endpoints (embeddings, tokenize): least loaded first."""
        rt, _ = self.models.resolve(body)
        return rt, self.least_loaded(rt.backends, f"model {rt.name!r}")

    def least_loaded(self, names: Iterable[str], what: str) -> list[str]:
        """The routable backends among ``names``, least loaded first (``what``: for the error)."""
        backends = self.pool.backends
        routable = [n for n in names if n in backends and backends[n].routable]
        if not routable:
            raise NoHealthyBackend(f"no healthy backend for {what}")
        routable.sort(key=lambda n: self.loads.get(n).effective_in_flight())
        return routable


def _fixed_part(config: Config) -> dict[str, Any]:
    """What a reload must leave as it is: the whole config less the models' backends."""
    out = config.model_dump()
    for m in out["models"]:
        m.pop("backends")
    return out


def _differences(old: Any, new: Any, where: str = "") -> list[str]:
    """The dotted paths at which two dumped configs differ (a list that changed length is one)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in old.keys() | new.keys() for d in _differences(old.get(k), new.get(k), f"{where}.{k}".lstrip("."))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{where}.{i}")]
    return [] if old == new else [where or "(top level)"]


def make_index(spec: str, namespace: str) -> Index:
    if spec == "memory":
        return MemoryIndex()
    from indexer.redis_index import RedisIndex

    return RedisIndex(spec, namespace=namespace)


async def warn_if_unfilled(index: Index, config: Config) -> None:
    """A router reading a Redis index that ``kvrouter indexer`` fills: say at start when
    the namespace holds none of a model's blocks. The indexer may not have started yet, or
    it writes another namespace (the index URL's ``namespace`` parameter); in the second case every lookup would miss
    without a word, so the warning names the key to compare."""
    models = getattr(index, "models", None)
    if models is None:
        return
    try:
        written = await asyncio.to_thread(models)
    except Exception as e:  # noqa: BLE001 - Redis may come up after the router; lookups then fall back
        log.warning("namespace %r: cannot read the Redis index at start: %r", config.index_namespace, e)
        return
    missing = [m.name for m in config.models if m.name not in written]
    if missing:
        log.warning("namespace %r holds no blocks of %s yet: check that kvrouter indexer runs with the same "
                    "config (its --namespace, if given, must equal the index URL's namespace parameter)",
                    config.index_namespace,
                    ", ".join(missing))
