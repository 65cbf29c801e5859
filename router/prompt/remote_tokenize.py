"""Token ids from a backend's ``/tokenize``, and the sampled checks that decide when to use it.

The local tokenizer is fast but can only be as right as the tokenizer files and chat
template the router was given; the engine's own ``/tokenize`` is right by definition but
costs a round trip. :class:`ParityGuard` compares the two on a sampled share of requests
and, in mode ``auto``, moves a model to :class:`RemoteTokenizer` when mismatches persist,
so a router configured with the wrong tokenizer degrades to slower routing, not wrong
routing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import aiohttp
import msgspec
from prometheus_client import Counter, Gauge

from router.prompt.prompt_fields import TokenizeError, all_token_ids, bool_field, completion_prompts, keep_last

log = logging.getLogger(__name__)

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
    multiprocess_mode="livemax",  # serve --workers: 1 when any worker switched
)

TokenizerMode = Literal["local", "remote", "auto"]

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


class RemoteTokenizeError(RuntimeError):
    """A backend's ``/tokenize`` could not be reached or answered with a server error."""


class RemoteTokenizer:
    """Token ids from a backend's vLLM ``POST /tokenize``.

    ``/tokenize`` has no ``truncate_prompt_tokens``, so truncation is applied here to
    the ids it returns (keep the last N, like the engine).
    """

    def __init__(self, model: str, timeout: float = 10.0) -> None:
        self.model = model
        self.timeout = timeout

    async def chat_ids(self, base_url: str, body: dict[str, Any], client: aiohttp.ClientSession) -> list[int]:
        payload: dict[str, Any] = {"model": self.model}
        payload.update({k: body[k] for k in _TOKENIZE_CHAT_FIELDS if body.get(k) is not None})
        ids = await self._tokenize(base_url, payload, client)
        return keep_last(ids, body.get("truncate_prompt_tokens"))

    async def completion_ids(self, base_url: str, body: dict[str, Any], client: aiohttp.ClientSession) -> list[list[int]]:
        add_special = bool_field(body, "add_special_tokens", True)
        out: list[list[int]] = []
        for prompt in completion_prompts(body.get("prompt")):
            if isinstance(prompt, str):
                payload = {"model": self.model, "prompt": prompt, "add_special_tokens": add_special}
                prompt = await self._tokenize(base_url, payload, client)
            out.append(keep_last(prompt, body.get("truncate_prompt_tokens")))
        return out

    async def _tokenize(self, base_url: str, payload: dict[str, Any], client: aiohttp.ClientSession) -> list[int]:
        """One ``/tokenize`` call over the backend's pooled session (the router's one
        upstream HTTP stack: see router/fleet/backends.py)."""
        url = base_url.rstrip("/") + "/tokenize"
        try:
            async with client.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                status, raw = r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise RemoteTokenizeError(f"{url}: {e!r}") from e
        if 400 <= status < 500:
            raise TokenizeError(_error_message(status, raw))
        if status != 200:
            raise RemoteTokenizeError(f"{url} answered {status}: {raw[:200].decode('utf-8', 'replace')}")
        try:
            tokens = msgspec.json.decode(raw)["tokens"]
        except (msgspec.DecodeError, KeyError, TypeError) as e:
            raise RemoteTokenizeError(f"{url} answered without a token list") from e
        if not isinstance(tokens, list) or not all_token_ids(tokens):
            raise RemoteTokenizeError(f"{url} answered a malformed token list")
        return tokens


def _error_message(status: int, raw: bytes) -> str:
    try:
        err = msgspec.json.decode(raw).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    except (msgspec.DecodeError, AttributeError):
        pass
    return raw[:500].decode("utf-8", "replace") or f"backend answered {status}"


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
        self, local_ids: list[int], body: dict[str, Any], remote: RemoteTokenizer, base_url: str, client: aiohttp.ClientSession
    ) -> bool:
        return self.record(local_ids, await remote.chat_ids(base_url, body, client))
