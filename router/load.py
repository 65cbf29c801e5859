"""Per-backend load: what the router itself has in flight, plus each engine's scraped gauges.

The router's own counters are exact and instant (a burst is visible before any engine
reports it); the scraped ``/metrics`` gauges see traffic from other routers and the
engine's real queue. Policies read both through :meth:`BackendLoad.snapshot`.

Invariant: every :class:`Ticket` is released exactly once, whatever path the request
took (success, upstream error, timeout, client disconnect, retry on another backend),
so the counters return to zero when the router is idle. ``release`` is idempotent and
the proxy calls it from ``finally`` blocks; tests hammer every path and check zero.

KV blocks in use are counted as *unique* block keys over the backend's active
requests (a refcount per key), like Dynamo's active-sequence tracker: 200 requests
sharing a 4k-token prefix hold that prefix once, so a cache-affine burst does not look
200 times heavier than it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from router.backends import BackendPool

log = logging.getLogger(__name__)

SCRAPED_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


class BackendLoad:
    """Load of one backend. Mutated only on the event loop (no locks needed)."""

    __slots__ = (
        "name",
        "in_flight",
        "prefill_tokens",
        "decode_seqs",
        "block_refs",
        "context_blocks",
        "scraped_waiting",
        "scraped_running",
        "scraped_kv_usage",
        "scraped_at",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.in_flight = 0
        self.prefill_tokens = 0
        self.decode_seqs = 0
        self.block_refs: dict[int, int] = {}
        self.context_blocks = 0
        """Prompt blocks summed over in-flight requests, shared prefixes counted once per
        request: what decode attention reads each step (``block_refs`` is what memory holds)."""
        self.scraped_waiting: float | None = None
        self.scraped_running: float | None = None
        self.scraped_kv_usage: float | None = None
        self.scraped_at: float | None = None

    @property
    def active_blocks(self) -> int:
        return len(self.block_refs)

    def effective_in_flight(self) -> float:
        """Requests on the engine: the router's own count, or the engine's if it sees more
        (other routers, or a queue the router cannot see)."""
        scraped = (self.scraped_waiting or 0.0) + (self.scraped_running or 0.0)
        return max(float(self.in_flight), scraped)

    def snapshot(self) -> dict[str, float | int | None]:
        return {
            "in_flight": self.in_flight,
            "prefill_tokens": self.prefill_tokens,
            "decode_seqs": self.decode_seqs,
            "active_blocks": len(self.block_refs),
            "context_blocks": self.context_blocks,
            "scraped_waiting": self.scraped_waiting,
            "scraped_running": self.scraped_running,
            "scraped_kv_cache_usage": self.scraped_kv_usage,
        }


class Ticket:
    """One request's share of a backend's load, from routing until the response ends.

    ``prefill`` are the tokens the engine must compute before the first token (the
    uncached part of the prompt); they move out of ``prefill_tokens`` at the first
    streamed byte, and the request then counts as one decode sequence.
    """

    __slots__ = ("load", "keys", "prefill", "phase")

    def __init__(self, load: BackendLoad, keys: list[int], prefill: int) -> None:
        self.load = load
        self.keys = keys
        self.prefill = prefill
        self.phase = 0
        load.in_flight += 1
        load.prefill_tokens += prefill
        load.context_blocks += len(keys)
        refs = load.block_refs
        for k in keys:
            refs[k] = refs.get(k, 0) + 1

    def first_token(self) -> None:
        if self.phase == 0:
            self.phase = 1
            self.load.prefill_tokens -= self.prefill
            self.load.decode_seqs += 1

    def settle(self, keys: list[int], prefill: int) -> None:
        """Replace the estimate a deferred request was sent with (the keys of its head and
        a token count from the text's length) by its exact keys and prefill tokens."""
        if self.phase == 2:
            return
        if self.phase == 0:
            self.load.prefill_tokens += prefill - self.prefill
        self.prefill = prefill
        self._unref()
        self.keys = keys
        self.load.context_blocks += len(keys)
        refs = self.load.block_refs
        for k in keys:
            refs[k] = refs.get(k, 0) + 1

    def release(self) -> None:
        if self.phase == 2:
            return
        load = self.load
        if self.phase == 0:
            load.prefill_tokens -= self.prefill
        else:
            load.decode_seqs -= 1
        self.phase = 2
        load.in_flight -= 1
        self._unref()

    def _unref(self) -> None:
        self.load.context_blocks -= len(self.keys)
        refs = self.load.block_refs
        for k in self.keys:
            n = refs.get(k, 0)
            if n <= 1:
                refs.pop(k, None)
            else:
                refs[k] = n - 1


class LoadTracker:
    """The loads of every configured backend, by name."""

    def __init__(self, names: list[str]) -> None:
        self.backends: dict[str, BackendLoad] = {n: BackendLoad(n) for n in names}

    def acquire(self, backend: str, keys: list[int], prefill_tokens: int) -> Ticket:
        return Ticket(self.backends[backend], keys, prefill_tokens)

    def get(self, backend: str) -> BackendLoad:
        return self.backends[backend]

    def add(self, backend: str) -> None:
        self.backends[backend] = BackendLoad(backend)

    def remove(self, backend: str) -> None:
        """Forget a backend a config reload removed (its tickets all released)."""
        del self.backends[backend]

    def total_in_flight(self) -> int:
        return sum(b.in_flight for b in self.backends.values())

    def idle(self) -> bool:
        return all(
            b.in_flight == 0 and b.prefill_tokens == 0 and b.decode_seqs == 0 and not b.block_refs and b.context_blocks == 0
            for b in self.backends.values()
        )


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
    (stale numbers would keep steering traffic by a picture that is gone)."""
    while True:
        started = time.monotonic()
        await asyncio.gather(*(_scrape_one(pool, tracker, name) for name in tracker.backends))
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def _scrape_one(pool: BackendPool, tracker: LoadTracker, name: str) -> None:
    load = tracker.backends.get(name)
    backend = pool.backends.get(name)
    if load is None or backend is None:  # removed by a config reload
        return
    status, body = await backend.poll("/metrics", max(0.5, pool.settings.metrics_scrape_interval_s))
    values: dict[str, float] = {}
    if status != 200:
        log.debug("metrics scrape of %s failed: %s", name, status)
    else:
        try:
            values = parse_vllm_metrics(body.decode("utf-8", "replace"))
        except Exception as e:  # noqa: BLE001 - a page the Prometheus parser rejects only clears the second signal
            log.debug("metrics page of %s unreadable: %r", name, e)
    load.scraped_waiting = values.get("vllm:num_requests_waiting")
    load.scraped_running = values.get("vllm:num_requests_running")
    load.scraped_kv_usage = values.get("vllm:kv_cache_usage_perc")
    load.scraped_at = time.time() if values else None
