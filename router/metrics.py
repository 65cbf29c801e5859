"""The router's Prometheus series (all prefixed ``kvrouter_``).

Per-request series are plain counters and histograms updated on the hot path, through
memoised label children (:meth:`RouterMetrics.child`). They belong to one
:class:`RouterMetrics` per process (:func:`process_metrics`); the module-level names
(``REQUESTS``, ``child``, ...) are that object's, for the modules that do not take it yet.
Backend load, health and event-stream state are read at scrape time by
:class:`router.fleet.gauges.FleetCollector` from the live objects, so the hot path never updates a gauge.

With ``serve --workers N`` every worker counts in its own memory and ``/metrics``
(:func:`exposition`) merges every worker's series, whichever worker answers the scrape
(:mod:`router.http.worker_metrics`): counters and histograms summed, a dead worker's counts
kept; gauges as :data:`GAUGE_MERGE` says. The fleet gauges keep coming from
:class:`router.fleet.gauges.FleetCollector` alone, which in a worker reads the *shared* state (load summed
over workers and replicas, the one health verdict per backend), so the answering worker
shows the whole picture without merging anything. The event subscriber's series are per
worker (each follows the streams) and are merged too, with a ``pid`` label where they are
gauges.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from router.http.worker_metrics import GaugeMerge, WorkerSeries


class LiveSeries(Protocol):
    """Series read from live objects at scrape time (:class:`router.fleet.gauges.FleetCollector`)."""

    stream_registry: CollectorRegistry | None

    def collect(self) -> Iterator[Metric]: ...

    def gauges(self) -> Iterator[Metric]: ...

if TYPE_CHECKING:
    from indexer.index import Worker
    from indexer.subscriber import StreamStats

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
REQUEST_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Client-facing latencies: TTFT targets from a few tens of milliseconds to long prompts queued."""
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

GAUGE_MERGE: dict[str, GaugeMerge] = {
    "kvrouter_drain_in_flight_requests": operator.add,
    "kvrouter_queue_depth": operator.add,  # router/admission.py: each worker queues its own
    "kvrouter_tokenizer_segment_cache_tokens": operator.add,  # router/prompt/segments.py
    "kvrouter_hash_cache_blocks": operator.add,  # router/prompt/hash_cache.py
    "kvrouter_discovery_backends": max,  # router/fleet/discovery.py: every worker looks up alike
    "kvrouter_tokenizer_remote": max,  # router/prompt/remote_tokenize.py: 1 when any worker switched
}
"""How ``serve --workers N`` merges the live workers' values of a gauge; a gauge not named
here is shown per worker, with a ``pid`` label (the event streams' ``connected``)."""
SERIES_PREFIX = "kvrouter_"
"""A worker shares the families named so: the router's own, not the Python process's."""


class RouterMetrics:
    """The router's own series and their memoised label children, and how this process
    exposes them: one per process (:func:`process_metrics`), on ``registry``.

    Alone, ``/metrics`` is ``registry``'s page. A worker of ``serve --workers N``
    (:meth:`publish`) also writes snapshots of its series for the other workers and
    answers ``/metrics`` with every worker's merged (:mod:`router.http.worker_metrics`)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.requests = Counter(
            "kvrouter_requests", "Requests proxied, by model, backend, policy and final HTTP status",
            ["model", "backend", "policy", "status"],
            registry=registry,
        )
        self.rejected = Counter(
            "kvrouter_rejected_requests", "Requests the router answered itself with an error, by status and code",
            ["status", "code"],
            registry=registry,
        )
        self.decisions = Counter(
            "kvrouter_routing_decisions", "Routing decisions by model, policy and reason (cache_hit, load_balance, no_events, fallback, ...)",
            ["model", "policy", "reason"],
            registry=registry,
        )
        self.passthrough_decisions = Counter(
            "kvrouter_passthrough_decisions",
            "Tries of requests routed without a prompt to hash (/v1/responses, /v1/messages, /v1/embeddings, /tokenize, "
            "/detokenize), by model, endpoint and reason: least_loaded; response_engine (a /v1/responses follow-up, "
            "retrieve or cancel sent to the engine that made the response it names); response_unknown or "
            "response_engine_down (that engine is not remembered by this process, or not routable: least loaded first, "
            "then each engine in turn while they answer 404); fallback (a later try, after a failure or such a 404)",
            ["model", "endpoint", "reason"],
            registry=registry,
        )
        self.retries = Counter(
            "kvrouter_upstream_retries", "Requests re-sent to another backend before the first byte, by the backend that failed and why",
            ["backend", "reason"],
            registry=registry,
        )
        self.upstream_failures = Counter(
            "kvrouter_upstream_failures", "Upstream failures by backend and kind (connect, timeout, reset, status_5xx)",
            ["backend", "kind"],
            registry=registry,
        )
        self.client_disconnects = Counter(
            "kvrouter_client_disconnects", "Streams cancelled because the client went away (upstream cancelled)", ["backend"],
            registry=registry,
        )
        self.predicted_hit_ratio = Histogram(
            "kvrouter_predicted_hit_ratio", "predicted_cached_tokens / prompt tokens on the chosen backend",
            ["model"], buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
            registry=registry,
        )
        self.matched_blocks = Histogram(
            "kvrouter_matched_blocks", "Leading blocks the index held on the chosen backend", ["model"], buckets=_BLOCK_BUCKETS,
            registry=registry,
        )
        self.zero_block_requests = Counter(
            "kvrouter_zero_block_requests",
            "Requests with at least one full block that matched nothing on any backend (a silent-degradation alarm "
            "when it approaches the request rate: wrong seed/algo/block size or dead event streams)",
            ["model"],
            registry=registry,
        )
        self.tokenize_seconds = Histogram("kvrouter_tokenize_seconds", "Prompt tokenization time", ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.hash_seconds = Histogram("kvrouter_hash_seconds", "Block hashing time", ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.lookup_seconds = Histogram("kvrouter_lookup_seconds", "Index lookup time", ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.overhead_seconds = Histogram(
            "kvrouter_overhead_seconds", "Router time from request body received to upstream request sent", ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.body_seconds = Histogram(
            "kvrouter_request_body_seconds",
            "Time from request headers to the whole body received: the client's upload, kept out of the overhead",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokenizer_fallbacks = Counter(
            "kvrouter_tokenizer_fallbacks", "Requests tokenized remotely because local tokenization was unavailable or switched off",
            ["model", "reason"],
            registry=registry,
        )
        self.cold_path = Counter(
            "kvrouter_cold_path",
            "Long single-text prompts by what was tokenized before routing: history (a chat whose messages "
            "start with a remembered history, sent on its keys before rendering), deferred (a cold prompt sent on "
            "its first block), tail (a seen history sent on its cached ids, the new turn tokenized after), "
            "seen (the segment cache holds all of it, or too little for a block: full path, inline), known "
            "(block 0 held, recently routed or being tokenized: full path), busy (the background thread is "
            "behind: full path), ineligible (length bound, probe found no whole block), disabled (tokenizer "
            "not byte-level or a probe mismatch)",
            ["model", "outcome"],
            registry=registry,
        )
        self.drain_in_flight = Gauge(
            "kvrouter_drain_in_flight_requests",
            "Requests in flight when the router began draining (SIGTERM); 0 before any drain",
            registry=registry,
        )
        self.drain_cut = Counter(
            "kvrouter_drain_cut_requests",
            "Requests still running at the drain deadline (router.drain_timeout_s), ended with a shutting_down error",
            registry=registry,
        )
        self.config_reloads = Counter(
            "kvrouter_config_reloads",
            "Config reloads (SIGHUP, or a changed file under --reload-config) by outcome: applied, unchanged, "
            "invalid (the file did not load or validate), not_live (it changes what only a restart can: "
            "models, tokenizers, router settings, index), busy (a removed backend is still draining), failed (an unexpected error: see the log)",
            ["outcome"],
            registry=registry,
        )
        self.discovery_lookups = Counter(
            "kvrouter_discovery_lookups",
            "DNS lookups of models[].discovery by model and outcome: ok, error (timeout, SERVFAIL, refused: "
            "the last set is kept), empty (no address: the last set is kept)",
            ["model", "outcome"],
            registry=registry,
        )
        self.discovery_backends = Gauge(
            "kvrouter_discovery_backends",
            "Backends models[].discovery found and the router took, by model",
            ["model"],
            registry=registry,
        )
        self.fleet_log_failures = Counter(
            "kvrouter_fleet_log_failures",
            "Fleet-state log operations between replicas that failed, by what (append, read, order: Redis down or "
            "slow; decode: an entry that is not a batch of records)",
            ["what"],
            registry=registry,
        )
        self.fleet_log_delay = Histogram(
            "kvrouter_fleet_log_delay_seconds",
            "Age of another replica's fleet-state entry when this process folds it: how late it learns what the "
            "others just routed",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.sequenced = Counter(
            "kvrouter_sequenced_decisions",
            "Decisions committed in the replicas' shared order, by outcome: first (no other replica committed "
            "meanwhile), again (decided again after others' commits, same backend), moved (decided again, another "
            "backend), failed (Redis down or slow: sent as decided alone)",
            ["outcome"],
            registry=registry,
        )
        self.sequence_seconds = Histogram(
            "kvrouter_sequence_seconds",
            "Time a decision spent in the replicas' shared order, by stage: wait (for this process's "
            "earlier commits) and commit (its own tries, decisions made again included)",
            ["stage"], buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.health_leader_gone = Counter(
            "kvrouter_health_leader_gone",
            "Times a worker of serve --workers found the health leader (worker 0) silent and began checking backends itself",
            registry=registry,
        )
        self.health_checks_discounted = Counter(
            "kvrouter_health_checks_discounted",
            "Health checks that timed out while the router's own event loop was stalled (their timer fired "
            "far past its deadline), so did not count against the backend: each was made again at once",
            ["backend"],
            registry=registry,
        )
        self.connections_refused = Counter(
            "kvrouter_connections_refused",
            "Client connections the router closed itself, by reason: limit (every connection serving a request), "
            "evicted (the oldest without a request under way, for a new one), header_timeout, body_timeout "
            "(a client silent too long), head_too_large (431)",
            ["reason"],
            registry=registry,
        )
        self.breaker_verifications = Counter(
            "kvrouter_breaker_verifications",
            "Failure streaks that reached the breaker_failures tuning knob with failures the engine answered itself "
            "(5xx, a stream without [DONE]), by the outcome of the router's own request to it: request_caused "
            "(it served that one: the circuit stays closed) or backend_failing (the circuit opens)",
            ["backend", "outcome"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "kvrouter_queue_depth", "Requests waiting in the router's admission queue, by model (router.queue_busy_tokens)",
            ["model"], registry=registry,
        )
        self.queue_wait = Histogram(
            "kvrouter_queue_wait_seconds", "Time a request waited in the router's admission queue before it was let through",
            ["model"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=registry,
        )
        self.queue_outcomes = Counter(
            "kvrouter_queue_outcomes",
            "Requests that waited in the router's admission queue, by outcome: dispatched (let through when a backend "
            "stopped being busy), full (429 at once: queue_max_waiting reached), timeout (429 after queue_timeout_s), "
            "cancelled (the client went away while waiting)",
            ["model", "outcome"], registry=registry,
        )
        self.queue_heavy_held = Counter(
            "kvrouter_queue_heavy_held",
            "Requests of a tenant over twice its fair share of the model's recent arrivals that waited for headroom "
            "(a backend with nothing queued, or its uncached tokens fitting under queue_heavy_fraction of the busy "
            "threshold) when another tenant's would have gone at once",
            ["model"], registry=registry,
        )
        self.queue_heavy_yielded = Counter(
            "kvrouter_queue_heavy_yielded",
            "Requests of a heavy tenant held (see kvrouter_queue_heavy_held) because a backend outside its own share "
            "of the backends had more than the headroom queued for prefill: it gives way to the other tenants",
            ["model"], registry=registry,
        )
        self.queue_heavy_confined = Counter(
            "kvrouter_queue_heavy_confined",
            "Decisions for a heavy tenant's request made among the backends with room for it only "
            "(see kvrouter_queue_heavy_held): the others were left out",
            ["model"], registry=registry,
        )
        self.request_ttft = Histogram(
            "kvrouter_request_ttft_seconds",
            "Client time to first token, measured at the router: request received to the first stream chunk carrying "
            "output, by model and backend (streams only)",
            ["model", "backend"], buckets=REQUEST_BUCKETS, registry=registry,
        )
        self.request_e2e = Histogram(
            "kvrouter_request_duration_seconds",
            "Request received to the answer's last byte sent, measured at the router, by model and backend",
            ["model", "backend"], buckets=REQUEST_BUCKETS, registry=registry,
        )
        self.tokens = Counter(
            "kvrouter_tokens",
            "Tokens the engines reported in usage, by model, backend and kind (prompt, completion, cached: the "
            "prompt tokens served from the engine's prefix cache)",
            ["model", "backend", "kind"], registry=registry,
        )
        self.cache_predictions = Counter(
            "kvrouter_cache_predictions",
            "Requests whose cached tokens the router predicted and the engine reported, by backend and outcome: exact, "
            "under (the engine had more cached than predicted), over (less)",
            ["backend", "outcome"], registry=registry,
        )
        self.cache_prediction_error = Histogram(
            "kvrouter_cache_prediction_error_tokens",
            "|reported - predicted| cached tokens per request, by backend",
            ["backend"], buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=registry,
        )
        self.cache_agreement = Gauge(
            "kvrouter_cache_prediction_agreement",
            "Running share of requests whose predicted cached tokens equal the engine's reported ones, by backend "
            "(about the last 50 requests of this process)",
            ["backend"], registry=registry,
        )
        self.tenant_requests = Counter(
            "kvrouter_tenant_requests",
            "Requests of each tenant (router.tenants; anonymous: router.api_key's clients) by outcome: admitted, "
            "or refused with 429 by its requests_per_s or prompt_tokens_per_min limit",
            ["tenant", "outcome"], registry=registry,
        )
        self.tenant_prompt_tokens = Counter(
            "kvrouter_tenant_prompt_tokens",
            "Prompt tokens of each tenant's answered requests, by kind: reused (the engine's "
            "usage.prompt_tokens_details.cached_tokens) or recomputed (the rest)",
            ["tenant", "kind"], registry=registry,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._fleet: list[LiveSeries] = []
        self.workers: WorkerSeries | None = None

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, memoised: the hot path calls this several times per
        request and prometheus-client's ``labels`` validates and locks on every call."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def register_fleet(self, collector: LiveSeries) -> Callable[[], None]:
        """Expose ``collector`` on ``/metrics``; returns the function that removes it.

        A second router in the same process (tests) keeps the first one's fleet series."""
        if self.workers is None:
            try:
                self.registry.register(collector)
            except ValueError:
                return lambda: None
        self._fleet.append(collector)

        def unregister() -> None:
            if self.workers is None:
                self.registry.unregister(collector)
            self._fleet.remove(collector)

        return unregister

    def publish(self, directory: Path) -> None:
        """Make this process a worker of ``serve --workers N`` that shares its series
        through ``directory`` (the supervisor's, one for all workers). Call it before any
        router registers its fleet collector."""
        self.workers = WorkerSeries(directory, self._shared_series, GAUGE_MERGE)

    def _shared_series(self) -> Iterator[Metric]:
        """What a worker shares: the router's families (the default registry holds those of
        the tokenizer's and index's modules too) and each router's event-stream series."""
        for m in self.registry.collect():
            if m.name.startswith(SERIES_PREFIX):
                yield m
        for fleet in list(self._fleet):
            if fleet.stream_registry is not None:
                yield from fleet.stream_registry.collect()

    async def exposition(self) -> bytes:
        """The ``/metrics`` page: ``registry``'s, or in a worker every worker's series merged
        and this process's fleet gauges (see the module docstring)."""
        if self.workers is None:
            return generate_latest(self.registry)
        merged = [*await self.workers.merged(), *(m for c in self._fleet for m in c.gauges())]
        return generate_latest(_Listed(merged))


class _Listed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


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


_PROCESS = RouterMetrics()


def process_metrics() -> RouterMetrics:
    """This process's one :class:`RouterMetrics`."""
    return _PROCESS


child = _PROCESS.child
register_fleet = _PROCESS.register_fleet
exposition = _PROCESS.exposition

# The families by the names the modules that are not handed the object yet record through.
REQUESTS = _PROCESS.requests
REJECTED = _PROCESS.rejected
DECISIONS = _PROCESS.decisions
PASSTHROUGH_DECISIONS = _PROCESS.passthrough_decisions
RETRIES = _PROCESS.retries
UPSTREAM_FAILURES = _PROCESS.upstream_failures
CLIENT_DISCONNECTS = _PROCESS.client_disconnects
PREDICTED_HIT_RATIO = _PROCESS.predicted_hit_ratio
MATCHED_BLOCKS = _PROCESS.matched_blocks
ZERO_BLOCK_REQUESTS = _PROCESS.zero_block_requests
TOKENIZE_SECONDS = _PROCESS.tokenize_seconds
HASH_SECONDS = _PROCESS.hash_seconds
LOOKUP_SECONDS = _PROCESS.lookup_seconds
OVERHEAD_SECONDS = _PROCESS.overhead_seconds
BODY_SECONDS = _PROCESS.body_seconds
TOKENIZER_FALLBACKS = _PROCESS.tokenizer_fallbacks
COLD_PATH = _PROCESS.cold_path
DRAIN_IN_FLIGHT = _PROCESS.drain_in_flight
DRAIN_CUT = _PROCESS.drain_cut
CONFIG_RELOADS = _PROCESS.config_reloads
DISCOVERY_LOOKUPS = _PROCESS.discovery_lookups
DISCOVERY_BACKENDS = _PROCESS.discovery_backends
FLEET_LOG_FAILURES = _PROCESS.fleet_log_failures
FLEET_LOG_DELAY = _PROCESS.fleet_log_delay
SEQUENCED = _PROCESS.sequenced
SEQUENCE_SECONDS = _PROCESS.sequence_seconds
HEALTH_LEADER_GONE = _PROCESS.health_leader_gone
HEALTH_CHECKS_DISCOUNTED = _PROCESS.health_checks_discounted
BREAKER_VERIFICATIONS = _PROCESS.breaker_verifications
CONNECTIONS_REFUSED = _PROCESS.connections_refused
QUEUE_DEPTH = _PROCESS.queue_depth
QUEUE_WAIT = _PROCESS.queue_wait
QUEUE_OUTCOMES = _PROCESS.queue_outcomes
QUEUE_HEAVY_HELD = _PROCESS.queue_heavy_held
QUEUE_HEAVY_CONFINED = _PROCESS.queue_heavy_confined
QUEUE_HEAVY_YIELDED = _PROCESS.queue_heavy_yielded
REQUEST_TTFT = _PROCESS.request_ttft
REQUEST_E2E = _PROCESS.request_e2e
TOKENS = _PROCESS.tokens
CACHE_PREDICTIONS = _PROCESS.cache_predictions
CACHE_PREDICTION_ERROR = _PROCESS.cache_prediction_error
CACHE_AGREEMENT = _PROCESS.cache_agreement
TENANT_REQUESTS = _PROCESS.tenant_requests
TENANT_PROMPT_TOKENS = _PROCESS.tenant_prompt_tokens
