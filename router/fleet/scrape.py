"""The engines' ``/metrics`` scrape: the queue gauges the load weighs, and the KV-cache capacity the index's caps use.

Every ``Tuning.metrics_scrape_interval_s`` (1 s) each backend's page is read (:func:`scrape_forever`).
The gauges go to its :class:`router.fleet.load.BackendLoad`; the capacity, read off
vLLM's ``vllm:cache_config_info``, goes to :meth:`LoadTracker.took_capacity`, which
hands it to the index (:class:`indexer.index.KeyCaps`). A failed scrape clears the
gauges but keeps the capacity: an engine's cache size does not change without a
restart, and a scrape that cannot tell is no reason to forget it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from router.fleet.load import Capacity

if TYPE_CHECKING:
    from router.fleet.backends import BackendPool
    from router.fleet.load import LoadTracker

log = logging.getLogger(__name__)

SCRAPED_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
CACHE_CONFIG_INFO = "vllm:cache_config_info"
CAPACITY_RETRY_S = 30.0
"""How often a worker that is not the scrape leader asks a backend whose capacity it does not know yet."""
TIER_LABELS = (("GPU", "num_gpu_blocks"), ("CPU", "num_cpu_blocks"))
"""The tiers ``vllm:cache_config_info`` describes, by the label holding their block count.
vLLM sets ``num_cpu_blocks`` only where its engine owns a CPU pool; the offloading
connector's CPU tier is sized by the connector and not reported, so it keeps the
index's default bound."""


def parse_gauges(text: str, names: tuple[str, ...]) -> tuple[dict[str, float], dict[str, int]]:
    """Sum and count of each named sample over its label sets on a ``/metrics`` page.

    Only the lines of interest go to the Prometheus parser: a vLLM ``/metrics`` page is
    mostly histogram buckets, and parsing all of it costs milliseconds of CPU per page.
    """
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(names) or (
        line.startswith("# TYPE ") and line[7:].split(" ", 1)[0] in names
    ))
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(wanted + "\n"):
        for sample in family.samples:
            if sample.name in names:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                counts[sample.name] = counts.get(sample.name, 0) + 1
    return sums, counts


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum of each scraped gauge over its label sets (one per DP engine / model).

    ``kv_cache_usage_perc`` is averaged over its series instead of summed (it is a
    fraction per engine).
    """
    sums, counts = parse_gauges(text, SCRAPED_GAUGES)
    usage = "vllm:kv_cache_usage_perc"
    if usage in sums:
        sums[usage] /= counts[usage]
    return sums


async def scrape_forever(pool: BackendPool, tracker: LoadTracker, interval_s: float) -> None:
    """Every ``interval_s``, read each backend's gauges; a failed scrape clears them
    (stale numbers would keep steering traffic by a picture that is gone).

    Workers of one host scrape once for all: the health leader (worker 0) scrapes and
    appends what it read to the fleet-state log, the others take it from there (an
    engine's page costs the router milliseconds to parse, N times over otherwise), and
    scrape for themselves while the leader is silent. The capacity is not in the log:
    each worker's own index needs it, so a worker reads it off a page of its own, once
    per backend (and every :data:`CAPACITY_RETRY_S` while a backend does not say)."""
    capacity_tried = -CAPACITY_RETRY_S
    while True:
        started = time.monotonic()
        if not pool.leader and not pool.leader_gone():
            if started - capacity_tried >= CAPACITY_RETRY_S:
                capacity_tried = started
                unknown = [name for name, load in tracker.backends.items() if load.scraped_capacity is None]
                await asyncio.gather(*(_scrape_one(pool, tracker, name, capacity_only=True) for name in unknown))
            await asyncio.sleep(interval_s / 4)
            continue
        await asyncio.gather(*(_scrape_one(pool, tracker, name) for name in tracker.backends))
        if pool.workers > 1:
            tracker.publish_scraped()
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def _scrape_one(pool: BackendPool, tracker: LoadTracker, name: str, *, capacity_only: bool = False) -> None:
    load = tracker.backends.get(name)
    backend = pool.backends.get(name)
    if load is None or backend is None:  # removed by a config reload
        return
    status, body = await backend.poll("/metrics", max(0.5, pool.tuning.metrics_scrape_interval_s))
    values: dict[str, float] = {}
    capacity: Capacity = {}
    if status != 200:
        log.debug("metrics scrape of %s failed: %s", name, status)
    else:
        try:
            text = body.decode("utf-8", "replace")
            values = parse_vllm_metrics(text)
            capacity = parse_capacity(text)
        except Exception as e:  # noqa: BLE001 - a page the Prometheus parser rejects only clears the second signal
            log.debug("metrics page of %s unreadable: %r", name, e)
    if capacity and capacity != load.scraped_capacity:
        tracker.took_capacity(name, capacity)
    if capacity_only:
        return
    load.scraped_waiting = values.get("vllm:num_requests_waiting")
    load.scraped_running = values.get("vllm:num_requests_running")
    load.scraped_kv_usage = values.get("vllm:kv_cache_usage_perc")
    load.scraped_at = time.time() if values else None
    # Against every worker's and replica's requests as of now, the moment the page arrived.
    seen = tracker.get(name).in_flight
    load.scraped_unseen = max(0.0, (load.scraped_waiting or 0.0) + (load.scraped_running or 0.0) - seen)


def parse_capacity(text: str) -> Capacity:
    """Each engine's KV-cache capacity in tokens per tier, from ``vllm:cache_config_info``.

    That is an info gauge (always 1) whose labels are the engine's ``CacheConfig``
    (``vllm/v1/metrics/loggers.py``, ``log_metrics_info``): ``num_gpu_blocks``,
    ``num_cpu_blocks``, ``block_size``, ... and ``engine``, the DP rank. Capacity is
    blocks times ``block_size``, in tokens, so that a router hashing in other block sizes
    than the engine's pool can turn it into keys. Keyed by the ``engine`` label ("" when
    absent); a tier whose label is missing or not a positive number (vLLM writes ``None``
    until the engine has profiled its memory) is left out, and so is an engine with none.
    """
    lines = [line for line in text.splitlines() if line.startswith(CACHE_CONFIG_INFO)]
    out: Capacity = {}
    if not lines:
        return out
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            labels = sample.labels
            size = _positive(labels.get("block_size"))
            if sample.name != CACHE_CONFIG_INFO or size is None:
                continue
            tiers = {medium: n * size for medium, label in TIER_LABELS if (n := _positive(labels.get(label)))}
            if tiers:
                out[labels.get("engine", "")] = tiers
    return out


def _positive(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None
