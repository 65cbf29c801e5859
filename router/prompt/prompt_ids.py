"""A prompt's exact token ids and block keys: on the event loop, in the tokenizer pool, or from a backend.

The plan stage (:mod:`router.plans`) calls :meth:`IdSource.exact` for every request it
routes on all of its ids. Where the work runs is decided by its size:

- on the event loop when it is cheap: a body of at most ``Tuning.inline_tokenize_bytes`` (router/tuning.py),
  a rendered prompt with at most that many characters the segment cache lacks, or a
  prompt given as at most :data:`INLINE_ID_TOKENS` token ids. Under load the thread hop
  is what costs: the job waits for a pool thread and the GIL (held by the other tokenizer
  thread and the KV-event thread), then for the loop to pick up the result. On the
  Mooncake bench (~3k-token id prompts, ~30 req/s on 2 cores) it was ~20 ms of the
  router's overhead, for ~2 ms of work;
- in the two-thread tokenizer pool otherwise, so a 100k-token prompt never stalls the loop;
- at a healthy backend's ``/tokenize`` when the model tokenizes remotely, or when the
  local tokenizer crashed on this prompt (counted in ``kvrouter_tokenizer_fallbacks``).

Nothing here acts: the sampled checks of the ids (segment cache against a full
tokenization, local against a backend) are work the request owes after it is sent
(:mod:`router.settle`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from router import metrics
from router.fleet.backends import BackendPool
from router.http.errors import BadRequest, NoHealthyBackend, Overloaded, PromptTooLong, RouterError, UpstreamError
from router.runtime import ModelRuntime
from router.prompt.prompt_fields import TokenizeError, UnsupportedPrompt
from router.prompt.remote_tokenize import RemoteTokenizeError
from router.prompt.tokenize import TooLong

log = logging.getLogger(__name__)

INLINE_ID_TOKENS = 8192
"""Longest token-id prompt hashed on the event loop: a full cache miss of 512 blocks costs
~1.5 ms of SHA-256, still less than a thread hop under load."""

UNKNOWN_LIMIT = 1 << 20
"""The token count past which a model whose ``max_model_len`` nobody knows is not
tokenized (routed without cache information, the engine judges it): the router's work
and memory stay bounded whatever a client sends."""

TRIM_AFTER_BYTES = 4 << 20
"""A pool job on a body this large hands its freed memory back to the OS when done
(glibc keeps a big job's peak otherwise: a 15 MiB prompt left 1.9 GB resident)."""


@dataclass(slots=True)
class Rendered:
    """A single-text prompt rendered once per request (see ``PromptTokenizer.prompt_text``)."""

    text: str
    add_special: bool
    uncached_chars: int
    ids: list[int] | None = None
    """All of its ids, when the segment cache held every segment (nothing to tokenize)."""


@dataclass(slots=True)
class Ids:
    """A prompt's exact ids (the first prompt of a batch), every prompt's length, its block
    keys, and what computing them cost (observed when the request is sent)."""

    token_ids: list[int]
    lengths: list[int]
    keys: list[int]
    tokenize_s: float = 0.0
    hash_s: float = 0.0


class IdSource:
    """Exact ids and keys for one router: its tokenizer pool, its backends, its inline budget."""

    def __init__(self, executor: Executor, pool: BackendPool, inline_bytes: int, pending_bytes: int) -> None:
        self.executor = executor
        self.pool = pool
        self.inline_bytes = inline_bytes
        """``Tuning.inline_tokenize_bytes``: text this short is tokenized on the event loop."""
        self.max_pending = pending_bytes
        """``Tuning.tokenize_pending_bytes``: the most body bytes waiting for, or in, the pool."""
        self.pending = 0

    async def exact(
        self, rt: ModelRuntime, body: dict[str, Any], kind: str, raw_len: int,
        lora: dict[str, Any] | None, salt: str | None, rendered: Rendered | None = None,
    ) -> Ids:
        """Raises :class:`UnsupportedPrompt` for a prompt the router cannot tokenize (the
        engine judges it), ``BadRequest`` for one the tokenizer refuses."""
        if not rt.local:
            return await self._remote(rt, body, kind, raw_len, lora, salt)
        prompt = body.get("prompt") if kind == "completion" else None
        # A shape hint only: completion_ids validates every id, inline or not.
        given = prompt if isinstance(prompt, list) and prompt and type(prompt[0]) is int else None
        inline = (raw_len <= self.inline_bytes or (given is not None and len(given) <= INLINE_ID_TOKENS)
                  or (rendered is not None and rendered.uncached_chars <= self.inline_bytes))
        try:
            if inline:
                return local_ids(rt, body, kind, lora, salt, rendered)
            return await self._in_pool(rt, body, kind, raw_len, lora, salt, rendered)
        except (TokenizeError, RouterError):
            raise
        except Exception as e:  # noqa: BLE001 - a tokenizer crash must not fail the request
            log.warning("local tokenization of %s failed (%r); asking a backend", rt.name, e)
            metrics.child(metrics.TOKENIZER_FALLBACKS, rt.name, "local_error").inc()
            return await self._remote(rt, body, kind, 0, lora, salt)

    async def _in_pool(
        self, rt: ModelRuntime, body: dict[str, Any], kind: str, raw_len: int,
        lora: dict[str, Any] | None, salt: str | None, rendered: Rendered | None,
    ) -> Ids:
        """:func:`local_ids` in the tokenizer pool, its queue bounded in bytes: past the
        bound a request gets a 429 (a client cannot queue unbounded work and memory)."""
        if self.pending and self.pending + raw_len > self.max_pending:
            raise Overloaded(f"the router's tokenizer has {self.pending} bytes of prompts queued; try again",
                             retry_after_s=1, code="tokenizer_busy")
        self.pending += raw_len
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, _pool_job, rt, body, kind, lora, salt, rendered, raw_len)
        finally:
            self.pending -= raw_len

    async def _remote(
        self, rt: ModelRuntime, body: dict[str, Any], kind: str, raw_len: int, lora: dict[str, Any] | None, salt: str | None
    ) -> Ids:
        t0 = time.perf_counter()
        prompts = await self.remote_prompts(rt, body, kind)
        tokenize_s = time.perf_counter() - t0
        first = prompts[0] if prompts else []
        if raw_len <= self.inline_bytes or len(first) <= INLINE_ID_TOKENS:
            keys = rt.hash_cache.hash_int64(first, lora=lora, cache_salt=salt)
        else:
            keys = await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: rt.hash_cache.hash_int64(first, lora=lora, cache_salt=salt))
        return Ids(first, [len(p) for p in prompts], keys, tokenize_s, time.perf_counter() - t0 - tokenize_s)

    async def remote_prompts(self, rt: ModelRuntime, body: dict[str, Any], kind: str) -> list[list[int]]:
        """Every prompt's ids from the first routable backend's ``/tokenize``."""
        name = next((n for n in rt.backends if self.pool.get(n).routable), None)
        if name is None:
            raise NoHealthyBackend(f"no healthy backend for model {rt.name!r} to tokenize with")
        backend = self.pool.get(name)
        try:
            if kind == "chat":
                return [await rt.remote.chat_ids(backend.url, body, backend.http)]
            return await rt.remote.completion_ids(backend.url, body, backend.http)
        except TokenizeError as e:
            raise BadRequest(str(e)) from e
        except RemoteTokenizeError as e:
            log.warning("remote tokenization at %s failed: %s", name, e)
            raise UpstreamError(f"remote tokenization at backend {name} failed", backend=name) from e


def observe_ids(rt: ModelRuntime, ids: Ids) -> None:
    """Count what computing ``ids`` cost, when the request they route is sent (or settled)."""
    metrics.child(metrics.TOKENIZE_SECONDS, rt.name).observe(ids.tokenize_s)
    metrics.child(metrics.HASH_SECONDS, rt.name).observe(ids.hash_s)


def _pool_job(
    rt: ModelRuntime, body: dict[str, Any], kind: str, lora: dict[str, Any] | None, salt: str | None,
    rendered: Rendered | None, raw_len: int,
) -> Ids:
    try:
        return local_ids(rt, body, kind, lora, salt, rendered)
    finally:
        if raw_len >= TRIM_AFTER_BYTES:
            trim_memory()


def trim_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).
    Written by hand: no library exposes it, and Python's allocator returns its arenas to
    malloc, which keeps them."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def local_ids(
    rt: ModelRuntime, body: dict[str, Any], kind: str, lora: dict[str, Any] | None, salt: str | None,
    rendered: Rendered | None = None,
) -> Ids:
    """Tokenize and hash with the model's own tokenizer (any thread).

    A prompt found to reach the model's ``max_model_len`` before it is tokenized whole is
    a 400 (:mod:`router.prompt.length`); with ``truncate_prompt_tokens``, or when nobody
    knows the limit, one past it is routed without cache information instead."""
    tok = rt.tokenizer
    assert tok is not None
    limit = rt.max_model_len or UNKNOWN_LIMIT
    t0 = time.perf_counter()
    try:
        if rendered is not None:  # one text, no truncation: see PromptTokenizer.prompt_text
            # The sampled full-tokenization check costs a whole cold tokenization: never
            # here, which may be the event loop (see router.settle).
            first = rendered.ids or tok.text_ids(rendered.text, rendered.add_special, check=False, limit=limit)
            lengths = [len(first)]
        elif kind == "chat":
            first = tok.chat_ids(body, limit)
            lengths = [len(first)]
        else:
            prompts = tok.completion_ids(body, limit)
            first = prompts[0] if prompts else []
            lengths = [len(p) for p in prompts]
    except UnsupportedPrompt:
        raise
    except TooLong as e:
        if rt.max_model_len is None or body.get("truncate_prompt_tokens") is not None:
            raise UnsupportedPrompt(str(e)) from e
        raise PromptTooLong(str(e)) from e
    except TokenizeError as e:
        raise BadRequest(str(e)) from e
    t1 = time.perf_counter()
    keys = rt.hash_cache.hash_int64(first, lora=lora, cache_salt=salt)
    return Ids(first, lengths, keys, t1 - t0, time.perf_counter() - t1)
