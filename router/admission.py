"""Part of stage 4 of the request path, *look up*: the router's admission queue (late binding).

A request decided on arrival joins the queue of the engine it was sent to, even when
another engine frees up first or the index changes while it waits; under a burst the
tail latency is set by those queues. With the queue on (``router.queue_busy_tokens``),
while every healthy backend of a model is *busy* a request planned (stage 3) waits here
instead, and is let through when one stops being busy: its look up and choice (stages
4-5) are made then, on the index and load of that moment.

*Busy*: the prompt tokens queued on a backend for prefill exceed the threshold. They are
what the router knows: every process's requests there before their first token (the
fleet-state log sums workers and replicas), plus the requests the engine's last scrape
showed beyond those (``scraped_unseen``: another client's, or ones the router cannot see),
each counted at the mean queued prompt. Dynamo's router queue gates on the same figure
(active prefill tokens against ``max_num_batched_tokens``).

Order when a backend frees: lower ``priority`` first (vLLM's request field, lower is
served first as in vLLM's priority scheduling), then tenants in turn (the tenant of
``router.tenants`` the client's key names, else the body's ``user``, else a hash of the
client's ``Authorization``), then, within a tenant, the earliest *deadline*: its arrival
plus the queue's recent wait scaled by its prefill against the mean (the prompt tokens no
backend holds, from the index). Under a burst the time to first token of most requests is
set by the work queued ahead of them: a short prefill (a chat's next turn, a cached
document's question) let through before a long one (a new 10k-token context) waits less
and makes the long one wait little more, so the percentiles below the longest requests fall
(shortest-job-first). The deadline ages every request: a long one that has waited the
recent wait beyond its share goes before newer short ones, and with no recent wait (a
queue that has just formed) the order is arrival. One request is let
through at a time and the next waits until it holds its load ticket, so each busy check
counts the previous one's tokens. A request over ``queue_max_waiting`` or waiting past
``queue_timeout_s`` gets 429 with ``Retry-After``; one whose client disconnects leaves the
queue (counted). Each process queues its own requests: the load it weighs is the fleet's.

*Headroom for the other tenants*: a tenant sending more than twice its fair share of the
model's recent requests (``HEAVY_SHARE``; fair: one over the tenants seen lately) is let
through only when a backend has room for it (:func:`room`): nothing queued for prefill, or
still under ``queue_heavy_fraction`` (a lab knob, :mod:`router.tuning`) of the threshold
with the request's uncached tokens added; and it is sent only to such a backend
(:meth:`Pass.confine`). The others go up to the threshold, anywhere. Taking turns alone left
them waiting for a backend to drain a heavy tenant's backlog to the threshold, then behind
that backlog in the engine: a tenant at 10x the others' rate still tripled their TTFT p90.
Let through whenever some backend's queue was short, a heavy tenant's request could still go
where its cache was, behind a backlog, or bring a new 16k-token context to a short queue and
make it a long one; the other tenants' requests that their own cache sent
to that backend waited behind it. Its demand is counted on arrival, so holding it back does
not make it look light.

*A heavy tenant's own backends* (``queue_heavy_subset``, a lab knob, on by default): room
alone still lets a heavy tenant's prefill into every engine in turn, and an engine runs the
prefill it has started before any it has not, so where the fleet is not busy the other
tenants' first tokens wait on its chunks wherever their cache sends them. With the knob on,
a heavy tenant's requests go only to its share of the model's ``N`` backends (``N`` x its
share of the recent arrivals, rounded: :meth:`ModelQueue.subset`), picked by rendezvous
hashing on the tenant and the backend: the same ones while its share holds, alike in every
process, and a backend gone moves only the requests that were on it. The rest of the fleet
serves the other tenants free of its prefill; kv_aware's cost of the prefill queued there
keeps them off its backends unless their cache there saves more. Where the fleet is busy
the others wait in the router's queue instead, and there it measured level (docs/benchmarks.md,
the router queue).

*Giving way*: a burst of the other tenants' requests then lands on the backends outside the
heavy tenant's, while its own keep running its prefill: the others carried their burst on part
of the fleet where without it they would spread over all of it. So a heavy tenant's request
with its own backends also waits while a backend outside them has more than the headroom
queued for prefill (:meth:`ModelQueue.gives_way`). Its backends drain, kv_aware's cost of the
prefill queued elsewhere sends the others' requests there too, and the heavy tenant goes again
once the backlog is down (or gets its 429 at the deadline). Its demand is still counted, so
it stays heavy while it waits.

A request that finds the queue empty and a backend not busy pays one pass over the
model's backends (no await, no allocation beyond the check); a heavy tenant's also pays a
look-up of its uncached tokens.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import heapq
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from router import metrics
from router.fleet.load import LoadTracker
from router.http.errors import ClientClosed, Overloaded
from router.policies.base import Candidate
from router.shares import Shares

POLL_S = 0.005
"""How often a non-empty queue re-checks whether a backend stopped being busy. Polled, not
evented: the load that frees a backend also arrives from other processes (the fleet-state
log) and from scrapes, and a 5 ms tick is small against the waits it ends."""
TAKEN_TIMEOUT_S = 1.0
"""Longest the queue waits for a released request to take its load ticket before letting
the next one through (a request that fails before sending releases at once)."""
HEAVY_SHARE = 2.0
"""A tenant is heavy above this many times its fair share of the model's recent arrivals."""
SHARE_WINDOW = 64
"""Arrivals the tenants' shares are measured over (exponential decay, :class:`Shares`)."""


@dataclass(eq=False)
class Pass:
    """A request's way through the queue: :meth:`taken` once its load ticket is held (or it
    failed), so the queue may let the next one through."""

    queue: ModelQueue | None = None
    priority: int = 0
    tenant: str = ""
    arrived: float = 0.0
    deadline: float = 0.0
    """When it should go, relative to the others of its tenant (see the module docstring)."""
    released: asyncio.Future[None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    waited: float = 0.0
    """Seconds it waited in the queue."""
    within: float = math.inf
    """The headroom a heavy tenant's request was let through for (see the module docstring);
    unbounded for the others."""
    allowed: frozenset[str] | None = None
    """A heavy tenant's own backends (:meth:`ModelQueue.subset`); None: any."""
    size: int = 0
    """Its prompt tokens no backend holds: orders it within its tenant, and sizes a heavy
    tenant's request against the headroom."""

    def taken(self) -> None:
        self.done.set()

    def confine(self, candidates: list[Candidate]) -> list[str]:
        """Keep a heavy tenant's request on its own backends, and off those without room for
        it (:func:`room`; if none has room any more, off those over the headroom, then only
        on its own), while one remains: the others are made unroutable for this decision and
        returned, for the caller to append to the decision's failover order."""
        if self.queue is None or math.isinf(self.within):
            return []
        queued = {c.backend: self.queue.queued(c.backend) for c in candidates if c.healthy}
        outside = {b for b in queued if self.allowed is not None and b not in self.allowed}
        over = outside | {b for b, q in queued.items() if not room(q, self.size, self.within)}
        if len(over) == len(queued):
            over = outside | {b for b, q in queued.items() if q > self.within}
        if len(over) == len(queued):
            over = outside
        if not over or len(over) == len(queued):
            return []
        for c in candidates:
            if c.backend in over:
                c.healthy = False
        return sorted(over)


OPEN = Pass()
"""What a request that did not wait holds (nothing to signal)."""


class ModelQueue:
    """One model's waiting requests: priority bands, a rotation of tenants in each, arrival
    order within a tenant."""

    def __init__(self, model: str, backends: Callable[[], list[str]], loads: LoadTracker, busy_tokens: int,
                 max_waiting: int, timeout_s: float, heavy_fraction: float, heavy_subset: bool) -> None:
        self.model = model
        self._backends = backends
        self._loads = loads
        self.busy_tokens = busy_tokens
        self.heavy_tokens = busy_tokens * heavy_fraction
        """The busy threshold a heavy tenant's requests see (see the module docstring)."""
        self.heavy_subset = heavy_subset
        """Whether a heavy tenant keeps to its own backends (:meth:`subset`; a lab knob)."""
        self._shares = Shares(SHARE_WINDOW)
        self._tenants = 1
        self._recount_at = 0
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._bands: dict[int, collections.OrderedDict[str, list[tuple[float, int, Pass]]]] = {}
        """Priority band -> tenant in turn -> that tenant's heap of (deadline, arrival number, pass)."""
        self.depth = 0
        self._task: asyncio.Task[None] | None = None
        self._wait_ewma = 0.0
        self._size_ewma = 0.0
        self._arrivals = itertools.count()

    def least_queued(self) -> float:
        """The fewest prompt tokens queued for prefill on a healthy backend of the model: what
        the router's requests there before their first token add up to, plus the waiting
        requests the engine's last scrape showed beyond those. 0 with no healthy backend:
        nothing to wait for (the request path answers that no backend can take it)."""
        names = self._backends()
        least = math.inf if names else 0.0
        for name in names:
            least = min(least, self.queued(name))
        return least

    def queued(self, name: str) -> float:
        """Prompt tokens queued for prefill on backend ``name`` (see :meth:`least_queued`)."""
        load = self._loads.get(name)
        queued = load.prefill_tokens
        if load.scraped_unseen > 0:
            waiting = len(load.prefilling)
            mean = load.prefill_tokens / waiting if waiting else self.busy_tokens / 4
            queued += load.scraped_unseen * mean
        return queued

    def has_room(self, size: int, own: frozenset[str] | None) -> bool:
        """Whether a heavy tenant's request of ``size`` uncached tokens may go: no backend outside
        its own ``own`` (:meth:`subset`; None: all) has a backlog over the headroom
        (:meth:`gives_way`), and one of its own has nothing queued, or stays under the headroom with it."""
        if own is not None and self.gives_way(own):
            return False
        names = own or self._backends()
        return any(room(self.queued(name), size, self.heavy_tokens) for name in names)

    def gives_way(self, own: frozenset[str]) -> bool:
        """Whether a heavy tenant with its own backends ``own`` waits for the others: a backend
        outside them has more than the headroom queued for prefill (see the module docstring)."""
        return any(self.queued(name) > self.heavy_tokens for name in self._backends() if name not in own)

    def subset(self, tenant: str) -> frozenset[str] | None:
        """A heavy tenant's own backends: as many of the model's ``N`` routable ones as ``N`` x
        its share of the recent arrivals, rounded (at least one), those that rank first by a
        hash of (tenant, backend) (rendezvous hashing); None when that is all of them, or
        ``queue_heavy_subset`` is off (see the module docstring)."""
        if not self.heavy_subset or self._shares.total <= 0:
            return None
        names = self._backends()
        k = math.floor(len(names) * self._shares.of(tenant) / self._shares.total + 0.5)
        if k >= len(names):
            return None
        return frozenset(_ranked(tenant, tuple(names))[:max(1, k)])

    def heavy(self, tenant: str) -> bool:
        """Whether ``tenant`` sent more than ``HEAVY_SHARE`` times its fair share of the recent arrivals."""
        shares = self._shares
        if shares.counted >= self._recount_at:  # the tenants seen lately, recounted every 16 arrivals (sooner at first)
            self._recount_at = shares.counted + min(16, 1 + shares.counted // 4)
            self._tenants = max(1, shares.active(0.5))
        return shares.of(tenant) > HEAVY_SHARE * shares.total / self._tenants

    async def admit(self, priority: int, tenant: str, disconnected: Callable[[], Awaitable[Any]] | None,
                    prefill_tokens: Callable[[], Awaitable[int]] | None = None) -> Pass:
        """Return at once while nobody waits and a backend is not busy; else wait in turn.
        ``prefill_tokens``: the prompt tokens no backend holds, asked only of a request that
        waits, which orders a tenant's waiting requests (shortest first, aged by their wait)."""
        self._shares.count(tenant)
        if self.depth == 0:
            least = self.least_queued()
            if least <= self.busy_tokens and not self.heavy(tenant):
                return OPEN
        size = await prefill_tokens() if prefill_tokens is not None else 0  # before the bound: it may await
        if self.depth == 0:  # a heavy tenant's, or any request while every backend is busy (no room then)
            own = self.subset(tenant)
            if self.has_room(size, own):
                return Pass(self, within=self.heavy_tokens, size=size, allowed=own)
            if self.least_queued() <= self.busy_tokens:
                metrics.child(metrics.QUEUE_HEAVY_HELD, self.model).inc()
                if own is not None and self.gives_way(own):
                    metrics.child(metrics.QUEUE_HEAVY_YIELDED, self.model).inc()
        if self.depth >= self.max_waiting:
            self._count("full")
            raise Overloaded(f"the router's queue for model {self.model!r} is full ({self.depth} waiting)",
                             retry_after_s=self._retry_after(), code="queue_full")
        now = time.monotonic()
        p = Pass(self, priority, tenant, now, self._deadline(now, size), asyncio.get_running_loop().create_future(),
                 size=size)
        self._push(p)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._dispatch_forever())
        assert p.released is not None
        gone = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        try:
            waiters: set[asyncio.Future[Any]] = {p.released, gone} if gone is not None else {p.released}
            finished, _ = await asyncio.wait(waiters, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._leave(p, "cancelled")
            raise
        finally:
            if gone is not None:
                gone.cancel()
        if p.released.done():  # let through (at the deadline too: it goes)
            if self.heavy(tenant):
                p.within, p.allowed = self.heavy_tokens, self.subset(tenant)
            p.waited = waited = time.monotonic() - p.arrived
            self._wait_ewma += 0.1 * (waited - self._wait_ewma)
            metrics.child(metrics.QUEUE_WAIT, self.model).observe(waited)
            self._count("dispatched")
            return p
        if gone is not None and gone in finished:
            self._leave(p, "cancelled")
            raise ClientClosed("the client closed the connection while its request waited in the router's queue")
        self._leave(p, "timeout")
        raise Overloaded(f"waited {self.timeout_s:g} s in the router's queue for model {self.model!r}",
                         retry_after_s=self._retry_after(), code="queue_timeout")

    def _deadline(self, now: float, prefill_tokens: int) -> float:
        """Arrival plus the recent wait times this request's share of the mean prefill."""
        size = max(0, prefill_tokens)
        self._size_ewma = size if self._size_ewma <= 0 else self._size_ewma + 0.1 * (size - self._size_ewma)
        return now + (self._wait_ewma * size / self._size_ewma if self._size_ewma > 0 else 0.0)

    def _push(self, p: Pass) -> None:
        band = self._bands.setdefault(p.priority, collections.OrderedDict())
        heapq.heappush(band.setdefault(p.tenant, []), (p.deadline, next(self._arrivals), p))
        self._resize(1)

    def _pop(self) -> Pass | None:
        """The next request: the lowest priority band, its next tenant in turn that is not
        heavy or whose next request has room on its backends (:meth:`has_room`), that tenant's earliest
        deadline (the tenant then moves to the back of the band's rotation)."""
        while self._bands:
            prio = min(self._bands)
            band = self._bands[prio]
            tenant = next((t for t in band
                           if not self.heavy(t) or self.has_room(band[t][0][2].size, self.subset(t))), None)
            if tenant is None:
                return None
            line = band[tenant]
            p = heapq.heappop(line)[2]
            band.move_to_end(tenant)
            if not line:
                del band[tenant]
            if not band:
                del self._bands[prio]
            self._resize(-1)
            if p.released is not None and not p.released.done():
                return p
        return None

    def _leave(self, p: Pass, outcome: str) -> None:
        """Take ``p`` out (its wait ended without a release), if it is still in."""
        band = self._bands.get(p.priority)
        line = band.get(p.tenant) if band is not None else None
        at = next((i for i, entry in enumerate(line) if entry[2] is p), None) if line is not None else None
        if line is not None and at is not None:
            del line[at]
            heapq.heapify(line)
            if not line:
                del band[p.tenant]  # type: ignore[union-attr]
            if not band:
                del self._bands[p.priority]
            self._resize(-1)
        p.taken()
        self._count(outcome)

    async def _dispatch_forever(self) -> None:
        """Let one request through whenever a backend is not busy, until nobody waits."""
        while self.depth:
            least = self.least_queued()
            if least > self.busy_tokens:
                await asyncio.sleep(POLL_S)
                continue
            p = self._pop()
            if p is None:
                if self.depth:  # only heavy tenants wait: they wait for room
                    await asyncio.sleep(POLL_S)
                    continue
                break
            assert p.released is not None
            p.released.set_result(None)
            try:
                await asyncio.wait_for(p.done.wait(), TAKEN_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass

    def _resize(self, by: int) -> None:
        self.depth += by
        metrics.child(metrics.QUEUE_DEPTH, self.model).set(self.depth)

    def _retry_after(self) -> int:
        """Seconds a client should wait before trying again: the recent queue wait, at least 1."""
        return max(1, math.ceil(self._wait_ewma))

    def _count(self, outcome: str) -> None:
        metrics.child(metrics.QUEUE_OUTCOMES, self.model, outcome).inc()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


@functools.lru_cache(maxsize=256)
def _ranked(tenant: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` in ``tenant``'s rendezvous order: by a hash of (tenant, backend) that every
    process computes alike (``hash`` is salted per process). Cached: the queue asks again on
    every poll while a heavy tenant waits, and the backends seldom change."""
    return tuple(sorted(names, key=lambda b: hashlib.blake2b(f"{tenant}\0{b}".encode(), digest_size=8).digest()))


def room(queued: float, size: int, headroom: float) -> bool:
    """A backend with ``queued`` prompt tokens before their first token has room for a heavy
    tenant's request of ``size`` uncached tokens: nothing queued, or under ``headroom`` with it."""
    return queued <= 0 or queued + size <= headroom


def priority_of(body: dict[str, Any]) -> int:
    """vLLM's ``priority`` (lower first); anything but an int counts as 0 (vLLM refuses it)."""
    p = body.get("priority", 0)
    return p if isinstance(p, int) and not isinstance(p, bool) else 0


def tenant_of(body: dict[str, Any], authorization: str | None, configured: str | None = None) -> str:
    """The configured tenant the client's key named (``router.tenants``: a client cannot
    claim another's turn), else the body's ``user``, else a hash of the client's credentials
    (never the key itself)."""
    if configured is not None:
        return "tenant:" + configured
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    if authorization:
        return "key:" + hashlib.sha256(authorization.encode()).hexdigest()[:16]
    return ""
