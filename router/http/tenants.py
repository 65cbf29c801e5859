"""Tenants (``router.tenants``): whose key a request carries, the cache salt bound to it, its limits.

vLLM isolates cached prompts only by ``cache_salt``, which seeds the first block's hash
(docs/vllm-facts.md §1): two requests share cached blocks only when their salts are equal.
Without a salt, one tenant learns whether another's prompt is cached from the
``cached_tokens`` (or the speed) of its own answer to the same prompt. So every request of a
tenant carries a salt bound to that tenant, which no other tenant can know or send:

- The salt is ``HMAC-SHA256(secret, "kvrouter cache salt" NUL name)`` in hex. The secret is
  ``KVROUTER_SALT_SECRET`` when set; else the tenant's own keys (the first in sorted order).
  A keyed hash rather than the name itself, because a tenant whose client salts are
  ``allowed`` could otherwise send another tenant's salt and read its cache. The keys by
  default, because they are already a secret that every router process and replica has (no
  new secret to distribute) and the same on every start (the engines' caches stay warm across
  router restarts and are shared by replicas); the price is that retiring the key that seeds
  it starts that tenant's cache afresh once, which ``KVROUTER_SALT_SECRET`` avoids.
- The body's ``cache_salt`` becomes the tenant's (unless its ``client_salt`` is ``allowed``
  and the client sent one) *before* the request is planned: the router hashes the prompt's
  blocks with the very salt the engine receives, so its predicted cached tokens stay exact.

Keys are compared with :func:`hmac.compare_digest` against every key configured, all of them
on every request, so neither a guess's right characters nor which tenant holds a key shows
in the time taken. ``router.api_key`` keeps its meaning: its clients are one more tenant,
``anonymous``, without a salt or limits (a client's own ``cache_salt`` passes, as without
tenants).

Limits are token buckets per router process. With ``serve --workers N`` each worker holds
1/N of every limit (connections spread over the workers), so one host keeps to the limit;
replicas on several hosts each hold all of it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from pydantic import SecretStr

from kvconfig import ANONYMOUS, RouterSettings, bearer_matches
from router import metrics
from router.http.errors import RateLimited

_encoder = msgspec.json.Encoder()
SALT_CONTEXT = b"kvrouter cache salt\x00"


class TokenBucket:
    """``rate`` a second, up to ``burst`` held, times ``share`` (this process's part of the limit).

    :meth:`take` lets a cost through while the bucket holds it, or holds its whole burst when
    the cost is larger (a prompt longer than a minute's worth passes, once a minute), and may
    leave the level below zero: a debt the next requests wait out. :meth:`charge` corrects a
    count after the fact (the engine's usage)."""

    __slots__ = ("rate", "burst", "level", "at")

    def __init__(self, rate: float, burst: float, now: float | None = None) -> None:
        self.rate, self.burst = rate, burst
        self.level = burst
        self.at = time.monotonic() if now is None else now

    def take(self, cost: float, share: float = 1.0, now: float | None = None) -> float:
        """0.0 when ``cost`` was taken; else the seconds until it would be."""
        now = time.monotonic() if now is None else now
        rate, burst = self.rate * share, self.burst * share
        self.level = min(burst, self.level + (now - self.at) * rate)
        self.at = now
        need = min(cost, burst)
        if self.level >= need:
            self.level -= cost
            return 0.0
        return (need - self.level) / rate

    def charge(self, cost: float) -> None:
        self.level -= cost


@dataclass(slots=True, eq=False)
class Tenant:
    """One tenant as a request sees it (the config's :class:`kvconfig.Tenant`, resolved)."""

    name: str
    salt: str | None
    """The ``cache_salt`` its requests get; None for ``anonymous`` (the client's own passes)."""
    keep_client_salt: bool
    requests: TokenBucket | None = None
    prompt_tokens: TokenBucket | None = None


def read_keys(name: str, source: str, environ: Mapping[str, str]) -> list[bytes]:
    """The keys ``router.tenants.<name>.keys`` points at (``env:VAR`` or ``file:PATH``)."""
    kind, _, where = source.partition(":")
    what = f"router.tenants.{name}.keys"
    if kind == "env":
        text = environ.get(where, "")
        if not text.strip():
            raise ValueError(f"{what}: the environment variable {where} is unset or empty")
    else:
        try:
            text = Path(where).read_text()
        except OSError as e:
            raise ValueError(f"{what}: cannot read {where}: {e.strerror or e}") from None
        if not text.strip():
            raise ValueError(f"{what}: {where} holds no key")
    return [k.encode() for k in text.split()]


def cache_salt(secret: bytes, name: str) -> str:
    """The tenant's ``cache_salt`` (see the module docstring for why it is keyed)."""
    return hmac.new(secret, SALT_CONTEXT + name.encode(), hashlib.sha256).hexdigest()


class Tenants:
    """Every tenant's keys, salt and buckets: built once per router process at start."""

    def __init__(self, settings: RouterSettings, salt_secret: SecretStr | None = None,
                 environ: Mapping[str, str] = os.environ) -> None:
        self.keys: list[tuple[bytes, Tenant]] = []
        self.by_name: dict[str, Tenant] = {}
        secret = salt_secret.get_secret_value().encode() if salt_secret is not None else None
        taken = {k.get_secret_value().encode(): f"router.{f}" for f, k in
                 (("api_key", settings.api_key), ("admin_api_key", settings.admin_api_key)) if k is not None}
        for name, t in settings.tenants.items():
            keys = read_keys(name, t.keys, environ)
            for k in keys:
                if (other := next((w for known, w in taken.items() if hmac.compare_digest(known, k)), None)):
                    raise ValueError(f"router.tenants.{name}.keys: a key is also {other}'s; each key must name one tenant")
                taken[k] = f"tenant {name}"
            tenant = Tenant(
                name, cache_salt(secret or sorted(keys)[0], name), t.client_salt == "allowed",
                None if t.requests_per_s is None else TokenBucket(t.requests_per_s, max(1.0, t.requests_per_s)),
                None if t.prompt_tokens_per_min is None else TokenBucket(t.prompt_tokens_per_min / 60,
                                                                         t.prompt_tokens_per_min),
            )
            self.by_name[name] = tenant
            self.keys += [(k, tenant) for k in keys]
        self.anonymous = Tenant(ANONYMOUS, None, True) if self.keys and settings.api_key is not None else None
        """``router.api_key``'s clients, while tenants are configured (None without tenants: nothing to count)."""

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key ``Authorization: Bearer KEY`` carries, or None. Every key is
        compared, whether one matched already or not."""
        found = None
        for key, tenant in self.keys:
            if bearer_matches(authorization, key):
                found = tenant
        return found

    @staticmethod
    def admit(tenant: Tenant | None, share: float) -> None:
        """Count a request of ``tenant`` against its requests per second, and against a token
        debt it still owes; raise :class:`RateLimited` over either."""
        if tenant is None:
            return
        if tenant.requests is not None:
            _refuse(tenant, "requests_per_s", tenant.requests.take(1, share))
        if tenant.prompt_tokens is not None:
            _refuse(tenant, "prompt_tokens_per_min", tenant.prompt_tokens.take(0, share))

    @staticmethod
    def admit_prompt(tenant: Tenant | None, tokens: int, share: float) -> None:
        """Take a request's prompt tokens (the router's count) from its tenant's minute, or raise."""
        if tenant is not None and tenant.prompt_tokens is not None:
            _refuse(tenant, "prompt_tokens_per_min", tenant.prompt_tokens.take(tokens, share))

    @staticmethod
    def admitted(tenant: Tenant | None) -> None:
        if tenant is not None:
            metrics.child(metrics.TENANT_REQUESTS, tenant.name, "admitted").inc()


def _refuse(tenant: Tenant, limit: str, wait_s: float) -> None:
    if wait_s <= 0.0:
        return
    metrics.child(metrics.TENANT_REQUESTS, tenant.name, limit).inc()
    raise RateLimited(f"Rate limit reached for tenant {tenant.name!r} on {limit}: try again in {wait_s:.2f} s.",
                      retry_after_s=max(1, math.ceil(wait_s)))


def salted(tenant: Tenant | None, raw: bytes, body: dict[str, Any]) -> bytes:
    """The request's bytes with its tenant's ``cache_salt`` (``body`` updated to match), or
    ``raw`` as it is when the salt stays the client's. Without one sent, the salt goes in
    front of the body's first key, every other byte as the client sent it; a sent one is
    replaced by encoding the body again (the body's keys are known to be distinct:
    :func:`router.parse.parse_body`)."""
    if tenant is None or tenant.salt is None or (tenant.keep_client_salt and body.get("cache_salt") is not None):
        return raw
    replace = "cache_salt" in body or not body
    body["cache_salt"] = tenant.salt
    if replace:
        return _encoder.encode(body)
    start = raw.index(b"{") + 1
    return b"".join((raw[:start], b'"cache_salt":', _encoder.encode(tenant.salt), b",", raw[start:]))


def used(tenant: Tenant, charged: int, prompt: int | None, cached: int | None) -> None:
    """An answer's usage: the tenant's reused and recomputed prompt tokens, and its minute's
    count set right (the router's count was ``charged``; the engine's is ``prompt``)."""
    if prompt is None:
        return
    reused = min(cached or 0, prompt)
    if reused:
        metrics.child(metrics.TENANT_PROMPT_TOKENS, tenant.name, "reused").inc(reused)
    if prompt > reused:
        metrics.child(metrics.TENANT_PROMPT_TOKENS, tenant.name, "recomputed").inc(prompt - reused)
    if tenant.prompt_tokens is not None and prompt != charged:
        tenant.prompt_tokens.charge(prompt - charged)
