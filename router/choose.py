"""Stage 5 of the request path, *choose* (pure), and the decision's *commit* (acting, in stage 7).

:func:`candidates` turns the index's answer (leading blocks per worker and tier) into one
:class:`~router.policies.base.Candidate` per configured backend, healthy or not, with
its live load; the model's policy chooses among them. :func:`commit` is the other half,
run only for a request that is really sent, by each of its attempts
(:class:`router.attempt.Attempts`, stage 7, *send*): the policy learns the decision
(round-robin cursors, remembered prefixes) and the decision metrics are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from indexer.index import Worker
from router import metrics
from router.admission import OPEN, Pass
from router.fleet.backends import BackendPool
from router.fleet.load import LoadTracker
from router.http import observe
from router.plans import Plan, Query
from router.policies.base import Candidate, Decision, RequestCtx
from router.runtime import ModelRuntime


def candidates(rt: ModelRuntime, hits: dict[Worker, dict[str, int]], pool: BackendPool, loads: LoadTracker) -> list[Candidate]:
    """Every backend of the model, with the best data-parallel rank's hits (any tier,
    and weighted by tier)."""
    best: dict[str, tuple[int, float, int]] = {}
    tiers = rt.tier_weights
    for worker, media in hits.items():
        matched = sum(media.values())
        weighted = sum(n * tiers.get(m.upper(), tiers["STORAGE"]) for m, n in media.items())
        prev = best.get(worker.backend)
        if prev is None or (matched, weighted) > prev[:2]:
            best[worker.backend] = (matched, weighted, worker.dp_rank)
    out = []
    for name in rt.backends:
        matched, weighted, rank = best.get(name, (0, 0.0, 0))
        out.append(Candidate(name, pool.get(name).routable, loads.get(name), matched, weighted, 0, rank))
    return out


def uncached(n: int, c: Candidate, bs: int) -> int:
    """Tokens of an ``n``-token prompt that ``c`` would prefill: all but its hit blocks,
    capped like vLLM, which always recomputes the last token."""
    cap = (n - 1) // bs if n > 0 else 0
    return n - min(max(c.matched_blocks, c.speculative_blocks), cap) * bs


def prefill_tokens(ctx: RequestCtx, cands: list[Candidate]) -> dict[str, int]:
    """Uncached prompt tokens per backend: the prefill work each would queue there
    (blocks the router itself just sent there count as cached: see kv_aware)."""
    return {c.backend: uncached(ctx.num_tokens, c, ctx.block_size) for c in cands}


def commit(d: Decided, backend: str) -> None:
    """The request is being sent to ``backend``: let the policy learn, count the decision."""
    rt, ctx, cands, decision = d.rt, d.ctx, d.candidates, d.decision
    name = rt.name
    d.backend = backend
    note = observe.current()
    if note is not None:
        note.model = name
        note.reason = decision.reason if backend == decision.backend else "fallback"
        if d.admitted.waited:
            note.queue_wait = d.admitted.waited
        note.routed(d)
    if backend != decision.backend:
        # A retry after the chosen backend failed before answering.
        rt.policy.commit(ctx, Decision(backend, "fallback", decision.order))
        metrics.child(metrics.DECISIONS, name, rt.policy.name, "fallback").inc()
        return
    rt.policy.commit(ctx, decision)
    metrics.child(metrics.DECISIONS, name, rt.policy.name, decision.reason).inc()
    chosen = next(c for c in cands if c.backend == backend)
    metrics.child(metrics.MATCHED_BLOCKS, name).observe(chosen.matched_blocks)
    if ctx.num_tokens:
        cached = chosen.predicted_cached_tokens(ctx.num_tokens, ctx.block_size)
        metrics.child(metrics.PREDICTED_HIT_RATIO, name).observe(cached / ctx.num_tokens)
        if note is not None:
            note.predicted_cached = cached
    if ctx.keys and rt.has_events and all(c.matched_blocks == 0 for c in cands):
        metrics.child(metrics.ZERO_BLOCK_REQUESTS, name).inc()


@dataclass(slots=True)
class Decided:
    """A request planned, looked up and decided: what sending it and settling it need."""

    q: Query
    plan: Plan
    ctx: RequestCtx
    candidates: list[Candidate]
    decision: Decision
    lookup_s: float = 0.0
    backend: str = ""
    """Where it was sent last (a retry moves it): set by :func:`commit`."""
    ordered: bool = False
    """Committed to the replicas' fleet-state log before it was sent (:mod:`router.fleet.stream`)."""
    ticket: int | None = None
    """The name its load ticket takes, when the record committed first gave it one."""
    admitted: Pass = OPEN
    """Its way through the router's admission queue; whoever sends it calls ``taken()`` once
    :meth:`router.request_path.RequestPath.send` returned (the load ticket is held), or it failed."""
    started: float = 0.0
    planned: float = 0.0
    """When deciding it began and when its plan was made (``time.perf_counter()``): the stage
    boundaries a request's trace shows (:mod:`router.http.spans`)."""

    @property
    def rt(self) -> ModelRuntime:
        return self.q.rt

    @property
    def token_ids(self) -> list[int]:
        return self.plan.token_ids
