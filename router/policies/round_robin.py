"""round_robin: each routable backend in turn, skipping unhealthy ones."""

from __future__ import annotations

from router.policies.base import Candidate, Decision, RequestCtx, healthy, mark_unroutable


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision:
        n = len(candidates)
        for i in range(n):
            c = candidates[(self._cursor + i) % n]
            c.score = float(i)
        mark_unroutable(candidates)
        order = [c.backend for c in sorted(healthy(candidates), key=lambda c: c.score)]
        return Decision(order[0], "round_robin", order)

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        self._cursor += 1
