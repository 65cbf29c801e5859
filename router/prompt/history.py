"""Routing a re-sent chat history before rendering it.

Multi-turn chat re-sends the whole conversation every turn. To route it the router
renders the chat template, walks the segment cache and hashes the blocks: for an
8k-token history about 0.6 ms on an idle core (twice that beside busy engines), all on
the request's critical path, and all to find again the keys it found for the previous
turn. Rendering is the larger part, and it grows with the history.

:class:`HistoryMemo` keeps, for the messages of requests already tokenized, the block
keys that *any continuation* of those messages starts with. It is keyed by a chained
hash over the messages (each one's JSON) seeded by the fields that shape the prompt, so
one pass over a new request's messages gives a key per message boundary; the longest one
the memo holds routes the request before anything is rendered (outcome ``history``).

An entry is learned in the background, after a request was sent
(:func:`learn_entries`): the request's own rendering is compared with a rendering of the
same body with a sentinel continuation (for the next turn: an assistant and a user
message appended; for the same history with another last message: that message
replaced). Their ids agree up to the last added token the two texts share at the same
place, because the text between added tokens tokenizes independently (see
:mod:`router.prompt.tokenize`); the entry is the full blocks of that many ids. A template that
rewrites earlier text when messages are added (one that moves the system prompt to the
last user turn, say) shares little, so its entries are short or absent: correct, only
less useful.

Each routed-by-memo request is tokenized in full afterwards anyway (to settle its load
ticket), and its real keys are compared with the entry's: a template that renders
earlier text from later messages in ways the sentinel did not show (a date from
``strftime_now`` at midnight) is counted, the entry dropped, and the memo turned off for
the model when mismatches persist. A wrong entry costs routing quality, never a wrong
answer: the engine tokenizes the request itself.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash
from prometheus_client import Counter

from router import metrics

if TYPE_CHECKING:
    from router.prompt.tokenize import PromptTokenizer

log = logging.getLogger(__name__)

HISTORY_CHECKS = Counter(
    "kvrouter_history_checks_total",
    "Requests routed on a history-memo entry whose real keys were then compared with it",
    ["model"],
)
HISTORY_MISMATCHES = Counter(
    "kvrouter_history_mismatches_total",
    "History-memo entries whose keys were not a prefix of the request's real keys "
    "(the memo turns off for the model when they persist)",
    ["model"],
)

SENTINEL = "\u2063kvrouter-continuation\u2063"
"""Content of the sentinel messages: text no real message is likely to share a prefix with."""

UNRENDERED_FIELDS = frozenset({
    "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs",
    "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user",
    "request_id", "priority", "response_format", "parallel_tool_calls", "skip_special_tokens",
})
"""Body fields the prompt does not depend on. Every other field (model, tools,
chat_template_kwargs, add_generation_prompt, cache_salt, ...) seeds the key, so a request
that differs in one of them never finds another's entry."""

MAX_MISMATCHES = 3
"""Mismatches tolerated before the memo turns off (and only while they are under 5% of
the checks): one entry made stale by a date is dropped and counted, not fatal."""

OFF_FOR_S = 600.0
"""How long the memo stays off after too many mismatches; it then starts over (a template
that is wrong for it turns it off again after a few requests)."""

MAX_SHORTFALL = 0.1
"""An entry is kept only if its share of the prompt's tokens is at most this far below its
messages' share of the body's JSON (see :func:`learn_entries`)."""

TEXT_PARTS = frozenset({"text", "refusal"})

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Chain:
    """A chat body's key after each message: ``hashes[j - 1]`` covers its first ``j``
    messages; ``sizes[j - 1]`` is their JSON size (the length estimate's scale)."""

    hashes: list[int]
    sizes: list[int]


@dataclass(frozen=True, slots=True)
class Entry:
    """What every continuation of some messages starts with: ``keys``, the block keys of
    the first ``tokens`` prompt tokens (full blocks only), which are the first ``chars``
    characters of the rendered prompt (their :func:`digest`); ``size``, those messages'
    JSON size."""

    keys: list[int]
    tokens: int
    size: int
    chars: int = 0
    digest: int = 0


def digest(text: str, chars: int) -> int:
    """Fingerprint of a rendered prompt's first ``chars`` characters."""
    return xxhash.xxh3_64_intdigest(text[:chars].encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class Hit:
    """The longest memo entry a request's messages start with: ``messages`` of them."""

    key: int
    entry: Entry
    messages: int

    def estimate(self, chain: Chain) -> int:
        """Prompt tokens: the entry's, plus the other messages scaled by its tokens per byte."""
        rest = chain.sizes[-1] - self.entry.size
        return self.entry.tokens + round(rest * self.entry.tokens / max(1, self.entry.size))


def chain_of(body: dict[str, Any]) -> Chain | None:
    """The body's per-message keys, or None when it is not a chat body the memo can key
    (no message list, or a field that makes the prompt depend on more than the messages)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or body.get("truncate_prompt_tokens") is not None:
        return None
    for m in messages:  # images, audio, files: the router does not tokenize those (full path)
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") not in TEXT_PARTS for p in content):
            return None
    try:
        key = xxhash.xxh3_64_intdigest(_encode({k: v for k, v in body.items() if k not in UNRENDERED_FIELDS}))
        hashes, sizes, size = [], [], 0
        for m in messages:
            raw = _encode(m)
            key = xxhash.xxh3_64_intdigest(raw, seed=key)
            size += len(raw)
            hashes.append(key)
            sizes.append(size)
    except (TypeError, ValueError, OverflowError):  # not JSON-encodable: let the full path judge
        return None
    return Chain(hashes, sizes)


class HistoryMemo:
    """One model's memo: bounded by the keys it holds, least recently used entries
    dropped first (one-shot prompts teach entries nobody asks for again; a conversation's
    next turn refreshes its own). Used on the event loop only (the background thread
    only asks whether it holds a key)."""

    def __init__(self, model: str, max_keys: int = 1 << 18, off_for_s: float = OFF_FOR_S) -> None:
        self.model = model
        self.max_keys = max_keys
        self.off_for_s = off_for_s
        self.checks = 0
        self.mismatches = 0
        self._off_until = 0.0
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # O(1) oldest-first eviction: a dict's next(iter()) walks the slots its deletions left
        self._keys = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        """False for :data:`OFF_FOR_S` after mismatches persisted; then it starts over."""
        if self._off_until and time.monotonic() >= self._off_until:
            self._off_until = 0.0
            self.checks = self.mismatches = 0
        return not self._off_until

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def find(self, chain: Chain) -> Hit | None:
        """The longest prefix of the messages the memo holds an entry for. Only reads:
        planning (and ``/debug/route``) calls it; a request routed on the hit :meth:`touch`\es it."""
        if not self.enabled:
            return None
        entries = self._entries
        for j in range(len(chain.hashes), 0, -1):
            key = chain.hashes[j - 1]
            entry = entries.get(key)
            if entry is not None:
                return Hit(key, entry, j)
        return None

    def touch(self, hit: Hit) -> None:
        """Mark a hit's entry most recently used: it is evicted last."""
        entry = self._entries.pop(hit.key, None)
        if entry is not None:
            self._entries[hit.key] = entry

    def put(self, key: int, entry: Entry) -> None:
        if not self.enabled or not entry.keys:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._keys -= len(old.keys)
        self._entries[key] = entry
        self._keys += len(entry.keys)
        while self._keys > self.max_keys and self._entries:
            self._keys -= len(self._entries.popitem(last=False)[1].keys)

    def check(self, hit: Hit, keys: list[int]) -> bool:
        """Whether a memo-routed request's real keys start with its entry's keys; a
        mismatch drops the entry, and persistent ones turn the memo off."""
        self.checks += 1
        metrics.child(HISTORY_CHECKS, self.model).inc()
        expected = hit.entry.keys
        if keys[: len(expected)] == expected:
            return True
        self.mismatches += 1
        metrics.child(HISTORY_MISMATCHES, self.model).inc()
        entry = self._entries.pop(hit.key, None)
        if entry is not None:
            self._keys -= len(entry.keys)
        if self.mismatches >= MAX_MISMATCHES and self.mismatches * 20 > self.checks:
            self._off_until = time.monotonic() + self.off_for_s
            self._entries.clear()
            self._keys = 0
            log.warning("model %s: history-memo keys differed from the real ones %d times in %d; memo off for %.0f s",
                        self.model, self.mismatches, self.checks, self.off_for_s)
        return False


def learn_entries(
    tok: PromptTokenizer, memo: HistoryMemo, chain: Chain, body: dict[str, Any], text: str, add_special: bool,
    keys: list[int], block_size: int,
) -> list[tuple[int, Entry]]:
    """Entries for a request's messages (its next turn) and for all but its last message
    (the same history, another last message), each unless the memo has it. Blocking:
    renders the template two to four times; runs in the background thread.

    Each entry is what the request's rendering shares with every sentinel continuation
    of its kind: the likely next messages differ by template (Qwen3 strips earlier
    reasoning after a new user message but not after a tool result, and joins
    consecutive tool results in one turn). An entry that would cover much less of the
    prompt than its messages are of the body is not kept: the template rewrites earlier
    text for that continuation, and the segment cache (outcome ``tail``) finds more."""
    messages = body["messages"]
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    role = last.get("role")
    nxt = [[{"role": "assistant", "content": SENTINEL}, {"role": "user", "content": SENTINEL}]]
    if role == "tool":
        nxt.append([{"role": "tool", "content": SENTINEL, "tool_call_id": "kvrouter"}])
    replaced = [{"role": r, "content": SENTINEL} for r in dict.fromkeys((role if isinstance(role, str) else "user", "user"))]
    cases = [
        (len(messages), [[*messages, *tail] for tail in nxt]),
        (len(messages) - 1, [[*messages[:-1], m] for m in replaced]),
    ]
    total = max(1, len(keys) * block_size)
    out = []
    for j, variants in cases:
        if j == 0 or chain.hashes[j - 1] in memo:
            continue
        shared, chars = _shared(tok, body, text, add_special, variants)
        if shared < total * (chain.sizes[j - 1] / chain.sizes[-1] - MAX_SHORTFALL):
            continue
        blocks = min(shared // block_size, len(keys))
        if blocks:
            out.append((chain.hashes[j - 1], Entry(keys[:blocks], shared, chain.sizes[j - 1], chars, digest(text, chars))))
    return out


def _shared(
    tok: PromptTokenizer, body: dict[str, Any], text: str, add_special: bool, variants: list[list[Any]]
) -> tuple[int, int]:
    """The shortest prefix ``text`` shares with the renderings of ``variants`` (a variant the
    template refuses is a continuation it cannot get; (0, 0) when it refuses them all)."""
    best: tuple[int, int] | None = None
    for messages in variants:
        try:
            other = tok.render_chat({**body, "messages": messages})
        except ValueError:  # the template refuses it (roles must alternate, no tool role, ...)
            continue
        got = tok.shared_tokens(text, other, add_special)
        best = got if best is None or got[0] < best[0] else best
    return best or (0, 0)
