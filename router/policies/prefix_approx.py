"""prefix_approx: cache affinity without KV events, from the router's own decisions.

Like SGLang's cache_aware and Dynamo's approximate mode, the router remembers which
backend it sent each prefix to (block keys with a TTL, :class:`ApproxPrefixIndex`) and
assumes the engine still caches it. A request goes to the backend that was sent the
longest prefix when that covers at least half the prompt, unless that backend is
overloaded (``imbalance_ratio`` × the least loaded + ``imbalance_slack`` requests);
otherwise to the least-loaded backend (in-flight tokens). Serves fleets whose engines
run without ``--kv-events-config``.

``matched_blocks`` in this policy's candidates is the remembered prefix length: the
approximate tree is its index.
"""

from __future__ import annotations

import random

from router.tuning import KvAwareTuning
from router.policies.approx_index import ApproxPrefixIndex
from router.policies.base import Candidate, Decision, RequestCtx, healthy, in_flight_tokens, mark_unroutable

MIN_MATCH_FRACTION = 0.5


class PrefixApprox:
    name = "prefix_approx"

    def __init__(self, memory: ApproxPrefixIndex, tuning: KvAwareTuning | None = None,
                 rng: random.Random | None = None) -> None:
        """``memory``: where the router sent each prefix (every router process's decisions);
        ``tuning``: its load guard's constants (``imbalance_ratio``, ``imbalance_slack``)."""
        self.tree = memory
        self.t = tuning or KvAwareTuning()
        self._rng = rng or random.Random()

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision:
        matches = self.tree.match(ctx.keys) if ctx.keys else {}
        for c in candidates:
            c.matched_blocks = matches.get(c.backend, 0)
            c.weighted_blocks = float(c.matched_blocks)
        pool = healthy(candidates)
        least = min(pool, key=lambda c: (in_flight_tokens(c, ctx.block_size), self._rng.random()))
        best = max(pool, key=lambda c: (c.matched_blocks, -in_flight_tokens(c, ctx.block_size), self._rng.random()))
        n_blocks = len(ctx.keys)
        reason = "no_hit"
        chosen = least
        if best.matched_blocks > 0 and best.matched_blocks >= MIN_MATCH_FRACTION * n_blocks:
            idlest = min(pool, key=lambda c: (c.load.effective_in_flight(), self._rng.random()))
            overloaded = best.load.effective_in_flight() > (
                self.t.imbalance_ratio * idlest.load.effective_in_flight() + self.t.imbalance_slack
            )
            chosen, reason = (idlest, "load_guard") if overloaded else (best, "approx_hit")
        for c in candidates:
            c.score = float(n_blocks - c.matched_blocks) + in_flight_tokens(c, ctx.block_size) / max(1, ctx.num_tokens)
        chosen.score = min(c.score for c in pool) - 1.0
        mark_unroutable(candidates)
        order = [chosen.backend] + [c.backend for c in sorted(pool, key=lambda c: c.score) if c is not chosen]
        return Decision(chosen.backend, reason, order, {"matched_blocks": chosen.matched_blocks})

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        self.remember(ctx.keys, decision.backend)

    def remember(self, keys: list[int], backend: str) -> None:
        self.tree.insert(keys, backend)

    def remembers(self, keys: list[int]) -> bool:
        return bool(self.tree.match(keys))

    def forget(self, backend: str) -> None:
        self.tree.forget(backend)
