"""The request path, top to bottom: parse, resolve model, plan, look up, choose, order, send, settle.

Every OpenAI request takes these stages in this order, each in a module of its own (the
other modules' docstrings use these numbers and names):

1. **parse** (:mod:`router.parse`): the bounded body, decoded once; the fields routing reads;
2. **resolve model** (:mod:`router.runtime`): the served name to its model (and LoRA key);
3. **plan** (:mod:`router.plans`): which block keys to route on: every id of the prompt,
   or part of them (a cold prompt's first block, a seen history's cached ids, a
   remembered history's keys) with the rest owed to the background;
4. **look up** (the index, :mod:`indexer.index`): leading blocks per backend and tier;
   with the admission queue on, a request first waits while every backend is busy
   (:mod:`router.admission`), so its look up and choice are made when it may go;
5. **choose** (:mod:`router.choose`): candidates with their load; the policy decides;
6. **order** (:mod:`router.fleet.stream`, replicas only): the decision committed to the
   fleet-state log the replicas share, decided again if other replicas' decisions
   overtook it (:meth:`RequestPath.order`);
7. **send** (:mod:`router.attempt`, :mod:`router.http.proxy`): each try an attempt that owns
   its load ticket and the policy's commit; the original bytes to its backend, retried on
   the next before any byte came back, relayed as they arrive;
8. **settle** (:mod:`router.settle`): what the plan owes, on the background thread.

Stages 1-5 are pure deciding (:meth:`RequestPath.decide`): they change no routing state,
count nothing and start nothing, so ``POST /debug/route`` runs them too (on the exact ids).
Stages 6-8 act (:meth:`RequestPath.order`, :meth:`RequestPath.send`): the replicas' order,
the load ticket, the policy's commit, the counters, the owed work and the proxied exchange.

Completions with a list of prompts are routed on the first prompt (all are checked
against ``max_model_len``): vLLM schedules each prompt as its own request, so only one
of them can decide the backend, and batches usually share their prefix anyway.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from indexer.index import Index, Worker
from router import metrics
from router.admission import OPEN, ModelQueue, Pass, priority_of, tenant_of
from router.attempt import Attempts
from router.choose import Decided, candidates, commit, prefill_tokens, uncached
from kvconfig import RouterSettings
from router.http.errors import NoHealthyBackend
from router.fleet.log import Decided as DecidedRecord
from router.fleet.load import LoadTracker, next_ticket
from router.parse import session_key, validate_fields
from router.plans import Deferred, ExactIds, Plan, Planner, Query
from router.policies.base import RequestCtx
from router.prompt.prompt_ids import observe_ids
from router.http.proxy import ProxyResponse, Upstream, Upstreams
from router.runtime import ModelRuntime, Models
from router.settle import Settler

if TYPE_CHECKING:
    from router.fleet.stream import FleetStream


@dataclass(slots=True)
class RequestPath:
    """The stages wired together for one router (built by :class:`router.core.Router`)."""

    settings: RouterSettings
    models: Models
    index: Index
    loads: LoadTracker
    upstreams: Upstreams
    planner: Planner
    settler: Settler
    streams: metrics.StreamView
    fed_models: set[str] = field(default_factory=set)
    """Models whose index another process's subscriber fills (``kvrouter indexer`` into
    Redis) and holds blocks of their backends: events count as connected for them
    (kept by :meth:`router.core.Router._watch_index_feed`)."""
    stream: FleetStream | None = None
    """The replicas' fleet-state log, which orders their decisions (``router.fleet_state``; set at start)."""
    queues: dict[str, ModelQueue] = field(default_factory=dict)
    """Each model's admission queue, when ``router.queue_busy_tokens`` turns it on."""

    async def decide(self, body: dict[str, Any], raw_len: int, kind: str, headers: Any, *, act: bool = False,
                     disconnected: Callable[[], Awaitable[Any]] | None = None, tenant: str | None = None) -> Decided:
        """Stages 2-5 for a parsed body. With ``act`` (a request about to be sent) the plan
        may defer tokenizing, the request may wait in the admission queue (until
        ``disconnected`` returns, at most), and it waits, bounded, for one with the same
        new first block that is still settling; without it (``/debug/route``) the plan is
        always the exact ids, the answer the contract promises. ``tenant``: the configured
        tenant the client's key named (``router.tenants``), whom the queue serves in turn."""
        started = time.perf_counter()
        rt, lora = self.models.resolve(body)  # 2. resolve model
        salt = validate_fields(body, kind)
        q = Query(rt, body, kind, raw_len, lora, salt)
        plan = await self.planner.plan(q) if act else await self.planner.exact(q)  # 3. plan
        planned = time.perf_counter()
        queue = self.queues.get(rt.name) if act else None
        admitted = OPEN
        if queue is not None:  # 4. look up, once the queue lets it through
            admitted = await queue.admit(priority_of(body), tenant_of(body, headers.get("authorization"), tenant),
                                       disconnected, partial(self._uncached, rt, plan))
        try:
            d = await self._choose(q, plan, headers, act, started, admitted)
        except BaseException:
            admitted.taken()
            raise
        d.admitted, d.started, d.planned = admitted, started, planned
        return d

    async def _choose(self, q: Query, plan: Plan, headers: Any, act: bool, started: float,
                      admitted: Pass = OPEN) -> Decided:
        """Stages 4 and 5 (see :meth:`decide`); ``admitted`` confines a heavy tenant's request
        to the backends with room for it (:meth:`router.admission.Pass.confine`)."""
        rt, body = q.rt, q.body
        hits: dict[Worker, dict[str, int]] = {}  # 4. look up
        lookup_s = 0.0
        if isinstance(plan, Deferred):
            if act and plan.keys:
                # A request whose first block is still settling (an earlier turn sent on its
                # head) waits for it, bounded: the segment cache may already hold that turn's
                # text while the policy has not yet learned its keys, and a decision in that
                # gap would send the conversation elsewhere.
                await self.settler.after_pending(rt.name, plan.keys[0])
            hits, lookup_s = await self._look_up(rt, plan.keys)
            if not plan.holds(rt, hits, self.settler.known):
                plan = await self.planner.exact(q, plan.prompt, "known")
        if isinstance(plan, ExactIds) and plan.keys:
            if act:
                await self.settler.after_pending(rt.name, plan.keys[0])
            hits, lookup_s = await self._look_up(rt, plan.keys)
        cands = candidates(rt, hits, self.upstreams.pool, self.loads)  # 5. choose
        confined = admitted.confine(cands)
        if not any(c.healthy for c in cands):
            raise NoHealthyBackend(f"no healthy backend for model {rt.name!r}")
        ctx = RequestCtx(
            model=rt.name,
            num_tokens=plan.num_tokens,
            block_size=rt.config.block_size,
            keys=plan.keys,
            session_key=session_key(body, headers, self.settings.session_header),
            events_connected=rt.has_events and (rt.name in self.fed_models or self.streams.connected(rt.backends)),
        )
        if rt.engines is not None:
            await rt.engines.observe(ctx, cands, plan.token_ids, body, q.kind)
        decision = rt.policy.choose(ctx, cands)
        if confined:
            metrics.child(metrics.QUEUE_HEAVY_CONFINED, rt.name).inc()
            decision.order += [b for b in confined if b not in decision.order]  # still there to fail over to
        if isinstance(plan, ExactIds) and plan.unsupported:
            decision.reason = "fallback"
        decision.detail["prepare_s"] = time.perf_counter() - started
        if isinstance(plan, Deferred):
            decision.detail["deferred_tokens"] = plan.num_tokens
        return Decided(q, plan, ctx, cands, decision, lookup_s)

    async def order(self, d: Decided) -> None:
        """Stage 6, *order*, replicas only: commit the decision to the fleet-state log all
        replicas share, deciding again if other replicas' decisions overtook it
        (:meth:`router.fleet.stream.FleetStream.order`): kv_aware's decisions with a choice to
        make. :meth:`send` must follow at once, without an ``await`` in between."""
        stream = self.stream
        if stream is None or d.rt.policy.name != "kv_aware" or sum(c.healthy for c in d.candidates) < 2:
            return

        d.ticket = next_ticket()

        def record() -> DecidedRecord:
            backend = d.decision.backend
            chosen = next(c for c in d.candidates if c.backend == backend)
            prefill = uncached(d.ctx.num_tokens, chosen, d.ctx.block_size)
            load = self.loads.preview(backend, d.ctx.keys, prefill)
            return DecidedRecord(d.rt.name, backend, load, d.ctx.keys, d.ticket)

        d.ordered = await stream.order(record, lambda: self._decide_again(d))

    def _decide_again(self, d: Decided) -> None:
        """Stage 5 again, on the same lookup, with the load and prefixes counted since."""
        for c in d.candidates:
            c.load = self.loads.get(c.backend)
        before = d.decision
        d.decision = d.rt.policy.choose(d.ctx, d.candidates)
        if before.reason == "fallback":
            d.decision.reason = "fallback"
        for key in ("prepare_s", "deferred_tokens"):
            if key in before.detail:
                d.decision.detail[key] = before.detail[key]

    async def _uncached(self, rt: ModelRuntime, plan: Plan) -> int:
        """The prompt tokens no backend holds, by the index now: what orders a request in the
        admission queue (looked up again when it is let through, on the index of that moment)."""
        if not plan.keys:
            return plan.num_tokens
        hits, _ = await self._look_up(rt, plan.keys)
        held = max((sum(tiers.values()) for tiers in hits.values()), default=0)
        return max(0, plan.num_tokens - held * rt.config.block_size)

    async def _look_up(self, rt: ModelRuntime, keys: list[int]) -> tuple[dict[Worker, dict[str, int]], float]:
        t0 = time.perf_counter()
        hits = await self.index.lookup(rt.name, keys)
        return hits, time.perf_counter() - t0

    def send(
        self, d: Decided, path: str, raw: bytes, headers: dict[str, str], client_authorization: str | None, started: float,
    ) -> ProxyResponse:
        """Stages 7 and 8: open the first attempt (the load ticket on the chosen backend, the
        policy's commit), count the decision, schedule what the plan owes, and hand the
        original bytes to the proxy. Everything before the proxy's first await runs now, so
        the next decision already sees this request (its load, its remembered prefix, its
        pending settle)."""
        up, order, rt = self.upstreams, d.decision.order, d.rt
        started += d.admitted.waited  # the router's overhead leaves out the time it queued
        attempts = Attempts(up.pool, up.loads, up.retries, order, rt.name, rt.policy.name, started,
                            keys=d.ctx.keys, prefill=prefill_tokens(d.ctx, d.candidates), commit=partial(commit, d))
        try:
            first = attempts.open(d.decision.backend, announced=d.ordered, ticket=d.ticket)  # 7. send
            _count(d)
            attempts.on_done = d.plan.owe(self.settler, d, first.ticket)  # 8. settle
            return ProxyResponse(up, Upstream(
                path, raw, headers, order, rt.name, rt.policy.name, started,
                stream=d.q.body.get("stream") is True,
                reason=d.decision.reason if self.settings.expose_decision_headers else None,
                client_authorization=client_authorization,
            ), attempts)
        except BaseException:
            # The proxy ends the attempt once it owns it; until then nothing would, and a
            # leaked ticket is phantom load on the backend for the router's lifetime.
            attempts.abandon()
            raise


def _count(d: Decided) -> None:
    """The plan's outcome and what planning and looking up cost, for a request really sent."""
    name, plan = d.rt.name, d.plan
    if plan.outcome is not None:
        metrics.child(metrics.COLD_PATH, name, plan.outcome).inc()
    if isinstance(plan, ExactIds) and not plan.unsupported:
        observe_ids(d.rt, plan.ids)
    if d.lookup_s:
        metrics.child(metrics.LOOKUP_SECONDS, name).observe(d.lookup_s)
