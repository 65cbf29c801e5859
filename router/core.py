"""The router's live state and its lifecycle: what starts, what runs beside requests, what stops.

:class:`Router` builds the request path's stages once (:mod:`router.request_path`) and
owns what lives as long as the process: the models, the backends' pools and health loop,
the load tracker, the index and the KV-event subscriber that fills it, the background
thread, and the tasks beside the requests (health checks, ``/metrics`` scrapes,
``max_model_len`` discovery). It decides nothing itself.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry

from indexer.index import Index, MemoryIndex, Worker
from router import metrics
from router.background import MAX_SETTLING, Background
from router.backends import BackendPool
from router.config import Config
from router.errors import NoHealthyBackend
from router.load import LoadTracker, scrape_forever
from router.plans import Planner
from router.prompt_ids import IdSource
from router.proxy import Upstreams
from router.request_path import RequestPath
from router.runtime import ModelRuntime, Models
from router.settle import Settler

log = logging.getLogger(__name__)


class Router:
    """The router's live state: models, backends, load, index and event subscriber."""

    def __init__(self, config: Config, index: Index | None = None) -> None:
        self.config = config
        self.settings = s = config.router
        self.pool = BackendPool(config)
        self.loads = LoadTracker(list(self.pool.backends))
        self.index: Index = index if index is not None else make_index(config.index, config.index_namespace)
        self.models = Models(config)
        # Two workers: tokenization holds the GIL for its Python part (template rendering), so
        # more threads would only contend with the event loop for it.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.background = Background(MAX_SETTLING)
        """Work a request leaves behind once sent, on one low-priority thread (:mod:`router.background`)."""
        self.settler = Settler(self.background, self.pool)
        self.streams = metrics.StreamView()
        self.stream_registry = CollectorRegistry(auto_describe=True)
        """The subscriber's own series, exposed through :class:`metrics.FleetCollector` so
        that several routers can live in one process (tests) without name clashes."""
        planner = Planner(
            IdSource(self.executor, self.pool, s.inline_tokenize_bytes),
            defer=s.defer_cold_prompts, inline_bytes=s.inline_tokenize_bytes,
            busy=lambda: self.background.full,
        )
        self.path = RequestPath(s, self.models, self.index, self.loads, Upstreams(self.pool, self.loads, s.retries),
                                planner, self.settler, self.streams)
        self._tasks: list[asyncio.Task[None]] = []
        self._unregister_metrics: Any = None

    async def start(self) -> None:
        await self.models.load_tokenizers(self.executor)
        if self._subscribes():
            from indexer.subscriber import FleetSubscriber, specs_from_config
            from indexer.verify import SETTLE_AFTER, HashVerifier

            verifiers = {
                rt.name: HashVerifier(rt.hasher, {a.name: a.path for a in rt.config.lora_adapters}, settle_after=SETTLE_AFTER)
                for rt in self.models
            }
            self.streams.subscriber = FleetSubscriber(
                self.index, specs_from_config(self.config), verifiers=verifiers, metrics_registry=self.stream_registry
            )
            self.streams.subscriber.start()
        else:
            await warn_if_unfilled(self.index, self.config)
        self._unregister_metrics = metrics.register_fleet(
            metrics.FleetCollector(self.pool, self.loads, self.streams.stats, self.stream_registry, self.background)
        )
        self.pool.open()
        await self.pool.check_all()
        for rt in self.models:
            if rt.engines is not None:
                await rt.engines.start()
        self._tasks = [
            asyncio.create_task(self.pool.health_forever(self._forget_backend)),
            asyncio.create_task(scrape_forever(self.pool, self.loads, self.settings.metrics_scrape_interval_s)),
            asyncio.create_task(self._discover_max_model_len()),
        ]
        # What exists now (the imports, the tokenizers: over a million objects) lives as long
        # as the router: out of the collector's sight, a full collection scans only what
        # routing allocates. Unfrozen, each took ~50 ms, a stall of every request in flight.
        gc.freeze()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.streams.subscriber is not None:
            await asyncio.to_thread(self.streams.subscriber.stop)
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

    def _subscribes(self) -> bool:
        wanted = self.settings.subscribe_events
        if wanted is None:
            wanted = self.config.index == "memory"
        return wanted and any(rt.has_events for rt in self.models)

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

    def can_route(self) -> bool:
        return all(any(self.pool.get(n).routable for n in rt.backends) for rt in self.models)

    def pick_any(self, body: dict[str, Any]) -> tuple[ModelRuntime, list[str]]:
        """Backends for pass-through endpoints (embeddings, tokenize): least loaded first."""
        rt, _ = self.models.resolve(body)
        names = [n for n in rt.backends if self.pool.get(n).routable]
        if not names:
            raise NoHealthyBackend(f"no healthy backend for model {rt.name!r}")
        names.sort(key=lambda n: self.loads.get(n).effective_in_flight())
        return rt, names


def make_index(spec: str, namespace: str) -> Index:
    if spec == "memory":
        return MemoryIndex()
    from indexer.redis_index import RedisIndex

    return RedisIndex(spec, namespace=namespace)


async def warn_if_unfilled(index: Index, config: Config) -> None:
    """A router reading a Redis index that ``kvrouter indexer`` fills: say at start when
    the namespace holds none of a model's blocks. The indexer may not have started yet, or
    it writes another ``index_namespace``; in the second case every lookup would miss
    without a word, so the warning names the key to compare."""
    models = getattr(index, "models", None)
    if models is None:
        return
    try:
        written = await asyncio.to_thread(models)
    except Exception as e:  # noqa: BLE001 - Redis may come up after the router; lookups then fall back
        log.warning("index_namespace %r: cannot read the Redis index at start: %r", config.index_namespace, e)
        return
    missing = [m.name for m in config.models if m.name not in written]
    if missing:
        log.warning("index_namespace %r holds no blocks of %s yet: check that kvrouter indexer runs with the same "
                    "config (its --namespace, if given, must equal index_namespace)", config.index_namespace,
                    ", ".join(missing))
