"""The router's Prometheus series (all prefixed ``kvrouter_``).

Per-request series are plain counters and histograms updated on the hot path (label
children are cached by prometheus-client after the first use). Backend load, health
and event-stream state are read at scrape time by :class:`FleetCollector` from the
live objects, so the hot path never updates a gauge.

With ``serve --workers N`` the supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` before any
worker imports prometheus-client, so every counter and histogram lives in a per-process
file there, and ``/metrics`` (:func:`exposition`) sums all workers' files with
prometheus-client's ``MultiProcessCollector``, whichever worker answers the scrape; a
dead worker's counts stay in the sum. The fleet gauges keep coming from
:class:`FleetCollector`, which in a worker reads the *shared* state (load summed over
workers and replicas, the one health verdict per backend), so the answering worker
shows the whole picture: a callback collector is the one kind of gauge multiprocess
mode cannot aggregate, and this one needs no aggregation. The few plain gauges carry a
``multiprocess_mode``. The event subscriber's series are per worker (each follows the
streams) and come from the files too, with a ``pid`` label where they are gauges.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from indexer.index import Worker
    from indexer.subscriber import StreamStats
    from router.background import Background
    from router.backends import BackendPool
    from router.fleet.ring import Ring
    from router.load import LoadTracker

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

REQUESTS = Counter(
    "kvrouter_requests", "Requests proxied, by model, backend, policy and final HTTP status",
    ["model", "backend", "policy", "status"],
)
REJECTED = Counter(
    "kvrouter_rejected_requests", "Requests the router answered itself with an error, by status and code",
    ["status", "code"],
)
DECISIONS = Counter(
    "kvrouter_routing_decisions", "Routing decisions by model, policy and reason (cache_hit, load_guard, no_events, fallback, ...)",
    ["model", "policy", "reason"],
)
RETRIES = Counter(
    "kvrouter_upstream_retries", "Requests re-sent to another backend before the first byte, by the backend that failed and why",
    ["backend", "reason"],
)
UPSTREAM_FAILURES = Counter(
    "kvrouter_upstream_failures", "Upstream failures by backend and kind (connect, timeout, reset, status_5xx)",
    ["backend", "kind"],
)
CLIENT_DISCONNECTS = Counter(
    "kvrouter_client_disconnects", "Streams cancelled because the client went away (upstream cancelled)", ["backend"],
)
PREDICTED_HIT_RATIO = Histogram(
    "kvrouter_predicted_hit_ratio", "predicted_cached_tokens / prompt tokens on the chosen backend",
    ["model"], buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
)
MATCHED_BLOCKS = Histogram(
    "kvrouter_matched_blocks", "Leading blocks the index held on the chosen backend", ["model"], buckets=_BLOCK_BUCKETS,
)
ZERO_BLOCK_REQUESTS = Counter(
    "kvrouter_zero_block_requests",
    "Requests with at least one full block that matched nothing on any backend (a silent-degradation alarm "
    "when it approaches the request rate: wrong seed/algo/block size or dead event streams)",
    ["model"],
)
TOKENIZE_SECONDS = Histogram("kvrouter_tokenize_seconds", "Prompt tokenization time", ["model"], buckets=LATENCY_BUCKETS)
HASH_SECONDS = Histogram("kvrouter_hash_seconds", "Block hashing time", ["model"], buckets=LATENCY_BUCKETS)
LOOKUP_SECONDS = Histogram("kvrouter_lookup_seconds", "Index lookup time", ["model"], buckets=LATENCY_BUCKETS)
OVERHEAD_SECONDS = Histogram(
    "kvrouter_overhead_seconds", "Router time from request body received to upstream request sent", ["model"],
    buckets=LATENCY_BUCKETS,
)
BODY_SECONDS = Histogram(
    "kvrouter_request_body_seconds",
    "Time from request headers to the whole body received: the client's upload, kept out of the overhead",
    buckets=LATENCY_BUCKETS,
)
TOKENIZER_FALLBACKS = Counter(
    "kvrouter_tokenizer_fallbacks", "Requests tokenized remotely because local tokenization was unavailable or switched off",
    ["model", "reason"],
)

COLD_PATH = Counter(
    "kvrouter_cold_path",
    "Long single-text prompts by what was tokenized before routing: history (a chat whose messages "
    "start with a remembered history, sent on its keys before rendering), deferred (a cold prompt sent on "
    "its first block), tail (a seen history sent on its cached ids, the new turn tokenized after), "
    "seen (the segment cache holds all of it, or too little for a block: full path, inline), known "
    "(block 0 held, recently routed or being tokenized: full path), busy (the background thread is "
    "behind: full path), ineligible (length bound, probe found no whole block), disabled (tokenizer "
    "not byte-level or a probe mismatch)",
    ["model", "outcome"],
)


DRAIN_IN_FLIGHT = Gauge(
    "kvrouter_drain_in_flight_requests",
    "Requests in flight when the router began draining (SIGTERM); 0 before any drain",
    multiprocess_mode="livesum",
)
DRAIN_CUT = Counter(
    "kvrouter_drain_cut_requests",
    "Requests still running at the drain deadline (router.drain_timeout_s), ended with a shutting_down error",
)
CONFIG_RELOADS = Counter(
    "kvrouter_config_reloads",
    "Config reloads (SIGHUP, or a changed file under --reload-config) by outcome: applied, unchanged, "
    "invalid (the file did not load or validate), not_live (it changes what only a restart can: "
    "models, tokenizers, router settings, index), busy (a removed backend is still draining), failed (an unexpected error: see the log)",
    ["outcome"],
)


FLEET_LOG_FAILURES = Counter(
    "kvrouter_fleet_log_failures",
    "Fleet-state log operations between replicas that failed, by what (append, read, order: Redis down or "
    "slow; decode: an entry that is not a batch of records)",
    ["what"],
)
FLEET_LOG_DELAY = Histogram(
    "kvrouter_fleet_log_delay_seconds",
    "Age of another replica's fleet-state entry when this process folds it: how late it learns what the "
    "others just routed",
    buckets=LATENCY_BUCKETS,
)
SEQUENCED = Counter(
    "kvrouter_sequenced_decisions",
    "Decisions committed in the replicas' shared order, by outcome: first (no other replica committed "
    "meanwhile), again (decided again after others' commits, same backend), moved (decided again, another "
    "backend), failed (Redis down or slow: sent as decided alone)",
    ["outcome"],
)
SEQUENCE_SECONDS = Histogram(
    "kvrouter_sequence_seconds",
    "Time a decision spent in the replicas' shared order, by stage: wait (for this process's "
    "earlier commits) and commit (its own tries, decisions made again included)",
    ["stage"], buckets=LATENCY_BUCKETS,
)
HEALTH_LEADER_GONE = Counter(
    "kvrouter_health_leader_gone",
    "Times a worker of serve --workers found the health leader (worker 0) silent and began checking backends itself",
)


_CHILDREN: dict[tuple[int, tuple[str, ...]], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, memoised: the hot path calls this several times per
    request and prometheus-client's ``labels`` validates and locks on every call."""
    key = (id(metric), labels)
    c = _CHILDREN.get(key)
    if c is None:
        c = _CHILDREN[key] = metric.labels(*labels)
    return c


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

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
        if self.stream_registry is not None and not multiprocess():
            # The subscriber's counters (gaps, replays, connected, rehash mode, ...).
            yield from self.stream_registry.collect()


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


STREAM_STATS_TTL_S = 0.5


class StreamView:
    """The KV-event subscriber's per-worker stats as the request path and ``/debug`` read
    them: re-read at most every :data:`STREAM_STATS_TTL_S` (each request asks whether its
    model's streams are connected; the subscriber's stats take its lock)."""

    def __init__(self) -> None:
        self.subscriber: Any = None
        self._stats: dict[Any, Any] = {}
        self._at = 0.0

    def stats(self) -> dict[Worker, StreamStats]:
        if self.subscriber is None:
            return {}
        now = time.monotonic()
        if now - self._at > STREAM_STATS_TTL_S:
            self._stats = self.subscriber.stats()
            self._at = now
        return self._stats

    def connected(self, backends: list[str]) -> bool:
        """Whether any of ``backends`` has a connected event stream."""
        return any(st.connected for w, st in self.stats().items() if w.backend in backends)


_FLEET: list[FleetCollector] = []


def register_fleet(collector: FleetCollector) -> Callable[[], None]:
    """Register ``collector`` on the default registry; returns the function that removes it.

    A second router in the same process (tests) keeps the first one's fleet series."""
    try:
        REGISTRY.register(collector)
    except ValueError:
        return lambda: None
    _FLEET.append(collector)

    def unregister() -> None:
        REGISTRY.unregister(collector)
        _FLEET.remove(collector)

    return unregister


def multiprocess() -> bool:
    """Whether this process writes its series to ``PROMETHEUS_MULTIPROC_DIR`` (a worker)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class _Fleet(Collector):
    def collect(self) -> Iterator[Any]:
        for c in _FLEET:
            yield from c.collect()


async def exposition() -> bytes:
    """The ``/metrics`` page: this process's registry, or with workers every worker's
    series summed (see the module docstring). A worker writes its updates to its file in
    batches (:mod:`router.metric_values`): this one flushes its own, then waits out one
    flush period of the others, so the page holds everything counted before it was asked."""
    if not multiprocess():
        return generate_latest(REGISTRY)
    from prometheus_client import multiprocess as mp

    from router import metric_values

    metric_values.flush()
    await asyncio.sleep(2 * metric_values.FLUSH_S)
    registry = CollectorRegistry()
    mp.MultiProcessCollector(registry)
    registry.register(_Fleet())
    return generate_latest(registry)
