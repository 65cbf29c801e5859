"""least_loaded: the backend with the fewest in-flight tokens.

In-flight tokens = prompt tokens awaiting prefill + KV tokens of running sequences
(unique blocks × block size), both tracked by the router itself; ties go to the
backend with fewer requests by the engine's own count, then at random.
"""

from __future__ import annotations

import random

from router.policies.base import Candidate, Decision, RequestCtx, by_score, in_flight_tokens, mark_unroutable


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision:
        for c in candidates:
            c.score = in_flight_tokens(c, ctx.block_size) + c.load.effective_in_flight() * 1e-3
        mark_unroutable(candidates)
        order = by_score(candidates, self._rng)
        return Decision(order[0], "least_loaded", order)

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        return None
