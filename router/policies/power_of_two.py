"""power_of_two: sample two routable backends at random, take the less loaded.

Load is the in-flight request count (the engine's scraped count when it sees more
than the router). Two random choices avoid the herd effect of always picking the
global minimum from a stale view while staying O(1) per request.
"""

from __future__ import annotations

import random

from router.policies.base import Candidate, Decision, RequestCtx, healthy, in_flight_tokens, mark_unroutable


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision:
        pool = healthy(candidates)
        sampled = self._rng.sample(pool, min(2, len(pool)))
        for c in candidates:
            c.score = c.load.effective_in_flight() + in_flight_tokens(c, ctx.block_size) * 1e-9
        mark_unroutable(candidates)
        sampled.sort(key=lambda c: c.score)
        rest = sorted((c for c in pool if c not in sampled), key=lambda c: c.score)
        order = [c.backend for c in sampled + rest]
        return Decision(order[0], "power_of_two", order)

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        return None
