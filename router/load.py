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

Shared load (``serve --workers N``, replicas on Redis): each process keeps its own exact
counters (above) and publishes them, a worker into its row of the shared segment
(:mod:`router.shared_state`) whenever a ticket changes, a replica to Redis on a timer
(:mod:`router.replica_load`). What the policies read, :meth:`LoadTracker.get`, is then a
:class:`LoadView`: this process's counters plus every other worker's row plus every other
replica's last published vector. ``active_blocks`` is summed too, so a prefix held by
requests of two workers counts twice (the keys themselves are not shared): an
overestimate bounded by the number of processes, only while both hold it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from router.shared_state import LOAD_FIELDS, ROW_WORDS, SENT_WORD

if TYPE_CHECKING:
    from router.backends import BackendPool
    from router.shared_state import Segment

log = logging.getLogger(__name__)

_ZERO = (0, 0, 0, 0, 0)
OTHERS_TTL_S = 50e-6
"""How long one read of the other workers' load rows serves (:meth:`LoadTracker._other_workers`)."""
SCRAPED_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


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

    With a shared segment, :meth:`publish` copies the counters into this worker's row
    after every change (``words`` is None without one)."""

    __slots__ = (
        "name",
        "words",
        "base",
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
        "changed",
        "prefilling",
        "sent",
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
        self.sent = 0
        """Requests this process ever sent to the backend (its shared row's :data:`SENT_WORD`)."""
        self.words: memoryview | None = None
        self.base = 0
        self.changed: Callable[[str, int, int, int], None] | None = None
        """Told (backend, in-flight, prefill-token and context-block changes) of every ticket
        change when the load is pushed to other replicas (:meth:`LoadTracker.push_changes`)."""

    @property  # type: ignore[override]
    def active_blocks(self) -> int:
        return len(self.block_refs)

    def publish(self) -> None:
        """Copy the counters into this worker's row of the shared segment."""
        w, b = self.words, self.base
        assert w is not None
        w[b] = self.in_flight
        w[b + 1] = self.prefill_tokens
        w[b + 2] = self.decode_seqs
        w[b + 3] = len(self.block_refs)
        w[b + 4] = self.context_blocks
        w[b + SENT_WORD] = self.sent

    def note(self, d_in_flight: int, d_prefill: int, d_context: int) -> None:
        """After a ticket changed the counters: copy them into the shared segment, and tell
        :attr:`changed` the change (both only where configured)."""
        if self.words is not None:
            self.publish()
        if self.changed is not None:
            self.changed(self.name, d_in_flight, d_prefill, d_context)

    def vector(self) -> list[int]:
        """The counters, in :data:`router.shared_state.LOAD_FIELDS` order."""
        return [self.in_flight, self.prefill_tokens, self.decode_seqs, len(self.block_refs), self.context_blocks]


class LoadView(_Figures):
    """A backend's load over every worker and replica, as of the moment it was read: what
    :meth:`LoadTracker.get` answers when the load is shared. A snapshot, not live: read it
    again to see later changes."""

    __slots__ = ("name", "in_flight", "prefill_tokens", "decode_seqs", "active_blocks", "context_blocks",
                 "scraped_waiting", "scraped_running", "scraped_kv_usage", "scraped_unseen", "own",
                 "prefilling")

    def __init__(self, own: BackendLoad, others: Sequence[int], at: int, remote: Sequence[int] | None) -> None:
        """``others[at:at + 5]``: the other workers' counters (a flat list of rows)."""
        self.name = own.name
        self.own = own
        o = others
        r = remote or _ZERO
        self.in_flight = own.in_flight + o[at] + r[0]
        self.prefill_tokens = own.prefill_tokens + o[at + 1] + r[1]
        self.decode_seqs = own.decode_seqs + o[at + 2] + r[2]
        self.active_blocks = len(own.block_refs) + o[at + 3] + r[3]
        self.context_blocks = own.context_blocks + o[at + 4] + r[4]
        self.scraped_waiting = own.scraped_waiting
        self.scraped_running = own.scraped_running
        self.scraped_kv_usage = own.scraped_kv_usage
        self.scraped_unseen = own.scraped_unseen
        self.prefilling = own.prefilling


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
        load.sent += 1
        load.prefill_tokens += prefill
        load.context_blocks += len(keys)
        load.prefilling.add(self)
        refs = load.block_refs
        for k in keys:
            refs[k] = refs.get(k, 0) + 1
        load.note(1, prefill, len(keys))

    def first_token(self) -> None:
        if self.phase == 0:
            self.phase = 1
            self.load.prefilling.discard(self)
            self.load.prefill_tokens -= self.prefill
            self.load.decode_seqs += 1
            self.load.note(0, -self.prefill, 0)

    def settle(self, keys: list[int], prefill: int) -> None:
        """Replace the estimate a deferred request was sent with (the keys of its head and
        a token count from the text's length) by its exact keys and prefill tokens."""
        if self.phase == 2:
            return
        d_prefill = prefill - self.prefill if self.phase == 0 else 0
        d_context = len(keys) - len(self.keys)
        self.load.prefill_tokens += d_prefill
        self.prefill = prefill
        self._unref()
        self.keys = keys
        self.load.context_blocks += len(keys)
        refs = self.load.block_refs
        for k in keys:
            refs[k] = refs.get(k, 0) + 1
        self.load.note(0, d_prefill, d_context)

    def release(self) -> None:
        if self.phase == 2:
            return
        load = self.load
        d_prefill = -self.prefill if self.phase == 0 else 0
        if self.phase == 0:
            load.prefill_tokens -= self.prefill
            load.prefilling.discard(self)
        else:
            load.decode_seqs -= 1
        self.phase = 2
        load.in_flight -= 1
        self._unref()
        load.note(-1, d_prefill, -len(self.keys))

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
    """The loads of every configured backend, by name: this process's own (:meth:`own`),
    and what the policies read (:meth:`get`: the same object when nothing is shared, else a
    :class:`LoadView` over every worker and replica)."""

    def __init__(self, names: list[str]) -> None:
        self.backends: dict[str, BackendLoad] = {n: BackendLoad(n) for n in names}
        self.segment: Segment | None = None
        self.worker = 0
        self._slots: dict[str, int] = {}
        self.remote: dict[str, tuple[int, int, int, int, int]] = {}
        """Other replicas' load by backend, summed (set by :class:`router.replica_load.ReplicaLoad`)."""
        self.claims = 0
        """Load changes pushed so far (:meth:`push_changes`): a shared load vector carries the
        count it includes, so a replica can tell which pushed changes it already covers."""
        self._push: Callable[[int, str, int, int, int], None] | None = None
        self.shared = False
        self._rows: np.ndarray | None = None
        self._others: list[int] = []
        self._others_at = -1.0
        self._used = 0
        self._sent_seen: dict[str, int] = {}

    def share(self, segment: Segment | None, worker: int) -> None:
        """Publish this worker's load into ``segment`` and read the other workers' from it
        (call before the first request); with ``segment`` None, only replicas share."""
        self.segment = segment
        self.worker = worker
        self.shared = True
        if segment is None:
            return
        segment.zero_worker(worker)
        self._rows = segment.rows()
        for name, load in self.backends.items():
            self._attach(name, load)

    def _attach(self, name: str, load: BackendLoad) -> None:
        seg = self.segment
        if seg is None:
            return
        slot = self._slots[name] = seg.slot(name)
        self._used = max(self._used, slot + 1)
        self._others_at = -1.0
        load.words = seg.words
        load.base = seg.row_base(self.worker, slot)
        load.publish()

    def acquire(self, backend: str, keys: list[int], prefill_tokens: int) -> Ticket:
        return Ticket(self.backends[backend], keys, prefill_tokens)

    def push_changes(self, push: Callable[[int, str, int, int, int], None]) -> None:
        """Send every ticket change, numbered, to ``push`` (number, backend, in-flight,
        prefill-token and context-block changes): :meth:`router.replica_decisions.ReplicaDecisions.claim`
        pushes them to the other replicas at once (router/replica_load.py, "Claims")."""
        self._push = push
        for load in self.backends.values():
            load.changed = self._changed

    def _changed(self, backend: str, d_in_flight: int, d_prefill: int, d_context: int) -> None:
        self.claims += 1
        assert self._push is not None
        self._push(self.claims, backend, d_in_flight, d_prefill, d_context)

    def get(self, backend: str) -> BackendLoad | LoadView:
        """The backend's load as the policies weigh it: every worker's and replica's requests."""
        own = self.backends[backend]
        if not self.shared:
            return own
        if self.segment is None:
            return LoadView(own, _ZERO, 0, self.remote.get(backend))
        return LoadView(own, self._other_workers(), self._slots[backend] * ROW_WORDS, self.remote.get(backend))

    def _other_workers(self) -> list[int]:
        """Every slot's row summed over the other workers, flat (``ROW_WORDS`` per slot), read
        at most every :data:`OTHERS_TTL_S`: one read serves all the candidates of a request.
        With 2 workers it is the other worker's rows as they are (one slice copied: 0.3 us);
        with more, one numpy sum (2-6 us for up to 50 backends, where reading each backend's
        rows in Python cost 2.3 us per backend at 8 workers). The other workers' changes are
        seen up to that much later, as if they had come a moment later; this worker's own
        counters are always read live."""
        now = time.perf_counter()
        if now - self._others_at > OTHERS_TTL_S:
            seg = self.segment
            assert seg is not None
            used = self._used
            if seg.n_workers == 2:
                start = seg.row_base(1 - self.worker, 0)
                self._others = seg.words[start:start + used * ROW_WORDS].tolist()
            else:
                rows = self._rows
                assert rows is not None
                self._others = (rows[:, :used].sum(axis=0) - rows[self.worker, :used]).ravel().tolist()
            self._others_at = now
        return self._others

    def sent_by_other_workers(self) -> dict[str, int]:
        """Requests the other workers sent to each backend since the last call (kv_aware's
        request share counts them: :meth:`router.core.Router._count_other_workers_forever`).
        A backend's first call only takes the count as it is; a count that went down (a
        worker restarted, its row zeroed) is taken as it is too."""
        if self.segment is None:
            return {}
        others, seen, out = self._other_workers(), self._sent_seen, {}
        for name, slot in self._slots.items():
            n = others[slot * ROW_WORDS + SENT_WORD]
            last = seen.get(name)
            if last is not None and n > last:
                out[name] = n - last
            seen[name] = n
        return out

    def own(self, backend: str) -> BackendLoad:
        """This process's requests only (what it must drain before it forgets a backend)."""
        return self.backends[backend]

    def add(self, backend: str) -> None:
        load = self.backends[backend] = BackendLoad(backend)
        if self._push is not None:
            load.changed = self._changed
        self._attach(backend, load)

    def remove(self, backend: str) -> None:
        """Forget a backend a config reload removed (its tickets all released)."""
        del self.backends[backend]
        slot = self._slots.pop(backend, None)
        if slot is not None and self.segment is not None:
            self.segment.zero_row(self.worker, slot)

    def publish_scraped(self) -> None:
        """The engines' gauges this worker scraped, for the other workers (the leader)."""
        seg = self.segment
        assert seg is not None
        for name, load in self.backends.items():
            seg.set_scraped(self._slots[name], load.scraped_waiting, load.scraped_running, load.scraped_kv_usage,
                            load.scraped_unseen, load.scraped_at)

    def take_scraped(self) -> None:
        """The engines' gauges as the leader last scraped them."""
        seg = self.segment
        assert seg is not None
        for name, load in self.backends.items():
            (load.scraped_waiting, load.scraped_running, load.scraped_kv_usage, load.scraped_unseen,
             load.scraped_at) = seg.scraped(self._slots[name])

    def worker_rows(self, backend: str) -> list[dict[str, int]] | None:
        """Each worker's published counters for ``backend`` (``/debug/backends``), or None unshared."""
        seg = self.segment
        slot = self._slots.get(backend)
        if seg is None or slot is None:
            return None
        return [dict(zip(LOAD_FIELDS, seg.row(w, slot))) for w in range(seg.n_workers)]

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

    Workers sharing a segment scrape once for all: the health leader (worker 0) scrapes and
    publishes what it read, the others copy it every quarter interval (an engine's page
    costs the router milliseconds to parse, N times over otherwise), and scrape for
    themselves while the leader is gone."""
    while True:
        started = time.monotonic()
        if tracker.segment is not None and not pool.leader and not pool.leader_gone():
            tracker.take_scraped()
            await asyncio.sleep(interval_s / 4)
            continue
        await asyncio.gather(*(_scrape_one(pool, tracker, name) for name in tracker.backends))
        if tracker.segment is not None:
            tracker.publish_scraped()
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
    # Against every worker's and replica's requests as of now, the moment the page arrived.
    seen = tracker.get(name).in_flight
    load.scraped_unseen = max(0.0, (load.scraped_waiting or 0.0) + (load.scraped_running or 0.0) - seen)
