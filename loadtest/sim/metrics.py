"""The ``vllm:*`` Prometheus metrics of one simulated engine (names as in vLLM v1).

Each engine has its own registry (K engines share a process), labels ``model_name`` and
``engine`` like vLLM. Latency histograms are in *engine* seconds (the modelled clock),
so they read the same whatever ``--speedup`` compresses wall time by. Buckets are
vLLM's. ``kvrouter_sim:clock_lag_seconds`` is the simulator's own: how far the
engine's modelled clock fell behind wall time (it should stay near 0).

``vllm:cache_config_info`` is vLLM's info gauge (always 1) whose labels are the engine's
``CacheConfig``: ``num_gpu_blocks`` and ``block_size`` are what a router reads of the
engine's KV-cache capacity. ``num_cpu_blocks`` is ``None``, as vLLM reports it when the
CPU tier is the offloading connector's (the simulator's only kind).

With a CPU offload tier (``--cpu-offload-blocks``) the engine also exports vLLM's
connector counters ``vllm:external_prefix_cache_queries`` (prompt tokens of every
admitted request) and ``vllm:external_prefix_cache_hits`` (tokens loaded from the
CPU tier; ``vllm:prefix_cache_hits`` stays the GPU's own, as in vLLM), and the
simulator's ``kvrouter_sim:cpu_offload_usage_perc`` (CPU tier blocks held / size).
Without a tier they are not registered, as vLLM registers no connector metrics
without a connector.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, engine)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*labels, "finished_reason"], registry=r,
        )
        self._values = values
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time spent in WAITING phase for request.", _E2E_BUCKETS)
        self.clock_lag = gauge("kvrouter_sim:clock_lag_seconds", "Modelled clock behind wall time (engine seconds).")
        self.state_seconds = hist("kvrouter_sim:debug_state_seconds",
                                  "Wall seconds answering the oracle's side channel (POST /debug/state, --debug-state).",
                                  (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
        self.state_unknown_ahead = counter("kvrouter_sim:debug_state_unknown_ahead_total",
                                           "In-transit prompts a side-channel question named by an id this process "
                                           "no longer remembers (skipped).")

    def enable_offload(self, cpu_usage: Callable[[], float]) -> None:
        r, labels, values = self.registry, ["model_name", "engine"], self._values
        self.external_queries = Counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries, in terms of number of queried tokens.",
            labels, registry=r,
        ).labels(*values)
        self.external_hits = Counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits, in terms of number of cached tokens.",
            labels, registry=r,
        ).labels(*values)
        Gauge(
            "kvrouter_sim:cpu_offload_usage_perc", "CPU offload tier usage. 1 means 100 percent usage.", labels, registry=r,
        ).labels(*values).set_function(cpu_usage)

    def cache_config(self, num_blocks: int, block_size: int, hash_algo: str) -> None:
        """``vllm:cache_config_info`` as vLLM's ``PrometheusStatLogger.log_metrics_info`` sets it
        (no ``model_name`` label; the labels are ``CacheConfig``'s fields, the ones shown here,
        then ``engine``)."""
        info = {
            "block_size": str(block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(num_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": hash_algo,
            "engine": self._values[1],
        }
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=self.registry).labels(**info).set(1)

    def bind(self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float]) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)

    def request_success(self, finished_reason: str) -> None:
        self._success.labels(*self._values, finished_reason).inc()
