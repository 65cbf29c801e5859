"""Stage 8 of the request path, *settle*: what a sent request still owes, paid in the background.

Each plan says what it owes (:meth:`router.plans.Plan.owe`) by asking the :class:`Settler`
for the work it needs:

- a deferred plan (:class:`~router.plans.Deferred`), :meth:`Settler.tokenize`: its full
  tokenization; the exact ids and keys replace the estimate on its load ticket
  (:meth:`router.fleet.load.Ticket.settle`), the policy remembers the real keys, the mode checks
  what it was routed on (``verify``), and a chat teaches the history memo its messages;
- the full path (:class:`~router.plans.ExactIds`), :meth:`Settler.check_ids`, the sampled
  checks of its ids (segment cache against a full tokenization, local against a backend's
  ``/tokenize``), and :meth:`Settler.learn_history`, for a chat the memo can key, learning
  its history for the next turn.

The work starts :data:`SETTLE_DELAY_S` after the request is sent, or sooner: when its
response is complete (:meth:`router.attempt.Attempts.end`), or when a request with the
same first block needs its keys (:meth:`Settler.after_pending`). Starting at once would
compete for the CPU (and the GIL) with the engine and the event loop exactly while the
request is being sent and first answered; nothing needs the exact keys that soon, and its
load ticket carries an estimate meanwhile. All of it goes through :mod:`router.background`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router import metrics
from router.background import Background
from router.fleet.backends import BackendPool
from router.choose import Decided, uncached
from router.http.errors import BadRequest
from router.prompt.history import Chain, Entry, learn_entries
from router.fleet.load import Ticket
from router.plans import Deferred, ExactIds, rendered_now
from router.prompt.prompt_ids import Ids, Rendered, local_ids, observe_ids
from router.runtime import ModelRuntime
from router.prompt.prompt_fields import TokenizeError

log = logging.getLogger(__name__)

PENDING_WAIT_S = 1.0
"""Longest a request waits for a deferred one with the same first block (its background
tokenization normally takes as long as this request's own)."""
SETTLE_DELAY_S = 0.02
"""A request's owed work starts this long after it is sent, at the latest (module docstring)."""


@dataclass(slots=True)
class Pending:
    """A deferred request's background tokenization: ``wake`` starts it before its delay,
    ``done`` is set when its keys are known (or it failed)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Settler:
    """Pays what sent requests owe, on :class:`~router.background.Background`."""

    def __init__(self, background: Background, pool: BackendPool) -> None:
        self.background = background
        self.pool = pool
        self._pending: dict[tuple[str, int], Pending] = {}
        """Cold heads not yet settled, by (model, block 0 key): a request with the same
        first block starts their tokenization and waits for it instead of deciding blind."""

    def known(self, rt: ModelRuntime, first_key: int) -> bool:
        """Whether a request with this first block is still settling (read only)."""
        return (rt.name, first_key) in self._pending

    async def after_pending(self, model: str, first_key: int) -> None:
        """Wait (bounded) for a deferred request with the same first block to finish
        tokenizing, so this decision sees its keys (a burst follows its first request)."""
        pending = self._pending.get((model, first_key))
        if pending is not None:
            pending.wake.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(pending.done.wait(), PENDING_WAIT_S)

    # -- deferred plans ------------------------------------------------------------------

    def tokenize(self, d: Decided, plan: Deferred, ticket: Ticket) -> Callable[[], None]:
        """A deferred plan's debt: its full tokenization, in the background; returns what
        starts it sooner. A cold head's is registered pending at once, so a request with
        the same new first block waits for it (:meth:`after_pending`)."""
        pending = Pending()
        key = (d.rt.name, plan.keys[0])
        if plan.registers_pending:
            self._pending[key] = pending
        self.background.spawn(self._settle(d, plan, ticket, key, pending))
        return pending.wake.set

    async def _settle(self, d: Decided, plan: Deferred, ticket: Ticket, key: tuple[str, int], pending: Pending) -> None:
        rt = d.rt
        try:
            await _woken(pending.wake)
            got, learned = await self.background.run(_settle_job, d, plan)
            ids, keys = got.token_ids, got.keys
            observe_ids(rt, got)
            plan.verify(rt, ids, keys)
            _remember(rt, learned)
            chosen = next(c for c in d.candidates if c.backend == ticket.load.name)
            ticket.settle(keys, uncached(len(ids), chosen, d.ctx.block_size))
            if rt.memory is not None:
                rt.memory.remember(keys, d.backend)
            if rt.guard.should_check():
                self.background.spawn(self._parity_check(rt, d.q.body, d.q.kind, ids))
        except (TokenizeError, BadRequest) as e:  # routed unrendered, and the router cannot tokenize it: the engine judges it
            log.debug("a deferred %s request cannot be tokenized here: %s", rt.name, e)
            metrics.child(metrics.COLD_PATH, rt.name, "settle_error").inc()
            ticket.settle([], 0)  # what the full path would have charged it
        except Exception as e:  # noqa: BLE001 - the request is already on its way; keep its estimate
            log.warning("background tokenization of a deferred %s request failed: %r", rt.name, e)
            metrics.child(metrics.COLD_PATH, rt.name, "settle_error").inc()
        finally:
            if self._pending.get(key) is pending:
                del self._pending[key]
            pending.done.set()

    # -- exact plans -----------------------------------------------------------------------

    def check_ids(self, d: Decided, plan: ExactIds) -> None:
        """The sampled comparisons of a full-path request's ids: its segment-cached ids
        against a full tokenization (a whole cold tokenization: on the background thread),
        and its local ids against a backend's."""
        rt, r = d.rt, plan.rendered
        if not plan.token_ids or not rt.local:
            return
        tok = rt.tokenizer
        assert tok is not None
        if r is not None and tok.wants_check():
            self.background.submit(tok.check_prompt, r.text, plan.token_ids, r.add_special)
        if rt.guard.should_check():
            self.background.spawn(self._parity_check(rt, d.q.body, d.q.kind, plan.token_ids))

    def learn_history(self, d: Decided, plan: ExactIds) -> Callable[[], None] | None:
        """For a chat request tokenized before it was sent: remember its messages' keys
        for the next turn, once it is answered (or after :data:`SETTLE_DELAY_S`); returns
        what starts it sooner (None: nothing to learn)."""
        memo, chain = d.rt.history, d.q.chain
        if memo is None or chain is None or not plan.keys:
            return None
        if chain.hashes[-1] in memo and (len(chain.hashes) == 1 or chain.hashes[-2] in memo):
            return None
        wake = asyncio.Event()
        self.background.spawn(self._learn(d, plan, wake))
        return wake.set

    async def _learn(self, d: Decided, plan: ExactIds, wake: asyncio.Event) -> None:
        rt = d.rt
        await _woken(wake)
        if self.background.full:
            return  # background work is behind: learn from a later turn instead
        try:
            learned = await self.background.run(_history_job, rt, d.q.chain, d.q.body, plan.rendered, plan.keys)
        except Exception as e:  # noqa: BLE001 - only the next turn's shortcut is lost
            log.warning("learning a %s chat history failed: %r", rt.name, e)
            return
        _remember(rt, learned)

    async def _parity_check(self, rt: ModelRuntime, body: dict[str, Any], kind: str, local_first: list[int]) -> None:
        name = next((n for n in rt.backends if self.pool.get(n).routable), None)
        if name is None:
            return
        backend = self.pool.get(name)
        try:
            if kind == "chat":
                await rt.guard.check_chat(local_first, body, rt.remote, backend.url, backend.http)
            else:
                remote = await rt.remote.completion_ids(body=body, base_url=backend.url, client=backend.http)
                rt.guard.record(local_first, remote[0] if remote else [])
        except Exception as e:  # noqa: BLE001 - a failed sample check is only logged
            log.debug("parity check against %s failed: %r", name, e)


def _settle_job(d: Decided, plan: Deferred) -> tuple[Ids, list[tuple[int, Entry]]]:
    """A deferred request's ids and keys, and the history entries it teaches (background thread)."""
    rt, q = d.rt, d.q
    tok = rt.tokenizer
    assert tok is not None
    prompt = plan.prompt or rendered_now(tok, q.body, q.kind)  # routed on remembered keys: rendered only now
    ids = local_ids(rt, q.body, q.kind, q.lora, q.salt, prompt)
    if prompt is not None and tok.wants_check():
        tok.check_prompt(prompt.text, ids.token_ids, prompt.add_special)
    try:
        learned = _history_job(rt, q.chain, q.body, prompt, ids.keys)
    except Exception as e:  # noqa: BLE001 - learning is optional; the settle is not
        log.warning("learning a %s chat history failed: %r", rt.name, e)
        learned = []
    return ids, learned


def _history_job(
    rt: ModelRuntime, chain: Chain | None, body: dict[str, Any], prompt: Rendered | None, keys: list[int]
) -> list[tuple[int, Entry]]:
    tok, memo = rt.tokenizer, rt.history
    if chain is None or tok is None or memo is None:
        return []
    prompt = prompt or rendered_now(tok, body, "chat")
    if prompt is None:
        return []
    return learn_entries(tok, memo, chain, body, prompt.text, prompt.add_special, keys, rt.config.block_size)


def _remember(rt: ModelRuntime, learned: list[tuple[int, Entry]]) -> None:
    if rt.history is not None:
        for key, entry in learned:
            rt.history.put(key, entry)


async def _woken(wake: asyncio.Event) -> None:
    """Wait for ``wake``, at most :data:`SETTLE_DELAY_S`."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), SETTLE_DELAY_S)
