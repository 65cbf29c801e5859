"""Stage 3 of the request path, *plan*: which block keys a request is routed on, and what it still owes.

Tokenizing is most of what routing costs, and for some prompts part of the ids decides
as much as all of them would. Each routing mode is one class here, and each says which
keys it routes on (``keys``), how many tokens the prompt is taken to have
(``num_tokens``) and what it owes once sent (:meth:`Plan.owe`, stage 8, which
:class:`router.settle.Settler` pays):

=====================  =====================================================  ==========================================
mode                   routes on                                              owes in the background
=====================  =====================================================  ==========================================
:class:`ExactIds`      every id of the prompt (the full path)                 sampled id checks; learning its history
:class:`RememberedHistory`  the keys remembered for its messages, unrendered  all ids; the memo entry's check
                       (:mod:`router.prompt.history`)
:class:`SeenTail`      the ids of its history the segment cache holds;        all ids
                       the new turn is short (:mod:`router.prompt.cold`)
:class:`ColdHead`      the exact first block of a long prompt nobody holds    all ids; the probe's check
                       (:mod:`router.prompt.cold`)
=====================  =====================================================  ==========================================

A request is tried against the deferred modes in :data:`MODES` order; the first that
applies proposes a plan, or names the outcome that sends the request down the full
path (``seen``, ``disabled``, ``ineligible``). A new mode is one :class:`Deferred`
subclass with ``propose``, ``bound`` and ``verify``, added to :data:`MODES`.

Planning is pure: it renders, scans and tokenizes (warming the tokenizer's caches) but
changes no routing state, counts nothing and starts nothing, so ``/debug/route`` can plan
too. The outcome each plan carries is counted in ``kvrouter_cold_path`` when it is sent.

the tuning's ``inline_tokenize_bytes`` (router/tuning.py) is the one size threshold: a body, or a prompt's
uncached text, at most that long costs less to tokenize on the event loop than any
detour (a pool thread, a probe plus a background job), so only longer prompts are
deferred, and a seen history's new turn is deferred only while it is at most that long.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from router.prompt.cold import HeadProbe
from router.http.errors import BadRequest
from router.prompt.history import Chain, Hit, chain_of, digest
from router.fleet.load import Ticket
from router.prompt.prompt_ids import IdSource, Ids, Rendered
from router.runtime import ModelRuntime, check_length, length_error
from router.prompt.prompt_fields import TokenizeError, UnsupportedPrompt
from router.prompt.length import CHARS_PER_TOKEN
from router.prompt.segments import Scan
from router.prompt.tokenize import PromptTokenizer


@dataclass(slots=True)
class Query:
    """One OpenAI request as the planner sees it."""

    rt: ModelRuntime
    body: dict[str, Any]
    kind: str
    raw_len: int
    lora: dict[str, Any] | None
    salt: str | None
    chain: Chain | None = None
    """Its messages' history-memo keys, when the memo can route it or learn from it."""


class Settling(Protocol):
    """The work a plan can owe, as :class:`router.settle.Settler` does it (settling comes
    after planning on the request path, so plans name it by its methods). ``d`` is the sent
    request, a :class:`router.choose.Decided`; each returns what starts the work sooner."""

    def tokenize(self, d: Any, plan: Deferred, ticket: Ticket) -> Callable[[], None]: ...

    def check_ids(self, d: Any, plan: ExactIds) -> None: ...

    def learn_history(self, d: Any, plan: ExactIds) -> Callable[[], None] | None: ...


class Plan:
    """What every mode answers: the keys to route on, the prompt's length in tokens, and
    what it owes once sent."""

    __slots__ = ()
    outcome: str | None = None
    """Its ``kvrouter_cold_path`` outcome, counted when it is sent (None: not counted)."""
    keys: list[int]
    num_tokens: int
    token_ids: list[int]

    def owe(self, settler: Settling, d: Any, ticket: Ticket) -> Callable[[], None] | None:
        """Stage 8, *settle*: schedule what the sent request ``d`` (load ``ticket``) still owes;
        returns what starts it sooner (None: nothing owed). Called when it is sent, before
        any await, so a request with the same new first block finds it pending."""
        raise NotImplementedError


@dataclass(slots=True)
class ExactIds(Plan):
    """The full path: every id known before routing. Owes the sampled checks of its ids
    and, for a chat the memo can key, learning its history for the next turn."""

    ids: Ids
    rendered: Rendered | None = None
    outcome: str | None = None
    unsupported: bool = False
    """A prompt the router cannot tokenize: routed without cache information (reason ``fallback``)."""

    @property
    def keys(self) -> list[int]:  # type: ignore[override]
        return self.ids.keys

    @property
    def num_tokens(self) -> int:  # type: ignore[override]
        return len(self.ids.token_ids)

    @property
    def token_ids(self) -> list[int]:  # type: ignore[override]
        return self.ids.token_ids

    def owe(self, settler: Settling, d: Any, ticket: Ticket) -> Callable[[], None] | None:
        settler.check_ids(d, self)
        return settler.learn_history(d, self)


@dataclass(slots=True)
class Deferred(Plan):
    """Routed on part of its ids (``head``, hashed to ``keys``; none for a remembered
    history, whose keys are remembered) with ``num_tokens`` an estimate of its length;
    owes its full tokenization, which settles its load ticket and the policy's memory."""

    prompt: Rendered | None
    head: list[int]
    keys: list[int]
    num_tokens: int
    head_chars: int = 0
    """The rendered text its head covers: the rest is bounded by bytes (:meth:`bound`)."""
    token_ids: list[int] = field(default_factory=list)
    registers_pending: ClassVar[bool] = False
    """Whether a request with the same first block waits for its settle (a cold head's burst)."""

    @classmethod
    def propose(cls, draft: Draft) -> Plan | str | None:
        """A plan of this mode, an outcome that sends the request down the full path, or
        None when the mode does not apply (the next one is tried)."""
        raise NotImplementedError

    def holds(self, rt: ModelRuntime, hits: dict[Any, Any], settling: Callable[[ModelRuntime, int], bool]) -> bool:
        """Whether the plan stands once its keys were looked up (``settling``: whether a
        request with this first block is still being tokenized in the background)."""
        return True

    def bound(self, probe: HeadProbe) -> int:
        """An upper bound on the prompt's length: its exact head, a byte bound on the rest."""
        assert self.prompt is not None
        return len(self.head) + probe.max_tokens(self.prompt.text[self.head_chars :], self.prompt.add_special)

    def verify(self, rt: ModelRuntime, ids: list[int], keys: list[int]) -> None:
        """Compare what it was routed on with its full tokenization (background, on the loop)."""

    def owe(self, settler: Settling, d: Any, ticket: Ticket) -> Callable[[], None] | None:
        return settler.tokenize(d, self, ticket)


@dataclass(slots=True)
class RememberedHistory(Deferred):
    """A chat whose messages start with a remembered history (:mod:`router.prompt.history`),
    routed on that history's keys before its template is rendered. Rendered only under a
    configured length limit, which needs a bound: the remembered prefix's tokens, when the
    rendering does start with that text, plus a byte bound on the rest."""

    hit: Hit | None = None
    outcome: ClassVar[str | None] = "history"  # type: ignore[misc]

    @classmethod
    def propose(cls, draft: Draft) -> Plan | str | None:
        rt, chain = draft.q.rt, draft.q.chain
        if chain is None or rt.history is None:
            return None
        hit = rt.history.find(chain)
        if hit is None:
            return None
        entry = hit.entry
        if rt.config.max_model_len is None:
            return cls(None, [], entry.keys, hit.estimate(chain), hit=hit)
        prompt = draft.prompt()
        if prompt is None or digest(prompt[0], entry.chars) != entry.digest:
            return None
        text, add_special = prompt
        rendered = Rendered(text, add_special, len(text) - entry.chars)
        return cls(rendered, [], entry.keys, hit.estimate(chain), entry.chars, hit=hit)

    def bound(self, probe: HeadProbe) -> int:
        assert self.prompt is not None and self.hit is not None
        return self.hit.entry.tokens + probe.max_tokens(self.prompt.text[self.head_chars :], self.prompt.add_special)

    def verify(self, rt: ModelRuntime, ids: list[int], keys: list[int]) -> None:
        if rt.history is not None and self.hit is not None:
            rt.history.check(self.hit, keys)

    def owe(self, settler: Settling, d: Any, ticket: Ticket) -> Callable[[], None] | None:
        """Also marks its memo entry most recently used, at once: a conversation being
        continued keeps its shortcut (the memo evicts least recently used first)."""
        memo = d.rt.history
        if memo is not None and self.hit is not None:
            memo.touch(self.hit)
        return settler.tokenize(d, self, ticket)


@dataclass(slots=True)
class SeenTail(Deferred):
    """A re-sent history and a short new turn: the history's ids are exact (the segment
    cache), and no backend can hold blocks of text this router has not tokenized lately
    (the blocks are chained), so routing on the history decides what the whole prompt would."""

    outcome: ClassVar[str | None] = "tail"  # type: ignore[misc]

    @classmethod
    def propose(cls, draft: Draft) -> Plan | str | None:
        r = draft.scanned()
        if r is None or r.uncached_chars > draft.inline_bytes:
            return None
        scan = draft.scan
        if scan is None:  # short: below the threshold whatever the cache holds
            return None
        head = scan.head
        if scan.complete or len(head) < draft.q.rt.config.block_size:
            return "seen"
        q = draft.q
        keys = q.rt.hash_cache.hash_int64(head, lora=q.lora, cache_salt=q.salt)
        estimate = len(head) + round((len(r.text) - scan.head_chars) * len(head) / max(1, scan.head_chars))
        return cls(r, head, keys, estimate, scan.head_chars)


@dataclass(slots=True)
class ColdHead(Deferred):
    """A long prompt the segment cache has mostly not seen, routed on its exact first
    block (:class:`router.prompt.cold.HeadProbe`) when no backend holds that block, nor the
    router's recent decisions, nor a request still settling."""

    outcome: ClassVar[str | None] = "deferred"  # type: ignore[misc]
    registers_pending: ClassVar[bool] = True

    @classmethod
    def propose(cls, draft: Draft) -> Plan | str | None:
        r = draft.scanned()
        if r is None or draft.scan is None or r.uncached_chars <= draft.inline_bytes:
            return None
        rt, q = draft.q.rt, draft.q
        assert rt.probe is not None
        if not rt.probe.enabled:
            return "disabled"
        got = rt.probe.head_ids(r.text, r.add_special, rt.config.block_size)
        if got is None:
            return "ineligible"
        head, per_char = got
        keys = rt.hash_cache.hash_int64(head, lora=q.lora, cache_salt=q.salt)
        return cls(r, head, keys, max(len(head), round(len(r.text) * per_char)))

    def holds(self, rt: ModelRuntime, hits: dict[Any, Any], settling: Callable[[ModelRuntime, int], bool]) -> bool:
        """Nobody may hold the block: else the full path decides (outcome ``known``)."""
        return not hits and not (rt.memory is not None and rt.memory.remembers(self.keys)) and not settling(rt, self.keys[0])

    def bound(self, probe: HeadProbe) -> int:
        assert self.prompt is not None
        return probe.max_tokens(self.prompt.text, self.prompt.add_special)

    def verify(self, rt: ModelRuntime, ids: list[int], keys: list[int]) -> None:
        assert rt.probe is not None
        rt.probe.check(self.head, ids)


MODES: tuple[type[Deferred], ...] = (RememberedHistory, SeenTail, ColdHead)


class Draft:
    """One request while the modes look at it: its prompt rendered and scanned at most once."""

    __slots__ = ("q", "inline_bytes", "_prompt", "_rendered", "scan")

    def __init__(self, q: Query, inline_bytes: int) -> None:
        self.q = q
        self.inline_bytes = inline_bytes
        self._prompt: Any = _UNSET
        self._rendered: Any = _UNSET
        self.scan: Scan | None = None
        """What the segment cache holds of a long prompt (None: not scanned, or short)."""

    def prompt(self) -> tuple[str, bool] | None:
        """The prompt text of a single-text request (None: not one, or not for this router)."""
        if self._prompt is _UNSET:
            tok = self.q.rt.tokenizer
            self._prompt = _render(tok, self.q.body, self.q.kind) if tok is not None else None
        return self._prompt  # type: ignore[no-any-return]

    @property
    def rendered(self) -> Rendered | None:
        """What :meth:`scanned` found, if a mode asked (the full path reuses it)."""
        return None if self._rendered is _UNSET else self._rendered  # type: ignore[no-any-return]

    def scanned(self) -> Rendered | None:
        """The rendered prompt and what the segment cache lacks of it (a short one unscanned)."""
        if self._rendered is _UNSET:
            self._rendered = None
            rt = self.q.rt
            prompt = self.prompt() if rt.probe is not None and rt.local else None
            if prompt is not None:
                text, add_special = prompt
                if len(text) < self.inline_bytes:
                    self._rendered = Rendered(text, add_special, len(text))
                else:
                    assert rt.tokenizer is not None
                    self.scan = scan = rt.tokenizer.scan(text, add_special)
                    self._rendered = Rendered(text, add_special, scan.uncached_chars, scan.head if scan.complete else None)
        return self._rendered  # type: ignore[no-any-return]


_UNSET = object()


class Planner:
    """Chooses each request's mode (see the module docstring)."""

    def __init__(self, ids: IdSource, *, defer: bool, inline_bytes: int, busy: Callable[[], bool]) -> None:
        self.ids = ids
        self.defer = defer
        """the tuning's ``defer_cold_prompts`` (router/tuning.py): whether any mode but the full path is tried."""
        self.inline_bytes = inline_bytes
        self.busy = busy
        """Whether background work is behind (:attr:`router.background.Background.full`)."""

    async def plan(self, q: Query) -> Plan:
        rt = q.rt
        if not (self.defer and rt.engines is None and self.inline_bytes < q.raw_len <= too_big_to_plan(rt)):
            return await self.exact(q)
        q.chain = _chain(q)
        draft = Draft(q, self.inline_bytes)
        outcome, rendered = None, None
        for mode in MODES:
            got = mode.propose(draft)
            if got is None:
                continue
            if isinstance(got, str):
                outcome = got
            elif self.busy():
                outcome, rendered = "busy", got.prompt
            elif rt.config.max_model_len is not None and length_error(rt, q.body, [got.bound(rt.probe)]):  # type: ignore[arg-type]
                # A configured limit, maybe below the engines': check it exactly.
                outcome, rendered = "ineligible", got.prompt
            else:
                return got
            break
        return await self.exact(q, rendered or draft.rendered, outcome)

    async def exact(self, q: Query, rendered: Rendered | None = None, outcome: str | None = None) -> ExactIds:
        """The full path; a prompt the router cannot tokenize is routed without cache
        information (decision reason ``fallback``)."""
        try:
            ids = await self.ids.exact(q.rt, q.body, q.kind, q.raw_len, q.lora, q.salt, rendered)
        except UnsupportedPrompt:
            return ExactIds(Ids([], [], []), rendered, outcome, unsupported=True)
        check_length(q.rt, q.body, ids.lengths)
        return ExactIds(ids, rendered, outcome)


PLAN_MAX_BYTES = 1 << 20
"""Bodies past this many bytes are not planned on the event loop: rendering and scanning
them there (a 200,000-message chat is 8.7 MiB) stalled every other request, /health too,
for seconds. They take the full path, which renders and tokenizes them in the pool."""


def too_big_to_plan(rt: ModelRuntime) -> int:
    """The largest body the deferred modes look at: :data:`PLAN_MAX_BYTES`, or less where a
    body that long may already be past ``max_model_len`` (the full path bounds its work,
    :mod:`router.prompt.length`; a deferred plan would tokenize all of it in the background)."""
    limit = rt.max_model_len
    return PLAN_MAX_BYTES if limit is None else min(PLAN_MAX_BYTES, CHARS_PER_TOKEN * limit)


def _chain(q: Query) -> Chain | None:
    """The request's history-memo keys, when the memo can route it or learn from it."""
    rt = q.rt
    memo, tok = rt.history, rt.tokenizer
    if q.kind != "chat" or memo is None or not memo.enabled or tok is None or not tok.segment_enabled or not rt.local:
        return None
    return chain_of(q.body)


def _render(tok: PromptTokenizer, body: dict[str, Any], kind: str) -> tuple[str, bool] | None:
    try:
        return tok.prompt_text(body, kind)
    except UnsupportedPrompt:
        return None
    except TokenizeError as e:
        raise BadRequest(str(e)) from e


def rendered_now(tok: PromptTokenizer, body: dict[str, Any], kind: str) -> Rendered | None:
    """The prompt of a request routed before it was rendered (background thread)."""
    got = tok.prompt_text(body, kind)
    return Rendered(got[0], got[1], len(got[0])) if got is not None else None
