"""random: a uniformly random routable backend (the baseline every other policy must beat)."""

from __future__ import annotations

import random

from router.policies.base import Candidate, Decision, RequestCtx, healthy, mark_unroutable


class RandomPolicy:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision:
        for c in candidates:
            c.score = self._rng.random()
        mark_unroutable(candidates)
        order = [c.backend for c in sorted(healthy(candidates), key=lambda c: c.score)]
        return Decision(order[0], "random", order)

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        return None
