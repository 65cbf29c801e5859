"""Tokenize only the parts of a prompt not seen before, with the ids full tokenization gives.

Tokenization costs 1.3-1.8 µs per token, while most traffic re-sends a long history. HF
tokenizers cut the text at added/special tokens *before* normalising and
pre-tokenizing, so the text between two added tokens (one chat message between
``<|im_start|>`` and ``<|im_end|>``) tokenizes independently of its neighbours.
:class:`SegmentTokenizer` splits a prompt at added tokens and keeps each segment's ids
in a bounded LRU keyed by the segment's 128-bit xxh3; only new segments are tokenized.

A long segment is cut further, at paragraph breaks (:data:`PARAGRAPH_CUT`), so that a
message made of shared parts and a new one (RAG documents then a question) reuses the
shared parts' ids: byte-level BPE tokenizers with a GPT-2/Llama-3 style pre-tokenizer end a
pre-token at a run of line breaks followed by a letter, and BPE never merges across
pre-tokens. Tokenizers where that does not hold are found by probes at load, and keep
whole segments.

Invariant: ``SegmentTokenizer.encode(text) == tokenizer.encode(text,
add_special_tokens=False)``. Tokenizers whose added tokens or pre-tokenizer make a
segment depend on its position are detected at load and keep full tokenization, and a
sampled share of requests is also fully tokenized and compared at run time
(:meth:`SegmentTokenizer.check`): a mismatch is counted and turns the segment path off
for that model.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import xxhash
from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)

SEGMENT_CHECKS = Counter(
    "kvrouter_tokenizer_segment_checks_total",
    "Requests tokenized both by segment cache and in full to verify the segment path",
    ["model"],
)
SEGMENT_MISMATCHES = Counter(
    "kvrouter_tokenizer_segment_mismatches_total",
    "Segment-cache tokenizations that differed from full tokenization (segment path then disabled)",
    ["model"],
)
SEGMENT_TOKENS = Counter(
    "kvrouter_tokenizer_segment_tokens_total",
    "Prompt tokens served by the segment path, by whether their segment was cached",
    ["model", "result"],
)

CACHE_TOKENS = Gauge(
    "kvrouter_tokenizer_segment_cache_tokens",
    "Token ids the segment cache holds (bounded by Tuning.segment_cache_tokens; ~35 bytes each)",
    ["model"],
    multiprocess_mode="livesum",
)

DEFAULT_SEGMENT_CACHE_TOKENS = 8_000_000
"""LRU bound in cached token ids (``Tuning.segment_cache_tokens``, router/tuning.py). Each is a
pointer in a Python list and, above 256, an int
object of its own: ~35 bytes a token on English text with the Qwen3 tokenizer (80% of ids
above 256), so ~280 MB at the default when full. (``array("I")`` would hold 4 bytes a
token, but every hit would then build its ints: ~85 µs per 8k cached tokens on the event
loop instead of ~7.)"""

GIL_FREE_CHARS = 2048
"""Segments at least this long are tokenized with ``encode_batch([segment])``: HF tokenizers'
``encode`` holds the GIL for the whole call, ``encode_batch`` releases it. A cold 30k-token
segment takes ~30 ms, during which ``encode`` froze the event loop (every stream the router
relays) and the KV-event thread; measured with a spinning thread beside it, the spinner kept
12% of its speed under ``encode`` and all of its share of the cores under ``encode_batch``.
Short segments keep ``encode``: the batch call's set-up costs more than they take."""

PARAGRAPH_CUT = re.compile(r"\n\n\n*(?=[^\W\d_])")
"""Where a long segment is cut into chunks that tokenize independently: after a paragraph
break (two or more line breaks), before a letter. The cut depends only on the characters
around it, so a shared document's chunks are the same wherever it sits in a message.
(Spelled with literal line breaks first, not ``\n{2,}``: ``re`` then skips to each line
break, 14x faster on a 38 kB prompt.)"""

CHUNKED_CHARS = 1024
"""Segments at least this long are cut at :data:`PARAGRAPH_CUT`; shorter ones are not worth
the extra cache entries. A cut segment is cached whole too, so that a history re-sent as it
was costs one lookup per message, as before (its ids count twice against the cache's bound)."""

_PARAGRAPH_PROBES = (
    "Document 3:\nThe first paragraph.\n\nQuestion: why?",
    "end of a sentence.\n\nNext one",
    "trailing spaces  \n\nWord",
    "windows\r\n\r\nLine",
    "a tab\t\nÉcole",
    "中文\n\n你好",
    "emoji 👋🏽\nx",
    "digits 12\n\n34 then\nwords",
    "it's\n's quoted\n'tis",
    "  indented\n    code\nreturn x",
    "café\u0301\nnaïve",
)

_PROBES = (
    "Hello world",
    " leading space",
    "trailing space ",
    "\n\nnew lines\n",
    "  \tmixed \r\n whitespace  ",
    "café naïve 你好 👋🏽",
    "x",
)


@dataclass(frozen=True, slots=True)
class Scan:
    """:meth:`router.prompt.tokenize.PromptTokenizer.scan`: ``head`` are the exact ids of
    ``text[:head_chars]``; ``complete``: the cache held every segment, and ``head`` is the
    whole prompt's ids."""

    uncached_chars: int
    head: list[int]
    head_chars: int
    complete: bool = False


class SegmentCache:
    """Bounded LRU of segment ids keyed by xxh3-128 of the segment text.

    Invariant: the sum of the cached lists' lengths stays <= ``max_tokens``. Thread-safe;
    cached lists are never mutated after insertion (callers copy by ``extend``).
    """

    def __init__(self, max_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS, model: str | None = None) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, list[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self._gauge = CACHE_TOKENS.labels(model) if model is not None else None
        """The fill, for a soak to tell a cache filling toward its bound from a leak."""

    def get(self, key: int) -> list[int] | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
            return ids

    def peek(self, key: int) -> list[int] | None:
        """Like :meth:`get`, without refreshing the entry's LRU position."""
        return self._entries.get(key)

    def put(self, key: int, ids: list[int]) -> None:
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._entries[key] = ids
            self._tokens += len(ids)
            self._evict()

    def resize(self, max_tokens: int) -> None:
        """A new bound (``Tuning.segment_cache_tokens``, router/tuning.py), evicting the oldest entries above it."""
        with self._lock:
            self.max_tokens = max_tokens
            self._evict()

    def _evict(self) -> None:
        while self._tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= len(evicted)
        if self._gauge is not None:
            self._gauge.set(self._tokens)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0
            if self._gauge is not None:
                self._gauge.set(0)

    def keys(self) -> list[int]:
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens


class SegmentTokenizer:
    """The segment path for one HF tokenizer. All ids here are without special tokens;
    :class:`router.prompt.tokenize.PromptTokenizer` adds those around them."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        name: str,
        cache_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS,
        verify_rate: float = 0.01,
        enabled: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self._hf = hf_tokenizer
        self.name = name
        self.verify_rate = verify_rate
        self._rng = rng or random.Random()
        self.cache = SegmentCache(cache_tokens, name)
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self.added: dict[str, int] = {}
        """Added token text -> id: the points where the text is cut into segments."""
        self._text_of: dict[int, str] = {}
        self._split_re: re.Pattern[str] | None = None
        self._cut_re: re.Pattern[str] | None = None
        """:data:`PARAGRAPH_CUT` where the probes at load found it safe, else None."""
        self.disabled_reason: str | None = self._init() if enabled else "segment cache disabled by configuration"

    def encode_full(self, text: str) -> list[int]:
        """The reference: exactly the call vLLM makes (without special tokens), no cache."""
        return list(self._hf.encode(text, add_special_tokens=False))

    def encode(self, text: str, cache: bool = True) -> list[int]:
        """``encode_full(text)``, tokenizing only the segments (or paragraphs) the cache lacks."""
        ids: list[int] = []
        hit = miss = 0
        get, put = self.cache.get, self.cache.put
        for part in self._parts(text):
            if type(part) is int:
                ids.append(part)
                continue
            key = _segment_key(part)
            seg_ids = get(key) if cache else None
            if seg_ids is None:
                seg_ids, tokenized = self._segment_ids(part, cache)
                miss += tokenized
                hit += len(seg_ids) - tokenized
                if cache:
                    put(key, seg_ids)
            else:
                hit += len(seg_ids)
            ids.extend(seg_ids)
        if cache:
            if hit:
                SEGMENT_TOKENS.labels(self.name, "hit").inc(hit)
            if miss:
                SEGMENT_TOKENS.labels(self.name, "miss").inc(miss)
        return ids

    def _segment_ids(self, segment: str, cache: bool) -> tuple[list[int], int]:
        """The ids of a segment the cache lacks as a whole, and how many of them were
        tokenized now: a long one's paragraphs are looked up and only the missing ones
        tokenized (then cached on their own, so that the next message reusing them finds them)."""
        chunks = self._chunks(segment)
        if len(chunks) == 1:
            ids = self._tokenize(chunks)[0]
            return ids, len(ids)
        found = [self.cache.get(_segment_key(c)) if cache else None for c in chunks]
        fresh = iter(self._tokenize([c for c, ids in zip(chunks, found) if ids is None]))
        out: list[int] = []
        tokenized = 0
        for chunk, ids in zip(chunks, found):
            if ids is None:
                ids = next(fresh)
                tokenized += len(ids)
                if cache:
                    self.cache.put(_segment_key(chunk), ids)
            out.extend(ids)
        return out, tokenized

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """The ids of each of ``texts``, tokenized alone: in one ``encode_batch`` call when
        they are long together (Rust releases the GIL, see :data:`GIL_FREE_CHARS`), else one
        ``encode`` each (the batch call's set-up costs more than short texts take)."""
        if sum(map(len, texts)) < GIL_FREE_CHARS:
            encode = self._backend.encode
            return [encode(text, add_special_tokens=False).ids for text in texts]
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]

    def _parts(self, text: str) -> Iterator[str | int]:
        """``text`` as the pieces that tokenize independently, in order: each segment between
        added tokens, and each added token's id."""
        pos = 0
        matches = self._split_re.finditer(text) if self._split_re is not None else ()
        for m in (*matches, None):
            end = m.start() if m is not None else len(text)
            if end > pos:
                yield text[pos:end]
            if m is not None:
                yield self.added[m.group()]
                pos = m.end()

    def _chunks(self, segment: str) -> list[str]:
        """A long segment cut at :data:`PARAGRAPH_CUT`; a short one (or any, where the cut
        is unsafe for this tokenizer) whole."""
        if self._cut_re is None or len(segment) < CHUNKED_CHARS:
            return [segment]
        chunks: list[str] = []
        pos = 0
        for cut in self._cut_re.finditer(segment):
            chunks.append(segment[pos : cut.end()])
            pos = cut.end()
        chunks.append(segment[pos:])
        return chunks

    def _lookup(self, segment: str, lookup: Callable[[int], list[int] | None]) -> Iterator[tuple[int, list[int] | None]]:
        """A segment's cached ids as (characters, ids) pieces: the whole segment, or where
        the cache lacks it whole, each of its paragraphs (ids None where one is missing)."""
        ids = lookup(_segment_key(segment))
        chunks = self._chunks(segment) if ids is None else ()
        if len(chunks) <= 1:
            yield len(segment), ids
            return
        for chunk in chunks:
            yield len(chunk), lookup(_segment_key(chunk))

    def scan(self, text: str) -> Scan:
        """What the cache already holds of ``text``, without tokenizing anything: the
        characters :meth:`encode` would still send to the tokenizer, and the exact ids of
        the longest prefix made of cached segments or paragraphs (and the added tokens
        after them). Head entries are refreshed in the LRU, the others only peeked at."""
        head: list[int] = []
        head_chars = missing = pos = 0
        in_head = True
        get, peek = self.cache.get, self.cache.peek
        for part in self._parts(text):
            if type(part) is int:
                pos += len(self._text_of[part])
                if in_head:
                    head.append(part)
                    head_chars = pos
                continue
            for chars, ids in self._lookup(part, get if in_head else peek):
                pos += chars
                if ids is None:
                    missing += chars
                    in_head = False
                elif in_head:
                    head += ids
                    head_chars = pos
        if not in_head:
            return Scan(missing, head, head_chars)
        if head:  # the caller tokenizes nothing more (a partial head is counted by encode)
            SEGMENT_TOKENS.labels(self.name, "hit").inc(len(head))
        return Scan(0, head, len(text), complete=True)

    def shared_tokens(self, text: str, other: str) -> tuple[int, int]:
        """How many leading ids of ``text`` are certainly the leading ids of ``other`` too,
        and the characters of ``text`` they cover: those up to the last added token both
        texts have at the same place. (0, 0) when none are, or a segment is no longer cached."""
        if self._split_re is None:
            return 0, 0
        n = best = pos = at = 0
        # Which added token matches at a position depends on the next ``longest`` chars
        # (longer alternatives first), so only matches starting that far before the first
        # difference are certainly the same in both texts.
        limit = _common_prefix(text, other) - max(map(len, self.added))
        for part in self._parts(text):
            if type(part) is not int:
                found = [ids for _, ids in self._lookup(part, self.cache.peek)]
                if None in found:
                    break
                n += sum(map(len, found))  # type: ignore[arg-type]
                pos += len(part)
                continue
            if pos > limit:
                break
            n += 1
            pos += len(self._text_of[part])
            best, at = n, pos
        return (best, at) if best else (0, 0)

    def cut_outside_added(self, text: str, cut: int) -> int:
        """``cut``, moved back to the start of an added token it would split."""
        if self._split_re is not None:
            longest = max(map(len, self.added))
            for m in self._split_re.finditer(text, max(0, cut - longest), cut + longest):
                if m.start() < cut < m.end():
                    return m.start()
        return cut

    def wants_check(self) -> bool:
        """Whether this request is one of the sampled checks against full tokenization."""
        return self.disabled_reason is None and self.verify_rate > 0 and self._rng.random() < self.verify_rate

    def check(self, text: str, ids: list[int]) -> list[int]:
        """Compare segment ids with full tokenization; on a mismatch disable the segment
        path and return the full ids."""
        SEGMENT_CHECKS.labels(self.name).inc()
        full = self.encode_full(text)
        if ids != full:
            SEGMENT_MISMATCHES.labels(self.name).inc()
            self.disabled_reason = "runtime check found a segment/full mismatch"
            self.cache.clear()
            log.warning("tokenizer %s: segment-cached ids differ from full tokenization; segment path disabled", self.name)
        return full

    def _init(self) -> str | None:
        """Set up the added-token splitter; return why the segment path is unsafe, or None."""
        if self._backend is None:
            return "tokenizer has no tokenizers backend"
        if getattr(self._hf, "split_special_tokens", False):
            return "split_special_tokens is set"
        reason = _position_dependence(json.loads(self._backend.to_str()))
        if reason is not None:
            return reason
        for tid, tok in self._backend.get_added_tokens_decoder().items():
            if tok.lstrip or tok.rstrip or tok.single_word:
                return f"added token {tok.content!r} strips or matches whole words"
            if tok.normalized and self._backend.normalizer is not None:
                return f"added token {tok.content!r} is matched after normalization"
            self.added[tok.content] = tid
        if self.added:
            alternatives = sorted(self.added, key=len, reverse=True)
            self._split_re = re.compile("|".join(re.escape(a) for a in alternatives))
        self._text_of = {tid: text for text, tid in self.added.items()}
        for probe in _PROBES:
            for text in (probe, f"{probe}<|x|>{probe}", *(f"{a}{probe}{a}" for a in list(self.added)[:3])):
                if self.encode(text, cache=False) != self.encode_full(text):
                    return f"segment and full tokenization differ on the probe {text!r}"
        self._cut_re = PARAGRAPH_CUT
        long = "\n".join(_PARAGRAPH_PROBES * (1 + CHUNKED_CHARS // len("\n".join(_PARAGRAPH_PROBES))))
        for probe in (long, "\n\n".join(_PARAGRAPH_PROBES) + "\n" + long, long.replace("\n", " \n\n")):
            if self.encode(probe, cache=False) != self.encode_full(probe):
                log.info("tokenizer %s: a segment cut at paragraph breaks tokenizes differently; segments stay whole", self.name)
                self._cut_re = None
                break
        return None


def _segment_key(segment: str) -> int:
    return xxhash.xxh3_128_intdigest(segment.encode("utf-8", "surrogatepass"))


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search: each probe is a C-speed compare)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _position_dependence(spec: dict[str, Any]) -> str | None:
    """Why this tokenizer.json makes a segment's ids depend on where it sits, or None."""

    def walk(node: Any) -> str | None:
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "Metaspace" and node.get("prepend_scheme", "always") == "first":
                return "Metaspace prepend_scheme 'first' (a prefix space only at the start)"
            if kind == "Prepend":
                return "Prepend normalizer"
            if node.get("add_prefix_space") is True:
                return f"{kind} add_prefix_space"
            for v in node.values():
                found = walk(v)
                if found:
                    return found
        elif isinstance(node, list):
            for v in node:
                found = walk(v)
                if found:
                    return found
        return None

    return walk(spec.get("normalizer")) or walk(spec.get("pre_tokenizer"))
