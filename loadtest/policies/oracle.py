"""Policies that see every engine's exact state: the bench's reference and its ablations (simulator only).

``oracle`` sends each request where the simulator's own scheduler and latency model
predict the earliest first token (:mod:`loadtest.sim.state`), given each engine's exact
running batch, queue and cache at decision time and the requests this router sent that
have not arrived yet. It is the reachable reference ``kvrouter bench`` measures every
policy against: a policy's TTFT-p90 gain over round_robin as a fraction of the
oracle's. It is greedy, not a strict bound: it places each request as well as it can
now and plans nothing for the requests that follow (a policy that, say, keeps a hot
prefix's engine free for its next burst can beat it).

The ablations split kv_aware's gap to the oracle into what the router cannot know and
what its cost function gets wrong; each is kv_aware's cost (:mod:`router.policies.kv_aware`)
fed other inputs:

============================  =====================================  ==================================================
policy                        load                                   cache view
============================  =====================================  ==================================================
``kv_aware``                  the router's own (what it sent)        the index (KV events) + speculative (what it sent)
``kv_aware+exact_load``       the engine's queue, exact              the router's own
``kv_aware+exact_cache``      the router's own                       the engine's cached prefix + prefixes queued on it
``kv_aware+exact``            exact                                  exact
============================  =====================================  ==================================================

``kv_aware`` to ``kv_aware+exact``: same cost function, better information (stale
events, unseen load). ``kv_aware+exact`` to ``oracle``: same information, the cost
function against the engine's real scheduler.

They reach the engines through :class:`loadtest.policies.engine_state.SideChannel`, which
refuses to start against backends that do not serve it (a real vLLM).
"""

from __future__ import annotations

import random
from typing import Any

from kvconfig import KvAwareWeights
from router.policies.approx_index import ApproxPrefixIndex
from router.policies.base import UNROUTABLE, Candidate, Decision, RequestCtx, by_score, healthy, mark_unroutable
from loadtest.policies.engine_state import EngineState, SideChannel
from router.policies.kv_aware import KvAware
from router.tuning import KvAwareTuning

NO_PREDICTION = UNROUTABLE / 2
"""Score of a routable backend whose state could not be had (worse than any prediction)."""


class _ReadsEngines:
    """The side channel's part of :class:`router.policies.base.ReadsEngineState`: the states of
    the request being decided, asked by ``observe`` right before ``choose``."""

    name: str

    def __init__(self, channel: SideChannel) -> None:
        self.channel = channel
        self._states: dict[str, EngineState | None] = {}

    async def start(self) -> None:
        await self.channel.start(self.name)

    async def aclose(self) -> None:
        await self.channel.aclose()

    async def observe(self, ctx: RequestCtx, candidates: list[Candidate], token_ids: list[int],
                      body: dict[str, Any], kind: str) -> None:
        self._states = await self.channel.ask(id(ctx), token_ids, body, kind)
        self._apply(candidates)

    def _apply(self, candidates: list[Candidate]) -> None:
        """Show the engines' exact cached prefix as the candidates' hits (``/debug/route``)."""
        for c in candidates:
            st = self._states.get(c.backend)
            if st is not None:
                c.matched_blocks = st.gpu_blocks + st.cpu_blocks
                c.weighted_blocks = float(st.gpu_blocks + st.cpu_blocks)


class Oracle(_ReadsEngines):
    name = "oracle"

    def __init__(self, channel: SideChannel, rng: random.Random | None = None) -> None:
        super().__init__(channel)
        self._rng = rng or random.Random()

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision:
        for c in candidates:
            st = self._states.get(c.backend)
            c.score = NO_PREDICTION if st is None or st.predicted_ttft_s is None else st.predicted_ttft_s
        mark_unroutable(candidates)
        order = by_score(candidates, self._rng)
        chosen = next(c for c in candidates if c.backend == order[0])
        if chosen.score >= NO_PREDICTION:
            least = min(healthy(candidates), key=lambda c: (c.load.effective_in_flight(), self._rng.random()))
            order.remove(least.backend)
            return Decision(least.backend, "no_state", [least.backend, *order])
        return Decision(chosen.backend, "oracle", order, {"predicted_ttft_ms": round(chosen.score * 1000, 3)})

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        self.channel.sent(id(ctx), decision.backend)


class KvAwareExact(_ReadsEngines, KvAware):
    """kv_aware's cost with the engine's exact load, its exact cache view, or both."""

    def __init__(self, weights: KvAwareWeights, memory: ApproxPrefixIndex, channel: SideChannel, *,
                 load: bool, cache: bool, tuning: KvAwareTuning | None = None, rng: random.Random | None = None) -> None:
        if not (load or cache):
            raise ValueError("KvAwareExact needs exact load, exact cache or both")
        KvAware.__init__(self, weights, memory, tuning, rng)
        _ReadsEngines.__init__(self, channel)
        self.exact_load = load
        self.exact_cache = cache
        self.name = "kv_aware+exact" if load and cache else "kv_aware+exact_load" if load else "kv_aware+exact_cache"

    def _apply(self, candidates: list[Candidate]) -> None:
        for c in candidates:
            st = self._states.get(c.backend)
            if st is None:
                continue
            if self.exact_load:
                c.load = st.load
            if self.exact_cache:
                c.matched_blocks = st.gpu_blocks + st.cpu_blocks
                c.weighted_blocks = st.gpu_blocks + self.t.cpu_tier * st.cpu_blocks

    def _speculative_hits(self, ctx: RequestCtx) -> dict[str, int]:
        """With the exact cache view, the prefix blocks that requests already queued on each
        engine will hold there: what speculative insertion guesses, known."""
        if not self.exact_cache:
            return super()._speculative_hits(ctx)
        return {name: st.queued_blocks for name, st in self._states.items() if st is not None and st.queued_blocks}

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        KvAware.commit(self, ctx, decision)
        self.channel.sent(id(ctx), decision.backend)
