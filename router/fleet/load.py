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

Shared load (``serve --workers N``, replicas): each process keeps its own exact counters
(above), and every change of them is a record of the fleet-state log
(:mod:`router.fleet.log`: a request decided, its first token, its end). What the policies
read, :meth:`LoadTracker.get`, is then a :class:`LoadView`: this process's counters plus
every other process's, as the log folds them. ``active_blocks`` is not a sum: a decision's
record carries its block keys and the record that ends it names it, so every process
refcounts every process's blocks (:attr:`BackendLoad.block_refs`), and a prefix the
requests of two processes hold counts once, as the engine holds it. (Summed, two workers
saw a hot prefix's backend twice as full as one process did, and moved its requests away.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from router.fleet.log import Changed, Decided, Load, Scraped, Settled

if TYPE_CHECKING:
    from router.fleet.backends import BackendPool
    from router.fleet.process import FleetLog

log = logging.getLogger(__name__)

_ZERO = (0, 0, 0, 0, 0)
_TICKETS = itertools.count(1)
next_ticket = _TICKETS.__next__
"""A name for a request's ticket, unique in this process (the records that end it give it)."""
SCRAPED_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


LOAD_FIELDS = ("in_flight", "prefill_tokens", "decode_seqs", "active_blocks", "context_blocks")
"""A backend's load counters, in the order :class:`router.fleet.log.Load` carries them."""


class _Figures:
    """What policies read of a backend's load, for :class:`BackendLoad` and :class:`LoadView` alike."""

    __slots__ = ()
    prefilling: set[Ticket]
    """This process's requests on the backend still before their first token."""
    in_flight: int
    prefill_tokens: int
    decode_seqs: int
    context_blocks: int
    active_blocks: int
    scraped_waiting: float | None
    scraped_running: float | None
    scraped_kv_usage: float | None

    scraped_unseen: float

    def shared_prefill_blocks(self, keys: list[int], block_size: int) -> int:
        """Blocks of a prompt (block keys ``keys``) that requests this process sent here are
        prefilling now: for each such request, the leading blocks the two prompts share beyond
        what was cached when it was sent (its prefill starts at block ``len(keys) - prefill //
        block_size``; vLLM recomputes at least one token, so that holds at the cap too), the
        union over requests.

        kv_aware does not charge a request for queued work it would share. Read from the
        tickets, this is the same before and after the engine's events index the blocks
        (speculative blocks minus indexed ones drops to 0 once they do)."""
        spans: list[tuple[int, int]] = []
        for t in self.prefilling:
            other = t.keys
            start = len(other) - t.prefill // block_size
            end = min(len(keys), len(other))
            if start < 0 or start >= end or keys[start] != other[start]:
                continue
            lo, hi = start, end - 1  # keys[lo] matches; chained keys match as a prefix
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if keys[mid] == other[mid]:
                    lo = mid
                else:
                    hi = mid - 1
            spans.append((start, lo + 1))
        spans.sort()
        total, reach = 0, 0
        for a, b in spans:
            a = max(a, reach)
            if b > a:
                total += b - a
                reach = b
        return total

    def effective_in_flight(self) -> float:
        """Requests on the engine: the router's own count, live, plus what the last scrape saw
        beyond it (``scraped_unseen``: another router's traffic, or a queue the router cannot
        see), taken as unchanged since.

        Not ``max(own, scraped)``: a scrape is up to ``metrics_scrape_interval_s`` old, and on
        a busy engine it still shows the queue of a burst the engine has since drained, so the
        imbalance guard kept moving requests off their cache (measured on the Mooncake slice,
        docs/benchmarks.md: 65 guard overrides against 8-12 with the engines' exact count)."""
        return float(self.in_flight) + self.scraped_unseen

    def snapshot(self) -> dict[str, float | int | None]:
        return {
            "in_flight": self.in_flight,
            "prefill_tokens": self.prefill_tokens,
            "decode_seqs": self.decode_seqs,
            "active_blocks": self.active_blocks,
            "context_blocks": self.context_blocks,
            "scraped_waiting": self.scraped_waiting,
            "scraped_running": self.scraped_running,
            "scraped_kv_cache_usage": self.scraped_kv_usage,
            "scraped_unseen": self.scraped_unseen,
        }


class BackendLoad(_Figures):
    """This process's load on one backend. Mutated only on the event loop (no locks needed).

    When the load is shared, every change is appended to :attr:`fleet` as a record."""

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
        "scraped_unseen",
        "scraped_at",
        "prefilling",
        "fleet",
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
        self.scraped_unseen = 0.0
        """Requests the engine reported at the last scrape beyond those every worker and
        replica of this router had in flight on it then (see :meth:`effective_in_flight`)."""
        self.scraped_at: float | None = None
        self.prefilling: set[Ticket] = set()
        self.fleet: FleetLog | None = None
        """Where every change goes as a record when the load is shared."""

    @property  # type: ignore[override]
    def active_blocks(self) -> int:
        return len(self.block_refs)

    def vector(self) -> Load:
        """The counters, in :data:`LOAD_FIELDS` order (a fleet-state record's ``Load``)."""
        return (self.in_flight, self.prefill_tokens, self.decode_seqs, len(self.block_refs), self.context_blocks)

    def new_blocks(self, keys: list[int]) -> int:
        """Blocks of ``keys`` no request in flight here holds yet (what a ticket for them adds
        to ``active_blocks``: chained keys are distinct within one prompt)."""
        refs = self.block_refs
        return sum(1 for k in keys if k not in refs)


class LoadView(_Figures):
    """A backend's load over every process of the router, as of the moment it was read: what
    :meth:`LoadTracker.get` answers when the load is shared. A snapshot, not live: read it
    again to see later changes."""

    __slots__ = ("name", "in_flight", "prefill_tokens", "decode_seqs", "active_blocks", "context_blocks",
                 "scraped_waiting", "scraped_running", "scraped_kv_usage", "scraped_unseen", "own",
                 "prefilling")

    def __init__(self, own: BackendLoad, remote: list[int] | tuple[int, ...]) -> None:
        self.name = own.name
        self.own = own
        r = remote
        self.in_flight = own.in_flight + r[0]
        self.prefill_tokens = own.prefill_tokens + r[1]
        self.decode_seqs = own.decode_seqs + r[2]
        self.active_blocks = len(own.block_refs)  # every process's requests, counted once
        self.context_blocks = own.context_blocks + r[4]
        self.scraped_waiting = own.scraped_waiting
        self.scraped_running = own.scraped_running
        self.scraped_kv_usage = own.scraped_kv_usage
        self.scraped_unseen = own.scraped_unseen
        self.prefilling = own.prefilling


class Ticket:
    """One request's share of a backend's load, from routing until the response ends.

    ``prefill`` are the tokens the engine must compute before the first token (the
    uncached part of the prompt); they move out of ``prefill_tokens`` at the first
    streamed byte, and the request then counts as one decode sequence. Each change is one
    record of the fleet-state log when the load is shared.
    """

    __slots__ = ("load", "keys", "prefill", "phase", "model", "id")

    def __init__(self, load: BackendLoad, keys: list[int], prefill: int, model: str = "", *, announced: bool = False,
                 ticket: int | None = None) -> None:
        """``announced``: its :class:`Decided` record went out already (committed to the
        replicas' order, named ``ticket``), so only this host's other workers are told here."""
        self.id = next_ticket() if ticket is None else ticket
        self.load = load
        self.keys = keys
        self.prefill = prefill
        self.phase = 0
        self.model = model
        load.in_flight += 1
        load.prefill_tokens += prefill
        load.context_blocks += len(keys)
        load.prefilling.add(self)
        refs = load.block_refs
        before = len(refs)
        refer(refs, keys, 1)
        if load.fleet is not None:
            record = Decided(model, load.name, (1, prefill, 0, len(refs) - before, len(keys)), keys, self.id)
            load.fleet.append(record, to_fleet=not announced)

    def first_token(self) -> None:
        if self.phase == 0:
            self.phase = 1
            load = self.load
            load.prefilling.discard(self)
            load.prefill_tokens -= self.prefill
            load.decode_seqs += 1
            if load.fleet is not None:
                load.fleet.append(Changed(load.name, (0, -self.prefill, 1, 0, 0)))

    def settle(self, keys: list[int], prefill: int) -> None:
        """Replace the estimate a deferred request was sent with (the keys of its head and
        a token count from the text's length) by its exact keys and prefill tokens."""
        if self.phase == 2:
            return
        load = self.load
        d_prefill = prefill - self.prefill if self.phase == 0 else 0
        d_context = len(keys) - len(self.keys)
        before = len(load.block_refs)
        load.prefill_tokens += d_prefill
        self.prefill = prefill
        self._unref()
        self.keys = keys
        load.context_blocks += len(keys)
        refs = load.block_refs
        refer(refs, keys, 1)
        if load.fleet is not None:
            d = (0, d_prefill, 0, len(refs) - before, d_context)
            load.fleet.append(Settled(self.model, load.name, d, keys, self.id))

    def release(self) -> None:
        if self.phase == 2:
            return
        load = self.load
        before = len(load.block_refs)
        if self.phase == 0:
            d: Load = (-1, -self.prefill, 0, 0, -len(self.keys))
            load.prefill_tokens -= self.prefill
            load.prefilling.discard(self)
        else:
            d = (-1, 0, -1, 0, -len(self.keys))
            load.decode_seqs -= 1
        self.phase = 2
        load.in_flight -= 1
        self._unref()
        if load.fleet is not None:
            load.fleet.append(Changed(load.name, (d[0], d[1], d[2], len(load.block_refs) - before, d[4]), [self.id]))

    def _unref(self) -> None:
        self.load.context_blocks -= len(self.keys)
        refer(self.load.block_refs, self.keys, -1)


def refer(refs: dict[int, int], keys: list[int], sign: int) -> None:
    """Count ``keys`` in (``sign`` 1) or out (-1) of a backend's block refcounts."""
    for k in keys:
        if (n := refs.get(k, 0) + sign) > 0:
            refs[k] = n
        else:
            refs.pop(k, None)


class FleetBlocks:
    """The other processes' requests' KV blocks, added to each backend's refcounts
    (:attr:`BackendLoad.block_refs`) as the fleet-state log folds their records, and taken
    out when the record that ends a request names its ticket, or its sender is gone."""

    def __init__(self, backends: dict[str, BackendLoad]) -> None:
        self.backends = backends
        self.tickets: dict[str, dict[int, tuple[str, list[int]]]] = {}  # per sender: backend and keys

    def hold(self, sender: str, ticket: int, backend: str | None, keys: list[int]) -> None:
        """``ticket``'s blocks from now on (``backend`` None: it ended), in place of its earlier ones."""
        held = self.tickets.setdefault(sender, {})
        if (old := held.pop(ticket, None)) is not None:
            self._refer(*old, -1)
        if backend is not None:
            held[ticket] = (backend, keys)
            self._refer(backend, keys, 1)

    def forget(self, sender: str) -> None:
        for backend, keys in self.tickets.pop(sender, {}).values():
            self._refer(backend, keys, -1)

    def _refer(self, backend: str, keys: list[int], sign: int) -> None:
        if (load := self.backends.get(backend)) is not None:  # else a reload removed it
            refer(load.block_refs, keys, sign)


class LoadTracker:
    """The loads of every configured backend, by name: this process's own (:meth:`own`),
    and what the policies read (:meth:`get`: the same object when nothing is shared, else a
    :class:`LoadView` over every process of the router)."""

    def __init__(self, names: list[str]) -> None:
        self.backends: dict[str, BackendLoad] = {n: BackendLoad(n) for n in names}
        self.fleet: FleetLog | None = None
        self.remote: dict[str, list[int]] = {}
        """The other processes' load by backend, summed (the fleet-state log's fold)."""

    def share(self, fleet: FleetLog) -> None:
        """Append every change to ``fleet`` and weigh the other processes' load it folds
        (call before the first request)."""
        self.fleet = fleet
        self.remote = fleet.state.remote
        blocks = FleetBlocks(self.backends)
        fleet.state.hold, fleet.state.forget = blocks.hold, blocks.forget
        fleet.state.follow[Scraped] = self._take_scraped
        for load in self.backends.values():
            load.fleet = fleet

    @property
    def shared(self) -> bool:
        return self.fleet is not None

    def acquire(self, backend: str, keys: list[int], prefill_tokens: int, model: str = "", *,
                announced: bool = False, ticket: int | None = None) -> Ticket:
        return Ticket(self.backends[backend], keys, prefill_tokens, model, announced=announced, ticket=ticket)

    def preview(self, backend: str, keys: list[int], prefill_tokens: int) -> Load:
        """The change :meth:`acquire` would make now (a decision's record before it is sent)."""
        return (1, prefill_tokens, 0, self.backends[backend].new_blocks(keys), len(keys))

    def get(self, backend: str) -> BackendLoad | LoadView:
        """The backend's load as the policies weigh it: every process's requests."""
        own = self.backends[backend]
        fleet = self.fleet
        if fleet is None:
            return own
        fleet.catch_up()
        return LoadView(own, self.remote.get(backend) or _ZERO)

    def snapshot(self) -> dict[str, Load]:
        """This process's counters per backend (a fleet-state snapshot)."""
        return {name: load.vector() for name, load in self.backends.items()}

    def own(self, backend: str) -> BackendLoad:
        """This process's requests only (what it must drain before it forgets a backend)."""
        return self.backends[backend]

    def add(self, backend: str) -> None:
        load = self.backends[backend] = BackendLoad(backend)
        load.fleet = self.fleet

    def remove(self, backend: str) -> None:
        """Forget a backend a config reload removed (its tickets all released)."""
        del self.backends[backend]

    def publish_scraped(self) -> None:
        """The engines' gauges this process scraped, for the other workers of its host."""
        if self.fleet is None:
            return
        for name, load in self.backends.items():
            self.fleet.append(Scraped(name, load.scraped_waiting, load.scraped_running, load.scraped_kv_usage,
                                      load.scraped_unseen, load.scraped_at), to_fleet=False)

    def _take_scraped(self, r: Scraped) -> None:
        load = self.backends.get(r.backend)
        if load is not None:
            load.scraped_waiting, load.scraped_running, load.scraped_kv_usage = r.waiting, r.running, r.usage
            load.scraped_unseen, load.scraped_at = r.unseen, r.at

    def by_worker(self, backend: str, worker: int, workers: int) -> list[dict[str, int]]:
        """Each worker's counters for ``backend``, this one's and the others' as folded
        (``/debug/backends``)."""
        from router.fleet.ring import sender

        assert self.fleet is not None
        folded = {name: s.loads.get(backend, [0] * 5) for name, s in self.fleet.state.senders.items() if s.loads is not None}
        rows = [list(self.backends[backend].vector()) if w == worker else folded.get(sender(w), [0] * 5)
                for w in range(workers)]
        return [dict(zip(LOAD_FIELDS, r)) for r in rows]

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
    (stale numbers would keep steering traffic by a picture that is gone).

    Workers of one host scrape once for all: the health leader (worker 0) scrapes and
    appends what it read to the fleet-state log, the others take it from there (an
    engine's page costs the router milliseconds to parse, N times over otherwise), and
    scrape for themselves while the leader is silent."""
    while True:
        started = time.monotonic()
        if not pool.leader and not pool.leader_gone():
            await asyncio.sleep(interval_s / 4)
            continue
        await asyncio.gather(*(_scrape_one(pool, tracker, name) for name in tracker.backends))
        if pool.workers > 1:
            tracker.publish_scraped()
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def _scrape_one(pool: BackendPool, tracker: LoadTracker, name: str) -> None:
    load = tracker.backends.get(name)
    backend = pool.backends.get(name)
    if load is None or backend is None:  # removed by a config reload
        return
    status, body = await backend.poll("/metrics", max(0.5, pool.tuning.metrics_scrape_interval_s))
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
    # Against every worker's and replica's requests as of now, the moment the page arrived.
    seen = tracker.get(name).in_flight
    load.scraped_unseen = max(0.0, (load.scraped_waiting or 0.0) + (load.scraped_running or 0.0) - seen)
