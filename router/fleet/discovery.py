"""Backends found by DNS (``models[].discovery``): one backend per A/AAAA record of a name.

A Kubernetes headless Service (or Consul) answers its name with one address per ready pod,
so the fleet can grow and shrink without a config change. Each model with ``discovery`` has
one :class:`Follower`: every ``interval_s`` it asks its :class:`Source`, and when the set of
addresses changed it hands the backends they make to the router, which applies them through
the config reload's path (:meth:`router.core.Router.rediscover`): an added engine is
health-checked and its events followed before it is chosen; a removed one finishes its
requests in flight, then leaves the index.

A lookup that fails (timeout, SERVFAIL, a refused server) or answers no address keeps the
last set: a DNS outage must not empty a fleet that serves. Both are counted
(``kvrouter_discovery_lookups_total``) and logged once per change of state, not per lookup.

A source is anything with ``async addresses()``: Kubernetes EndpointSlices or an
InferencePool would be one more :class:`Source`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import dns.asyncresolver
import dns.exception
import dns.resolver

from pydantic import SecretStr

from kvconfig import Backend, Discovery, KeysFromEnv
from router import metrics

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 2.0
"""Longest one lookup may take: a stalled server must not hold the next one back for long."""


class LookupFailed(Exception):
    """A lookup that gave no usable answer; ``outcome`` is its label (``error``, ``empty``)."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


class Source(Protocol):
    """Where a model's engines are listed."""

    async def addresses(self) -> list[str]:
        """The engines' addresses, sorted; raises :class:`LookupFailed`."""
        ...


class DnsSource:
    """A and AAAA records of one name, from the system's resolver or from ``nameserver``.

    dnspython rather than ``getaddrinfo``: the system resolver cannot be pointed at another
    server and port, and it answers from ``/etc/hosts`` and caches as the host is set up,
    which is not what a fleet's service record says. The resolver's search list applies, so a
    short name (``vllm``, a Service in the router's own namespace) resolves as in a pod."""

    def __init__(self, d: Discovery) -> None:
        self.name = d.dns
        self.resolver = dns.asyncresolver.Resolver(configure=d.nameserver is None)
        if d.nameserver is not None:
            host, port = split_host_port(d.nameserver, 53)
            self.resolver.nameservers = [host]
            self.resolver.port = port
        self.resolver.lifetime = min(LOOKUP_TIMEOUT_S, d.interval_s)

    async def addresses(self) -> list[str]:
        found: list[str] = []
        failures: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(self.name, rdtype, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue  # the name has no record of this family: an answer, not a failure
            except dns.exception.DNSException as e:
                failures.append(f"{rdtype}: {type(e).__name__}: {e}")
                continue
            found += [r.to_text() for r in answer]
        if failures and not found:
            raise LookupFailed("error", "; ".join(failures))
        if not found:
            raise LookupFailed("empty", "no A or AAAA record")
        return sorted(set(found))


def split_host_port(value: str, default_port: int) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or a bare IPv6 address."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    if value.count(":") == 1:
        host, port = value.split(":")
        return host, int(port)
    return value, default_port


def backends(d: Discovery, addresses: list[str], api_key: SecretStr | None = None) -> list[Backend]:
    """The backends ``addresses`` make, each named ``ADDRESS:PORT`` (what logs and metrics show),
    with ``api_key`` (``KVROUTER_BACKEND_API_KEY``: engines found this way are in no file)."""
    out = []
    for a in addresses:
        host = f"[{a}]" if ipaddress.ip_address(a).version == 6 else a
        out.append(Backend(
            name=f"{host}:{d.port}", url=f"http://{host}:{d.port}",
            kv_events=None if d.kv_events_port is None else f"tcp://{host}:{d.kv_events_port}",
            kv_replay=None if d.kv_replay_port is None else f"tcp://{host}:{d.kv_replay_port}",
            api_key=api_key,
        ))
    return out


Apply = Callable[[str, list[Backend]], Awaitable[str]]
"""Hands a model's discovered backends to the router; returns the reload's outcome."""


class Follower:
    """One model's lookups, every ``interval_s``, for as long as the router runs."""

    def __init__(self, model: str, d: Discovery, apply: Apply, source: Source | None = None) -> None:
        self.model = model
        self.d = d
        self.apply = apply
        self.source = source or DnsSource(d)
        key = KeysFromEnv().backend_api_key
        self.api_key = key if key is not None and key.get_secret_value() else None
        self.applied: list[str] | None = None
        """The addresses whose backends the router took last (None: none yet)."""
        self.state = "ok"

    async def run_forever(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.d.interval_s)

    async def once(self) -> None:
        try:
            found = await self.source.addresses()
        except LookupFailed as e:
            self._count(e.outcome)
            if self.state != e.outcome:
                log.warning("discovery of %s (model %s): %s: %s; keeping the %s backend(s) found last",
                            self.d.dns, self.model, e.outcome, e, len(self.applied or []))
            self.state = e.outcome
            return
        self._count("ok")
        if self.state != "ok":
            log.info("discovery of %s (model %s) answers again: %d address(es)", self.d.dns, self.model, len(found))
            self.state = "ok"
        if found == self.applied:
            return
        outcome = await self.apply(self.model, backends(self.d, found, self.api_key))
        if outcome in ("applied", "unchanged"):
            self.applied = found
            metrics.DISCOVERY_BACKENDS.labels(self.model).set(len(found))
        # else (a removed engine still draining, say): the next lookup tries again

    def _count(self, outcome: str) -> None:
        metrics.child(metrics.DISCOVERY_LOOKUPS, self.model, outcome).inc()
