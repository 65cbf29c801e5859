"""The policy interface and the data a decision is made from.

A policy sees one :class:`RequestCtx` (the request's tokens as block keys, its session
key) and one :class:`Candidate` per configured backend of the model (healthy or not,
with its cache hits and live load), and returns a :class:`Decision`: the backend, the
fallback order for retries, every candidate's score and the *reason*. ``choose`` has
no side effects (``/debug/route`` calls it without sending anything); ``commit`` is
called once the request is really routed, for policies that learn from their own
decisions (round-robin's cursor, prefix trees, speculative insertion).

Scores are costs: lower is better. A backend that cannot be routed to gets
:data:`UNROUTABLE` so the debug answer stays numeric.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from router.fleet.load import BackendLoad, LoadView

UNROUTABLE = sys.float_info.max


@dataclass(slots=True)
class RequestCtx:
    model: str
    num_tokens: int
    block_size: int
    keys: list[int]
    session_key: str | None = None
    events_connected: bool = False


@dataclass(slots=True)
class Candidate:
    """One backend as the policy sees it. ``matched_blocks`` counts leading blocks in any
    tier (from the index, or from the router's own recent decisions); ``weighted_blocks``
    weighs each block by its tier (GPU 1.0, CPU/storage lower)."""

    backend: str
    healthy: bool
    load: BackendLoad | LoadView
    matched_blocks: int = 0
    weighted_blocks: float = 0.0
    speculative_blocks: int = 0
    best_rank: int = 0
    score: float = 0.0

    def predicted_cached_tokens(self, num_tokens: int, block_size: int) -> int:
        """What vLLM would report as cached: hits are capped at num_tokens - 1 because the
        engine always recomputes at least the last token (VLLM_FACTS.md §2)."""
        if num_tokens <= 0:
            return 0
        return min(self.matched_blocks, (num_tokens - 1) // block_size) * block_size


@dataclass(slots=True)
class Decision:
    backend: str
    reason: str
    order: list[str] = field(default_factory=list)
    detail: dict[str, float | int | str] = field(default_factory=dict)


class Policy(Protocol):
    name: str

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision: ...

    def commit(self, ctx: RequestCtx, decision: Decision) -> None: ...


@runtime_checkable
class PrefixMemory(Protocol):
    """What a policy that remembers its own decisions by prefix (kv_aware, prefix_approx)
    adds: the router asks whether a prompt's first block was routed recently before it
    sends a cold prompt untokenized, and hands over the full keys once they are known.
    ``forget`` drops what was sent to a backend whose cache is presumed gone (its health
    check failed: a restart)."""

    def remember(self, keys: list[int], backend: str) -> None: ...

    def remembers(self, keys: list[int]) -> bool: ...

    def forget(self, backend: str) -> None: ...


@runtime_checkable
class ReadsEngineState(Protocol):
    """What a policy that reads every engine's exact state adds (the bench's ``oracle`` and
    ``kv_aware+exact*``, simulator only: :mod:`loadtest.policies.engine_state`). ``start``
    fails when a backend does not serve the simulator's side channel; ``observe`` asks the
    engines about the request just before ``choose`` (``token_ids`` may be empty)."""

    async def start(self) -> None: ...

    async def observe(self, ctx: RequestCtx, candidates: list[Candidate], token_ids: list[int],
                      body: dict[str, Any], kind: str) -> None: ...

    async def aclose(self) -> None: ...


def healthy(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.healthy]


def by_score(candidates: list[Candidate], rng: random.Random | None = None) -> list[str]:
    """Routable backends from best to worst score, ties broken at random so that equal
    backends share traffic instead of the first one in the config taking all of it."""
    r = rng or random
    ranked = sorted(healthy(candidates), key=lambda c: (c.score, r.random()))
    return [c.backend for c in ranked]


def mark_unroutable(candidates: list[Candidate]) -> None:
    for c in candidates:
        if not c.healthy:
            c.score = UNROUTABLE


def in_flight_tokens(c: Candidate, block_size: int) -> int:
    """Tokens the backend is working on: prompts awaiting prefill plus the KV of running
    sequences (unique blocks)."""
    return c.load.prefill_tokens + c.load.active_blocks * block_size
