"""Prompt token ids exactly as vLLM 0.33 computes them, fast enough for the hot path.

The router hashes the same token ids the engine will hash, so these must match vLLM's
renderer bit for bit: a single differing token shifts every later block hash and turns
every prefix-cache hit into a miss. Chat requests are normalised like vLLM
(:mod:`router.chat_render`), rendered with the model's own chat template, and
tokenized with the same HF tokenizer and flags vLLM uses.

Speed: tokenization costs 1.3-1.8 µs per token, while most traffic re-sends a long
history. HF tokenizers cut the text at added/special tokens *before* normalising and
pre-tokenizing, so the text between two added tokens (one chat message between
``<|im_start|>`` and ``<|im_end|>``) tokenizes independently of its neighbours. The
segment path splits the rendered prompt at added tokens and keeps each segment's ids in
a bounded LRU keyed by the segment's 128-bit xxh3; only new segments are tokenized.
Tokenizers whose added tokens or pre-tokenizer make a segment depend on its position
are detected at load and use full tokenization, and a sampled share of requests is
also fully tokenized and compared at run time: a mismatch is counted and turns the
segment path off for that model.

Remote tokenization (:class:`RemoteTokenizer`) asks a backend's ``/tokenize``;
:class:`ParityGuard` samples requests for a local-vs-remote comparison and, in mode
``auto``, switches a model to remote tokenization when mismatches persist.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import jinja2
import xxhash
from prometheus_client import Counter, Gauge

from router.chat_render import (
    ChatRequestError,
    UnsupportedContentError,
    detect_content_format,
    filter_template_kwargs,
    normalize_messages,
    normalize_tools,
    template_mentions_role,
    template_variables,
)
from router.fast_sandbox import speed_up

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
PARITY_CHECKS = Counter(
    "kvrouter_tokenizer_parity_checks_total",
    "Requests whose local token ids were compared with a backend's /tokenize",
    ["model"],
)
PARITY_MISMATCHES = Counter(
    "kvrouter_tokenizer_parity_mismatches_total",
    "Local-vs-backend /tokenize comparisons that differed",
    ["model"],
)
REMOTE_MODE = Gauge(
    "kvrouter_tokenizer_remote",
    "1 when the model's prompts are tokenized by a backend's /tokenize, else 0",
    ["model"],
)

DEFAULT_SEGMENT_CACHE_TOKENS = 8_000_000
"""LRU bound in cached token ids (about 8 bytes each in a Python list of small ints
plus the list overhead per segment): ~100 MB at the default."""

_PROBES = (
    "Hello world",
    " leading space",
    "trailing space ",
    "\n\nnew lines\n",
    "  \tmixed \r\n whitespace  ",
    "café naïve 你好 👋🏽",
    "x",
)

GIL_FREE_CHARS = 2048
"""Segments at least this long are tokenized with ``encode_batch([segment])``: HF tokenizers'
``encode`` holds the GIL for the whole call, ``encode_batch`` releases it. A cold 30k-token
segment takes ~30 ms, during which ``encode`` froze the event loop (every stream the router
relays) and the KV-event thread; measured with a spinning thread beside it, the spinner kept
12% of its speed under ``encode`` and all of its share of the cores under ``encode_batch``.
Short segments keep ``encode``: the batch call's set-up costs more than they take."""


class TokenizeError(ValueError):
    """The request is invalid for the engine: the router answers 400 with this message."""


class UnsupportedPrompt(TokenizeError):
    """Valid for vLLM, but not tokenizable here (multimodal parts, prompt embeds).

    A caller that can should fall back to a backend's ``/tokenize`` or route without
    token ids instead of answering 400."""


class RemoteTokenizeError(RuntimeError):
    """A backend's ``/tokenize`` could not be reached or answered with a server error."""


@dataclass(frozen=True, slots=True)
class Scan:
    """:meth:`PromptTokenizer.scan`: ``head`` are the exact ids of ``text[:head_chars]``;
    ``complete``: the cache held every segment, and ``head`` is the whole prompt's ids."""

    uncached_chars: int
    head: list[int]
    head_chars: int
    complete: bool = False


class SegmentCache:
    """Bounded LRU of segment ids keyed by xxh3-128 of the segment text.

    Invariant: the sum of the cached lists' lengths stays <= ``max_tokens``. Thread-safe;
    cached lists are never mutated after insertion (callers copy by ``extend``).
    """

    def __init__(self, max_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, list[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

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
            while self._tokens > self.max_tokens:
                _, evicted = self._entries.popitem(last=False)
                self._tokens -= len(evicted)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens


class PromptTokenizer:
    """One model's tokenizer and chat template; load once, share across threads."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        name: str,
        segment_cache_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS,
        verify_rate: float = 0.01,
        use_segments: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self._hf = hf_tokenizer
        self.name = name
        self.verify_rate = verify_rate
        self._rng = rng or random.Random()
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self._cache = SegmentCache(segment_cache_tokens)
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._added: dict[str, int] = {}
        self._split_re: re.Pattern[str] | None = None
        self._template_info: dict[str, tuple[str, Any, frozenset[str], bool]] = {}
        self.segment_disabled_reason: str | None = (
            self._init_segments() if use_segments else "segment cache disabled by configuration"
        )
        self._special_prefix, self._special_suffix = self._special_wrapping()

    @classmethod
    def load(cls, path_or_hub_id: str, **kwargs: Any) -> PromptTokenizer:
        """Load from a local directory (offline) or a hub id. Blocking: call off the event loop."""
        from transformers import AutoTokenizer

        local = Path(path_or_hub_id).is_dir()
        try:
            hf = AutoTokenizer.from_pretrained(path_or_hub_id, local_files_only=local)
        except (OSError, ValueError) as e:
            raise TokenizeError(f"cannot load tokenizer {path_or_hub_id!r}: {e}") from e
        kwargs.setdefault("name", path_or_hub_id)
        return cls(hf, **kwargs)

    @property
    def segment_enabled(self) -> bool:
        return self.segment_disabled_reason is None

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` behind the HF wrapper (None for slow tokenizers)."""
        return self._backend

    @property
    def special_prefix(self) -> list[int] | None:
        """The ids ``add_special_tokens=True`` puts before the text, None if unknown."""
        return self._special_prefix

    @property
    def special_count(self) -> int:
        """How many ids ``add_special_tokens=True`` adds around the text (an upper bound)."""
        if self._special_prefix is None or self._special_suffix is None:
            return 8
        return len(self._special_prefix) + len(self._special_suffix)

    def cut_outside_added(self, text: str, cut: int) -> int:
        """``cut``, moved back to the start of an added token it would split."""
        if self._split_re is not None:
            longest = max(map(len, self._added))
            for m in self._split_re.finditer(text, max(0, cut - longest), cut + longest):
                if m.start() < cut < m.end():
                    return m.start()
        return cut

    # -- plain text -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, *, check: bool = True) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...)``, through the segment cache.

        ``check=False`` skips the sampled full-tokenization check here; a caller on the
        event loop runs :meth:`check` elsewhere when :meth:`wants_check` says so."""
        if self.segment_disabled_reason is not None:
            return self.encode_full(text, add_special_tokens)
        if add_special_tokens and self._special_prefix is None:
            return self.encode_full(text, True)
        ids = self._encode_segments(text)
        if check and self.wants_check():
            ids = self.check(text, ids)
        if add_special_tokens:
            assert self._special_prefix is not None and self._special_suffix is not None
            return [*self._special_prefix, *ids, *self._special_suffix]
        return ids

    def encode_full(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The reference: exactly the call vLLM makes, no cache."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids)

    @property
    def max_token_id(self) -> int:
        """The largest token id this tokenizer knows (added tokens included)."""
        return len(self._hf) - 1

    # -- OpenAI bodies ----------------------------------------------------------

    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt text vLLM 0.33 renders for a ``/v1/chat/completions`` body."""
        if not isinstance(body, dict):
            raise TokenizeError("request body must be a JSON object")
        if body.get("chat_template") is not None:
            raise TokenizeError("chat_template in the request is not accepted by the engine")
        agp = _bool(body, "add_generation_prompt", True)
        cfm = _bool(body, "continue_final_message", False)
        if agp and cfm:
            raise TokenizeError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        try:
            tools = normalize_tools(body.get("tools"))
            template, content_format, variables, has_developer = self._template(tools is not None)
            conversation = normalize_messages(
                body.get("messages"), content_format=content_format, template_has_developer=has_developer
            )
            kwargs = filter_template_kwargs(body.get("chat_template_kwargs"), variables)
        except UnsupportedContentError as e:
            raise UnsupportedPrompt(str(e)) from e
        except ChatRequestError as e:
            raise TokenizeError(str(e)) from e
        documents = body.get("documents")
        try:
            text = self._hf.apply_chat_template(
                conversation,
                tools=tools,
                documents=documents,
                chat_template=template,
                add_generation_prompt=agp,
                continue_final_message=cfm,
                tokenize=False,
                **kwargs,
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
            raise TokenizeError(f"chat template error: {e}") from e
        if not isinstance(text, str):
            raise TokenizeError("chat template did not render a string")
        return text

    def prompt_text(self, body: dict[str, Any], kind: str) -> tuple[str, bool] | None:
        """The text and ``add_special_tokens`` of a request whose prompt is one text with
        no left truncation, else None (token ids, several prompts, embeddings)."""
        if not isinstance(body, dict) or body.get("truncate_prompt_tokens") is not None:
            return None
        if kind == "chat":
            return self.render_chat(body), _bool(body, "add_special_tokens", False)
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or body.get("prompt_embeds") is not None:
            return None
        return prompt, _bool(body, "add_special_tokens", True)

    def scan(self, text: str, add_special: bool) -> Scan:
        """What the segment cache already holds of ``text``, without tokenizing anything:
        the characters :meth:`encode` would still send to the tokenizer, and the exact ids
        of the longest prefix made of cached segments (and the added tokens after them).

        Segments tokenize independently (see the module docstring), so those head ids are
        what full tokenization starts with; with ``add_special`` they include the
        tokenizer's special prefix, and there is no head when it adds special tokens some
        other way. Head segments are refreshed in the LRU, the others only peeked at."""
        if self.segment_disabled_reason is not None or (add_special and self._special_prefix is None):
            return Scan(len(text), [], 0)
        head: list[int] = list(self._special_prefix) if add_special else []  # type: ignore[arg-type]
        head_chars = missing = pos = 0
        in_head = True
        get, peek, added = self._cache.get, self._cache.peek, self._added
        matches = self._split_re.finditer(text) if self._split_re is not None else ()
        for m in (*matches, None):
            end = m.start() if m is not None else len(text)
            if end > pos:
                ids = (get if in_head else peek)(_segment_key(text[pos:end]))
                if ids is None:
                    missing += end - pos
                    in_head = False
                elif in_head:
                    head += ids
            if m is not None:
                pos = m.end()
                if in_head:
                    head.append(added[m.group()])
                    head_chars = pos
        if not in_head:
            return Scan(missing, head, head_chars)
        if head:  # the caller tokenizes nothing more (a partial head is counted by encode)
            SEGMENT_TOKENS.labels(self.name, "hit").inc(len(head))
        if add_special:
            head += self._special_suffix  # type: ignore[arg-type]
        return Scan(0, head, len(text), complete=True)

    def shared_tokens(self, text: str, other: str, add_special: bool) -> tuple[int, int]:
        """How many leading ids of ``text`` are certainly the leading ids of ``other`` too,
        and the characters of ``text`` they cover: those up to the last added token both
        texts have at the same place (the text between added tokens tokenizes
        independently). Reads segments of ``text`` from the cache without refreshing them,
        so call it right after ``text`` was tokenized; (0, 0) when that cannot be known
        (segment path off, a segment no longer cached)."""
        if self.segment_disabled_reason is not None or self._split_re is None or (add_special and self._special_prefix is None):
            return 0, 0
        n = best = len(self._special_prefix) if add_special else 0  # type: ignore[arg-type]
        pos = 0
        peek = self._cache.peek
        # Which added token matches at a position depends on the next ``longest`` chars
        # (longer alternatives first), so only matches starting that far before the first
        # difference are certainly the same in both texts.
        limit = _common_prefix(text, other) - max(map(len, self._added))
        for m in self._split_re.finditer(text):
            if m.start() > limit:
                break
            if m.start() > pos:
                ids = peek(_segment_key(text[pos : m.start()]))
                if ids is None:
                    break
                n += len(ids)
            n += 1
            pos = m.end()
            best = n
        return (best, pos) if best else (0, 0)

    def text_ids(self, text: str, add_special: bool, *, check: bool = True) -> list[int]:
        """The ids of a prompt :meth:`prompt_text` returned (an empty prompt is an error)."""
        return self._truncate(self.encode(text, add_special, check=check), None, add_special)

    def wants_check(self) -> bool:
        """Whether this request is one of the sampled segment-path checks."""
        return self.segment_disabled_reason is None and self.verify_rate > 0 and self._rng.random() < self.verify_rate

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """Exact prompt ids vLLM 0.33 uses for a ``/v1/chat/completions`` body."""
        text = self.render_chat(body)
        add_special = _bool(body, "add_special_tokens", False)
        ids = self.encode(text, add_special)
        return self._truncate(ids, body.get("truncate_prompt_tokens"), add_special)

    def completion_ids(self, body: dict[str, Any]) -> list[list[int]]:
        """One id list per prompt of a ``/v1/completions`` body (route on the first)."""
        if not isinstance(body, dict):
            raise TokenizeError("request body must be a JSON object")
        if body.get("prompt_embeds") is not None:
            raise UnsupportedPrompt("prompt_embeds cannot be tokenized by the router")
        add_special = _bool(body, "add_special_tokens", True)
        truncate = body.get("truncate_prompt_tokens")
        out: list[list[int]] = []
        for prompt in _completion_prompts(body.get("prompt")):
            if isinstance(prompt, str):
                ids = self.encode(prompt, add_special)
                out.append(self._truncate(ids, truncate, add_special))
            else:
                out.append(self._truncate(prompt, truncate, False))
        return out

    # -- internals --------------------------------------------------------------

    def _template(self, with_tools: bool) -> tuple[str, Any, frozenset[str], bool]:
        key = "tool_use" if with_tools else "default"
        info = self._template_info.get(key)
        if info is None:
            raw = self._hf.chat_template
            if isinstance(raw, dict):
                raw = raw.get(key) or raw.get("default")
            if not isinstance(raw, str):
                raise TokenizeError(f"tokenizer {self.name!r} has no chat template")
            info = (raw, detect_content_format(raw), template_variables(raw), template_mentions_role(raw, "developer"))
            speed_up(raw)
            self._template_info[key] = info
        return info

    def _truncate(self, ids: list[int], truncate: Any, add_special: bool) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: keep the last N (left truncation).

        HF truncates before adding special tokens, so with ``add_special_tokens`` the
        specials survive and the text keeps N minus their count. ``-1`` means the
        engine's ``max_model_len``, which the engine enforces itself.
        """
        if truncate is None:
            ids_out = ids
        else:
            if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < -1:
                raise TokenizeError("truncate_prompt_tokens must be an integer >= -1")
            if truncate == -1 or len(ids) <= truncate:
                ids_out = ids
            elif add_special and self._special_prefix is not None and self._special_suffix is not None:
                pre, suf = len(self._special_prefix), len(self._special_suffix)
                keep = max(truncate - pre - suf, 0)
                body = ids[pre : len(ids) - suf]
                ids_out = [*ids[:pre], *(body[len(body) - keep :] if keep else []), *ids[len(ids) - suf :]]
            else:
                ids_out = ids[len(ids) - truncate :] if truncate else []
        if not ids_out:
            raise TokenizeError("Either prompt or prompt_embeds must be provided and non-empty.")
        return ids_out

    def _init_segments(self) -> str | None:
        """Set up the added-token splitter; return why the segment path is unsafe, or None."""
        if self._backend is None:
            return "tokenizer has no tokenizers backend"
        if getattr(self._hf, "split_special_tokens", False):
            return "split_special_tokens is set"
        reason = _position_dependence(json.loads(self._backend.to_str()))
        if reason is not None:
            return reason
        added = self._backend.get_added_tokens_decoder()
        for tid, tok in added.items():
            if tok.lstrip or tok.rstrip or tok.single_word:
                return f"added token {tok.content!r} strips or matches whole words"
            if tok.normalized and self._backend.normalizer is not None:
                return f"added token {tok.content!r} is matched after normalization"
            self._added[tok.content] = tid
        if self._added:
            alternatives = sorted(self._added, key=len, reverse=True)
            self._split_re = re.compile("|".join(re.escape(a) for a in alternatives))
        for probe in _PROBES:
            for text in (probe, f"{probe}<|x|>{probe}", *(f"{a}{probe}{a}" for a in list(self._added)[:3])):
                if self._encode_segments(text, cache=False) != self.encode_full(text):
                    self._cache.clear()
                    return f"segment and full tokenization differ on the probe {text!r}"
        return None

    def _special_wrapping(self) -> tuple[list[int] | None, list[int] | None]:
        """The ids ``add_special_tokens=True`` puts before and after the text (e.g. BOS)."""
        core = self.encode_full("a b", False)
        full = self.encode_full("a b", True)
        n = len(core)
        for i in range(len(full) - n + 1):
            if full[i : i + n] == core:
                prefix, suffix = full[:i], full[i + n :]
                if self.encode_full("", True) == [*prefix, *suffix]:
                    return prefix, suffix
        return None, None

    def _encode_segments(self, text: str, cache: bool = True) -> list[int]:
        ids: list[int] = []
        hit = miss = 0
        pos = 0
        encode, encode_batch = self._backend.encode, self._backend.encode_batch
        matches = self._split_re.finditer(text) if self._split_re is not None else ()
        for m in (*matches, None):
            end = m.start() if m is not None else len(text)
            if end > pos:
                segment = text[pos:end]
                key = _segment_key(segment)
                seg_ids = self._cache.get(key) if cache else None
                if seg_ids is None:
                    if len(segment) < GIL_FREE_CHARS:
                        seg_ids = encode(segment, add_special_tokens=False).ids
                    else:  # same pipeline, but Rust releases the GIL (see GIL_FREE_CHARS)
                        seg_ids = encode_batch([segment], add_special_tokens=False)[0].ids
                    miss += len(seg_ids)
                    if cache:
                        self._cache.put(key, seg_ids)
                else:
                    hit += len(seg_ids)
                ids.extend(seg_ids)
            if m is not None:
                ids.append(self._added[m.group()])
                pos = m.end()
        if cache:
            if hit:
                SEGMENT_TOKENS.labels(self.name, "hit").inc(hit)
            if miss:
                SEGMENT_TOKENS.labels(self.name, "miss").inc(miss)
        return ids

    def check_prompt(self, text: str, ids: list[int], add_special: bool) -> None:
        """:meth:`check` for the ids :meth:`text_ids` returned (special tokens stripped)."""
        if add_special and self._special_prefix is not None and self._special_suffix is not None:
            ids = ids[len(self._special_prefix) : len(ids) - len(self._special_suffix)]
        self.check(text, ids)

    def check(self, text: str, ids: list[int]) -> list[int]:
        """Compare segment ids (no special tokens) with full tokenization; on a mismatch
        disable the segment path and return the full ids."""
        SEGMENT_CHECKS.labels(self.name).inc()
        full = self.encode_full(text)
        if ids != full:
            SEGMENT_MISMATCHES.labels(self.name).inc()
            self.segment_disabled_reason = "runtime check found a segment/full mismatch"
            self._cache.clear()
            log.warning("tokenizer %s: segment-cached ids differ from full tokenization; segment path disabled", self.name)
        return full


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


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TokenizeError(f"{key} must be a boolean")
    return value


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """Split ``prompt`` (str | list[str] | list[int] | list[list[int]]) into prompts."""
    empty = "Either prompt or prompt_embeds must be provided and non-empty."
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and _all_token_ids(prompt):
        return [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise TokenizeError(empty)
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise TokenizeError(empty)
        elif isinstance(p, list):
            if not p:
                raise TokenizeError(empty)
            if not _all_token_ids(p):
                raise TokenizeError("prompt token ids must be non-negative integers")
        else:
            raise TokenizeError("prompt must be a string, a list of strings, a list of token ids or a list of those")
    return prompts


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _all_token_ids(ids: list[Any]) -> bool:
    """``all(_is_token_id(t) for t in ids)``, several times faster on the usual plain ints.

    A 3k-token id prompt is validated on every request; ``map(type, ...)`` and ``min``
    run in C (~0.1 ms) where the generator costs ~0.3-0.5 ms of GIL-held Python. Anything
    that is not exactly ``int`` (bools, floats, subclasses) takes the reference path.
    """
    if set(map(type, ids)) == {int}:
        return min(ids) >= 0
    return all(_is_token_id(t) for t in ids)


_CACHE: dict[str, PromptTokenizer] = {}
_CACHE_LOCK = threading.Lock()


def load_tokenizer(path_or_hub_id: str) -> PromptTokenizer:
    """The process-wide :class:`PromptTokenizer` for this path (loaded on first use)."""
    with _CACHE_LOCK:
        tok = _CACHE.get(path_or_hub_id)
        if tok is None:
            tok = _CACHE[path_or_hub_id] = PromptTokenizer.load(path_or_hub_id)
        return tok


_TOKENIZE_CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template_kwargs",
    "tools",
    "documents",
    "mm_processor_kwargs",
)


class RemoteTokenizer:
    """Token ids from a backend's vLLM ``POST /tokenize``.

    ``/tokenize`` has no ``truncate_prompt_tokens``, so truncation is applied here to
    the ids it returns (keep the last N, like the engine).
    """

    def __init__(self, model: str, timeout: float = 10.0) -> None:
        self.model = model
        self.timeout = timeout

    async def chat_ids(self, base_url: str, body: dict[str, Any], client: httpx.AsyncClient) -> list[int]:
        payload: dict[str, Any] = {"model": self.model}
        payload.update({k: body[k] for k in _TOKENIZE_CHAT_FIELDS if body.get(k) is not None})
        ids = await self._tokenize(base_url, payload, client)
        return _keep_last(ids, body.get("truncate_prompt_tokens"))

    async def completion_ids(self, base_url: str, body: dict[str, Any], client: httpx.AsyncClient) -> list[list[int]]:
        add_special = _bool(body, "add_special_tokens", True)
        out: list[list[int]] = []
        for prompt in _completion_prompts(body.get("prompt")):
            if isinstance(prompt, str):
                payload = {"model": self.model, "prompt": prompt, "add_special_tokens": add_special}
                prompt = await self._tokenize(base_url, payload, client)
            out.append(_keep_last(prompt, body.get("truncate_prompt_tokens")))
        return out

    async def _tokenize(self, base_url: str, payload: dict[str, Any], client: httpx.AsyncClient) -> list[int]:
        url = base_url.rstrip("/") + "/tokenize"
        try:
            r = await client.post(url, json=payload, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise RemoteTokenizeError(f"{url}: {e!r}") from e
        if 400 <= r.status_code < 500:
            raise TokenizeError(_error_message(r))
        if r.status_code != 200:
            raise RemoteTokenizeError(f"{url} answered {r.status_code}: {r.text[:200]}")
        try:
            tokens = r.json()["tokens"]
        except (ValueError, KeyError, TypeError) as e:
            raise RemoteTokenizeError(f"{url} answered without a token list") from e
        if not isinstance(tokens, list) or not all(_is_token_id(t) for t in tokens):
            raise RemoteTokenizeError(f"{url} answered a malformed token list")
        return tokens


def _keep_last(ids: list[int], truncate: Any) -> list[int]:
    if truncate is None or truncate == -1:
        return ids
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < -1:
        raise TokenizeError("truncate_prompt_tokens must be an integer >= -1")
    return ids[len(ids) - truncate :] if truncate < len(ids) else ids


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return r.text[:500] or f"backend answered {r.status_code}"


TokenizerMode = Literal["local", "remote", "auto"]


class ParityGuard:
    """Sampled local-vs-backend tokenization checks for one model.

    ``mode``: ``local`` never switches; ``remote`` always tokenizes remotely; ``auto``
    starts local and switches to remote once ``threshold`` of the last ``window``
    checks mismatched (one bad template render is noise; a pattern means the local
    tokenizer or template differs from the engine's).
    """

    def __init__(
        self,
        model: str,
        mode: TokenizerMode = "auto",
        sample_rate: float = 0.01,
        window: int = 20,
        threshold: int = 3,
        rng: Callable[[], float] | None = None,
    ) -> None:
        if mode not in ("local", "remote", "auto"):
            raise ValueError(f"tokenizer mode must be local, remote or auto, not {mode!r}")
        self.model = model
        self.configured_mode: TokenizerMode = mode
        self.sample_rate = sample_rate
        self.threshold = threshold
        self._recent: deque[bool] = deque(maxlen=window)
        self._switched = mode == "remote"
        self._rng = rng or random.random
        self._lock = threading.Lock()
        self.checks = 0
        self.mismatches = 0
        REMOTE_MODE.labels(model).set(1 if self._switched else 0)

    @property
    def mode(self) -> Literal["local", "remote"]:
        return "remote" if self._switched else "local"

    def should_check(self) -> bool:
        """Whether this request's local ids should also be compared remotely."""
        return not self._switched and self.sample_rate > 0 and self._rng() < self.sample_rate

    def record(self, local_ids: list[int], remote_ids: list[int]) -> bool:
        """Count one comparison; returns whether the ids matched."""
        matched = local_ids == remote_ids
        PARITY_CHECKS.labels(self.model).inc()
        if not matched:
            PARITY_MISMATCHES.labels(self.model).inc()
        with self._lock:
            self.checks += 1
            self.mismatches += 0 if matched else 1
            self._recent.append(matched)
            if (
                self.configured_mode == "auto"
                and not self._switched
                and self._recent.count(False) >= self.threshold
            ):
                self._switched = True
                REMOTE_MODE.labels(self.model).set(1)
                log.warning(
                    "tokenizer parity: %d of the last %d checks for %s mismatched; switching to remote tokenization",
                    self._recent.count(False),
                    len(self._recent),
                    self.model,
                )
        if not matched:
            log.warning("tokenizer parity mismatch for %s (%d local vs %d remote ids)", self.model, len(local_ids), len(remote_ids))
        return matched

    async def check_chat(
        self, local_ids: list[int], body: dict[str, Any], remote: RemoteTokenizer, base_url: str, client: httpx.AsyncClient
    ) -> bool:
        return self.record(local_ids, await remote.chat_ids(base_url, body, client))

    async def check_completion(
        self, local_ids: list[list[int]], body: dict[str, Any], remote: RemoteTokenizer, base_url: str, client: httpx.AsyncClient
    ) -> bool:
        remote_ids = await remote.completion_ids(base_url, body, client)
        return self.record([t for p in local_ids for t in p], [t for p in remote_ids for t in p])
