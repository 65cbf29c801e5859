"""session: the same session always lands on the same backend (rendezvous hashing).

The session key is the configured header (default ``x-session-id``) or the body's
``user`` field. Rendezvous (highest-random-weight) hashing keeps every other
session where it was when a backend leaves or returns: only that backend's sessions
move. A request without a session key goes to the least-loaded backend.
"""

from __future__ import annotations

import xxhash

from router.policies.base import Candidate, Decision, RequestCtx, healthy, in_flight_tokens, mark_unroutable


class SessionAffinity:
    name = "session"

    def choose(self, ctx: RequestCtx, candidates: list[Candidate]) -> Decision:
        if ctx.session_key is None:
            for c in candidates:
                c.score = float(in_flight_tokens(c, ctx.block_size))
            reason = "no_session_key"
        else:
            key = ctx.session_key.encode()
            for c in candidates:
                # Negated so that the highest weight has the lowest cost.
                c.score = -float(xxhash.xxh3_64_intdigest(key + b"\0" + c.backend.encode()))
            reason = "session"
        mark_unroutable(candidates)
        order = [c.backend for c in sorted(healthy(candidates), key=lambda c: c.score)]
        return Decision(order[0], reason, order)

    def commit(self, ctx: RequestCtx, decision: Decision) -> None:
        return None
