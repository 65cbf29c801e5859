"""kv_aware (the default): exact prefix-cache hits from the index, balanced against load.

The cost of sending a request of ``n`` tokens (``N = ceil(n / B)`` blocks of ``B``
tokens) to backend ``b``, lower is better, in KV blocks::

    hit_b      = min(max(Σ_tier w_tier · blocks_tier(b), spec(b)), (n - 1) // B)
    uncached_b = n - hit_b · B
    queue_b    = max(0, prefill_tokens(b) - inflight_hit(b) · B)
    cost_b     = w_prefill · (uncached_b + queue_b) / B
               + w_decode  · (active_blocks(b) + N - matched(b))
               + w_context · (context_blocks(b) + N)

- ``blocks_tier(b)``: leading blocks the index says ``b`` holds, weighted by tier
  (GPU 1.0, CPU ``cpu_tier``, storage ``storage_tier``); a block found in a slower tier
  saves less than one on the GPU. For a data-parallel backend the best rank counts
  (vLLM's own DP balancer places the request on a rank; the router cannot pick it).
- ``spec(b)``: leading blocks the router *sent* to ``b`` within ``speculative_ttl_s``
  (speculative insertion), so a burst sharing a new prefix follows its first request
  before the engine's events for it arrive.
- The cap at ``(n - 1) // B`` is vLLM's: the last token is always recomputed.
- ``prefill_tokens(b)``: uncached prompt tokens of requests the router sent to ``b``
  that have not produced a first token yet (Dynamo's "prefill tokens already queued").
  ``inflight_hit(b)`` are this request's prefix blocks that are *being* prefilled there
  by an earlier request: that part of the queue is work this request would wait for
  anyway and then share, so it is not charged twice. It is read off this process's
  tickets (:meth:`router.fleet.load.BackendLoad.shared_prefill_blocks`), so it stays the same
  when the engine's events index those blocks mid-prefill; ``spec(b) - matched(b)``
  (blocks sent lately, not indexed yet) is a floor for requests other workers and
  replicas sent.
- ``active_blocks(b)``: unique KV blocks held by the router's in-flight requests on ``b``
  (shared prefixes counted once); ``N - matched(b)`` the blocks this request would add.
- ``context_blocks(b)``: prompt blocks of those requests counted once *per request*, what
  decode attention reads every step (``w_context`` is 0 unless configured).

This is Dynamo's KV router shape (``overlap_weight · prefill_blocks + decode_blocks``)
with tier weights and the in-flight-prefix correction added.

Choice: the lowest cost. Ties are broken by a hash of the request's first block key and the
backend's name, the same in every worker and replica: two processes deciding the first
requests of a burst on a new prefix at the same instant, before either sees the other's
decision, pick the same backend instead of a random one each (requests of unrelated
prefixes still spread). With ``temperature > 0`` a softmax over costs normalised to [0, 1]
samples instead (spreads load across near-equal backends).

No load guard or request-share cap: the cost above already charges a backend for the prefill
queued on it, and both heuristics, which moved requests on request counts rather than queued
tokens, measured level or worse than the cost alone on held-out capacity at SLO and beside a
noisy tenant (docs/benchmarks.md, "kv_aware's cost").

Reasons: ``cache_hit`` (chosen backend holds the longest indexed prefix),
``speculative_hit`` (only the router's recent decisions put it there), ``load_balance``
(another backend held more, load outweighed it), ``no_events`` (no backend of the model
has a connected event stream and nothing was sent recently), ``no_hit`` (events flow,
nobody holds the prefix).
"""

from __future__ import annotations

import math
import random
import zlib

from kvconfig import KvAwareWeights
from router.policies.approx_index import ApproxPrefixIndex
from router.policies.base import Candidate, Decision, RequestCtx, healthy, mark_unroutable
from router.tuning import KvAwareTuning

_M64 = (1 << 64) - 1


class KvAware:
    name = "kv_aware"

    def __init__(self, weights: KvAwareWeights, memory: ApproxPrefixIndex,
                 tuning: KvAwareTuning | None = None, rng: random.Random | None = None) -> None:
        """``memory``: where the router sent prefixes lately (speculative insertion); it also
        holds the other router processes' decisions (:mod:`router.fleet.log`)."""
        self.w = weights
        self.t = tuning or KvAwareTuning()
        self.speculative = memory
        self._rng = rng or random.Random()
        self._salts: dict[str, int] = {}

    def _tie(self, backend: str, key: int) -> int:
        """A tie-break rank every process computes alike (``hash(str)`` is salted per
        process): splitmix64's finaliser over the key and a per-backend salt."""
        salt = self._salts.get(backend)
        if salt is None:
            salt = self._salts[backend] = zlib.crc32(backend.encode())
        x = (key ^ (salt << 32 | salt)) & _M64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
        return x ^ (x >> 31)

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision:
        w = self.w
        n = ctx.num_tokens
        bs = ctx.block_size
        n_blocks = -(-n // bs)
        cap = (n - 1) // bs if n > 0 else 0
        spec = self._speculative_hits(ctx)
        for c in candidates:
            s = spec.get(c.backend, 0)
            c.speculative_blocks = s
            matched = max(c.matched_blocks, s)
            hit = min(max(c.weighted_blocks, float(s)), float(cap))
            shared = c.load.shared_prefill_blocks(ctx.keys, bs) if c.load.prefilling else 0
            inflight_hit = max(shared, s - c.matched_blocks)
            queue = max(0, c.load.prefill_tokens - inflight_hit * bs) * self.t.queue_weight
            c.score = (w.prefill * ((n - hit * bs) + queue) / bs + w.decode * (c.load.active_blocks + n_blocks - matched)
                       + self.t.context * (c.load.context_blocks + n_blocks))
        mark_unroutable(candidates)
        pool = healthy(candidates)
        ranked = sorted(pool, key=lambda c: c.score)
        if len(ranked) > 1 and ranked[1].score == ranked[0].score:
            first = ctx.keys[0] if ctx.keys else self._rng.getrandbits(64)
            tied = [c for c in ranked if c.score == ranked[0].score]
            tied.sort(key=lambda c: self._tie(c.backend, first))
            ranked[:len(tied)] = tied
        chosen = self._sample(ranked) if self.t.temperature > 0 and len(ranked) > 1 else ranked[0]
        order = [chosen.backend] + [c.backend for c in ranked if c is not chosen]
        reason = self._reason(chosen, pool, ctx)
        detail: dict[str, float | int | str] = {"cost": chosen.score, "matched_blocks": chosen.matched_blocks, "speculative_blocks": chosen.speculative_blocks}
        return Decision(chosen.backend, reason, order, detail)

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        self.remember(ctx.keys, decision.backend)

    def _speculative_hits(self, ctx: RequestCtx) -> dict[str, int]:
        """``spec(b)``: leading blocks of the request the router sent to each backend lately."""
        return self.speculative.match(ctx.keys) if len(self.speculative) else {}

    def remember(self, keys: list[int], backend: str) -> None:
        """Speculative insertion (also of a deferred request's keys once they are known)."""
        self.speculative.insert(keys, backend)

    def remembers(self, keys: list[int]) -> bool:
        """Whether the router sent the prefix ``keys`` somewhere recently."""
        return bool(self.speculative.match(keys)) if len(self.speculative) else False

    def forget(self, backend: str) -> None:
        self.speculative.forget(backend)

    def _sample(self, ranked: list[Candidate]) -> Candidate:
        lo, hi = ranked[0].score, ranked[-1].score
        span = (hi - lo) or 1.0
        weights = [math.exp(-((c.score - lo) / span) / self.t.temperature) for c in ranked]
        return self._rng.choices(ranked, weights=weights)[0]

    @staticmethod
    def _reason(chosen: Candidate, pool: list[Candidate], ctx: RequestCtx) -> str:
        most = max(max(c.matched_blocks, c.speculative_blocks) for c in pool)
        mine = max(chosen.matched_blocks, chosen.speculative_blocks)
        if most == 0:
            return "no_hit" if ctx.events_connected else "no_events"
        if mine < most:
            return "load_balance"
        return "cache_hit" if chosen.matched_blocks >= chosen.speculative_blocks else "speculative_hit"
