"""The backends' load, health and event-stream gauges, read from live state at scrape time.

The hot path never updates a gauge: :class:`FleetCollector` reads the pool, the load
tracker and the subscriber's stats when ``/metrics`` is asked (:mod:`router.metrics`
registers it), so what a scrape shows is what the router holds at that moment. In a worker
the load is the whole router's (the fleet-state log's fold), so the answering worker shows
the whole picture.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from indexer.index import Worker
    from indexer.subscriber import StreamStats
    from router.background import Background
    from router.fleet.backends import BackendPool
    from router.fleet.ring import Ring
    from router.fleet.load import LoadTracker


class FleetCollector(Collector):
    """Backend load, health and event-stream gauges, read from live state at scrape time."""

    def __init__(
        self,
        pool: BackendPool,
        loads: LoadTracker,
        stream_stats: Callable[[], dict[Worker, StreamStats]],
        stream_registry: CollectorRegistry | None = None,
        background: Background | None = None,
        ring: Ring | None = None,
    ) -> None:
        self.ring = ring
        self.pool = pool
        self.loads = loads
        self.stream_stats = stream_stats
        self.stream_registry = stream_registry
        self.background = background

    def collect(self) -> Iterator[Metric]:
        yield from self.gauges()
        if self.stream_registry is not None:
            # The subscriber's counters (gaps, replays, connected, rehash mode, ...).
            yield from self.stream_registry.collect()

    def gauges(self) -> Iterator[Metric]:
        """The fleet's series without the event subscriber's (a worker merges those with
        the other workers')."""
        fams = {
            "healthy": GaugeMetricFamily("kvrouter_backend_healthy", "1 when the backend is routable", labels=["backend"]),
            "circuit": GaugeMetricFamily("kvrouter_backend_circuit_open", "1 while the circuit breaker is open", labels=["backend"]),
            "ejections": GaugeMetricFamily("kvrouter_backend_ejections", "Times the backend was ejected", labels=["backend"]),
            "in_flight": GaugeMetricFamily("kvrouter_backend_in_flight_requests", "Requests in flight from this router", labels=["backend"]),
            "prefill": GaugeMetricFamily("kvrouter_backend_prefill_tokens", "Uncached prompt tokens awaiting their first token", labels=["backend"]),
            "decode": GaugeMetricFamily("kvrouter_backend_decode_sequences", "Sequences past their first token", labels=["backend"]),
            "blocks": GaugeMetricFamily("kvrouter_backend_active_blocks", "Unique KV blocks of in-flight requests", labels=["backend"]),
            "waiting": GaugeMetricFamily("kvrouter_backend_scraped_waiting", "vllm:num_requests_waiting as last scraped", labels=["backend"]),
            "running": GaugeMetricFamily("kvrouter_backend_scraped_running", "vllm:num_requests_running as last scraped", labels=["backend"]),
            "usage": GaugeMetricFamily("kvrouter_backend_scraped_kv_cache_usage", "vllm:kv_cache_usage_perc as last scraped", labels=["backend"]),
            "unseen": GaugeMetricFamily("kvrouter_backend_scraped_unseen_requests",
                                        "Requests the last scrape saw on the engine beyond this router's own (other clients)", labels=["backend"]),
        }
        for name, b in self.pool.backends.items():
            fams["healthy"].add_metric([name], 1.0 if b.routable else 0.0)
            fams["circuit"].add_metric([name], 1.0 if b.circuit_open else 0.0)
            fams["ejections"].add_metric([name], float(b.ejections))
            load = self.loads.get(name)
            fams["in_flight"].add_metric([name], float(load.in_flight))
            fams["prefill"].add_metric([name], float(load.prefill_tokens))
            fams["decode"].add_metric([name], float(load.decode_seqs))
            fams["blocks"].add_metric([name], float(load.active_blocks))
            fams["unseen"].add_metric([name], load.scraped_unseen)
            for key, value in (("waiting", load.scraped_waiting), ("running", load.scraped_running), ("usage", load.scraped_kv_usage)):
                if value is not None:
                    fams[key].add_metric([name], value)
        yield from fams.values()
        labels = ["backend", "dp_rank"]
        last_seq = GaugeMetricFamily("kvrouter_event_stream_last_seq", "Last event batch seq applied (-1: none yet)", labels=labels)
        blocks = GaugeMetricFamily("kvrouter_event_stream_blocks", "Blocks stored by the stream's events", labels=labels)
        for worker, st in self.stream_stats().items():
            lv = [worker.backend, str(worker.dp_rank)]
            last_seq.add_metric(lv, float(st.last_seq if st.last_seq is not None else -1))
            blocks.add_metric(lv, float(st.blocks))
        yield last_seq
        yield blocks
        yield from self._runtime()
        if self.ring is not None:
            yield GaugeMetricFamily("kvrouter_workers", "Router worker processes (serve --workers)", value=float(self.ring.n_workers))
            yield CounterMetricFamily("kvrouter_worker_restarts", "Worker processes the supervisor restarted after they died",
                                      value=float(self.ring.restarts))

    def _runtime(self) -> Iterator[GaugeMetricFamily]:
        """Counts that must stay flat over a long run (``kvrouter chaos --soak`` samples them):
        background jobs and tasks, and the event loop's tasks (scraped on the loop's thread)."""
        if self.background is not None:
            yield GaugeMetricFamily("kvrouter_background_jobs", "Jobs queued or running on the background thread",
                                    value=float(self.background.queued))
            yield GaugeMetricFamily("kvrouter_background_tasks", "Tasks waiting on background work",
                                    value=float(self.background.tasks))
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped off the event loop (a test's registry): no loop to count
            return
        yield GaugeMetricFamily("kvrouter_asyncio_tasks", "Tasks alive on the router's event loop", value=float(tasks))


