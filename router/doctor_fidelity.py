"""``kvrouter doctor --router [URL]``: each backend's closed-loop fidelity, read from a running router.

The engine checks of :mod:`router.doctor` catch a wrong setting before traffic. Once traffic
flows, the router compares for every request the cached tokens it predicted on the chosen
backend with those the engine reported (:class:`router.http.observe.Fidelity`), and
``/debug/backends`` shows the running agreement per backend. This reads it and gives each
backend a verdict: ok, low (the router routes on a wrong view of that engine's cache), or not
enough requests yet (fewer than :data:`~router.http.observe.AGREEMENT_MIN` compared). A
verdict is the router's own: low is its ``cache_agreement_low``, the flag it logs and keeps
until the agreement recovers, so the doctor and the router's log never disagree.

Each worker of ``serve --workers N`` compares the requests it answers, and ``/debug/backends``
answers for the worker the connection landed on (the kernel spreads connections). So the
doctor reads it over a new connection each time until it has heard every worker, for at most
:data:`READS_PER_WORKER` reads a worker; a backend is low when any worker finds it low, ok when
a worker has compared enough requests and none finds it low. With replicas on several hosts,
the verdicts are those of the replica at the URL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvconfig import RouterSettings
from router.http.observe import AGREEMENT_LOW, AGREEMENT_MIN

READS_PER_WORKER = 10
"""Reads of ``/debug/backends`` per worker before the doctor gives up hearing the rest: with
connections spread evenly over N workers, the chance of missing one is below N·(1 − 1/N)^(10·N)."""

LOW_HINT = (f"below {AGREEMENT_LOW:.0%}: the router routes on a wrong view of this engine's cache. Check its event "
            "stream (kv_events, the engine's --kv-events-config), the hash settings (hash_algo, hash_seed = the "
            "engine's PYTHONHASHSEED, vllm_version) and block_size, which the engine checks name when wrong "
            "(docs/operations.md, Fidelity)")


class RouterUnavailable(Exception):
    """The router could not be read: unreachable, refused the admin key, or not a kvrouter. One line."""


class RouterUnreachable(RouterUnavailable):
    """No answer at all (refused, timed out, unknown host)."""


@dataclass
class BackendFidelity:
    """One backend's verdict: ``ok`` True (agrees), False (low) or None (not enough requests yet)."""

    backend: str
    models: list[str]
    url: str
    ok: bool | None
    detail: str


def router_url(given: str, settings: RouterSettings) -> str:
    """``--router URL`` as given (``http://`` added when it names no scheme), or, given empty,
    the config's ``router.host`` and ``router.port``, a wildcard host read as loopback (the
    doctor run next to the router, as in its pod)."""
    if given:
        return given if "://" in given else f"http://{given}"
    if settings.port == 0:
        raise RouterUnavailable("the config's router.port is 0 (any free port): give the router's address as --router URL")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(settings.host, settings.host)
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"


def read(url: str, admin_key: str | None, timeout: float) -> tuple[str, list[BackendFidelity]]:
    """Which workers answered (a phrase), and every backend's verdict, from the router at ``url``."""
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    answers: dict[Any, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    reads = 0
    limits = httpx.Limits(max_keepalive_connections=0)  # a new connection for each read, so it may reach another worker
    with httpx.Client(base_url=url, timeout=timeout, headers=headers, limits=limits) as http:
        while True:
            doc = _backends(http, url, bool(admin_key))
            answers.setdefault(doc.get("worker"), doc)
            reads += 1
            n = doc.get("workers") if isinstance(doc.get("workers"), int) else 1
            if len(answers) >= n or reads >= READS_PER_WORKER * n or time.monotonic() > deadline:
                break
    workers = sorted(w for w in answers if isinstance(w, int))
    heard = "read"
    if workers:
        heard = f"read from {len(workers)} of {n} workers ({', '.join(map(str, workers))})"
        if len(workers) < n:
            heard += ": the others' requests are not in these verdicts"
    return heard, _verdicts(answers)


def _backends(http: httpx.Client, url: str, keyed: bool) -> dict[str, Any]:
    try:
        r = http.get("/debug/backends")
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise RouterUnreachable(f"router {url} is unreachable ({type(e).__name__}: {e}): is `kvrouter serve` "
                                "running there?") from None
    if r.status_code == 401:
        which = "refused the admin key" if keyed else "wants its admin key"
        raise RouterUnavailable(f"router {url} {which} (401): give it as KVROUTER_ADMIN_API_KEY or router.admin_api_key")
    if r.status_code == 403:
        raise RouterUnavailable(f"router {url} keeps /debug/* closed (403): it has an api_key and no admin_api_key; "
                                "give it one (router.admin_api_key or KVROUTER_ADMIN_API_KEY) to read its fidelity")
    if r.status_code != 200:
        raise RouterUnavailable(f"router {url} answered {r.status_code} to GET /debug/backends")
    try:
        doc = r.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("backends"), list):
        raise RouterUnavailable(f"router {url} answered GET /debug/backends with something else than a kvrouter's list "
                                "of backends: is it a kvrouter?")
    return doc


def _verdicts(answers: dict[Any, dict[str, Any]]) -> list[BackendFidelity]:
    """One verdict per backend, over every worker heard (see the module docstring)."""
    seen: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    for worker, doc in sorted(answers.items(), key=lambda kv: kv[0] if isinstance(kv[0], int) else -1):
        for entry in doc["backends"]:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                seen.setdefault(entry["name"], []).append((worker, entry))
    return [_verdict(name, entries) for name, entries in seen.items()]


def _verdict(name: str, entries: list[tuple[Any, dict[str, Any]]]) -> BackendFidelity:
    first = entries[0][1]
    out = BackendFidelity(name, list(first.get("models") or []), str(first.get("url", "")), None, "")
    if not all("cache_predictions" in e for _, e in entries):
        out.detail = "this router does not report fidelity in /debug/backends (an older kvrouter)"
        return out

    def part(worker: Any, e: dict[str, Any]) -> str:
        n, rate = e["cache_predictions"], e.get("cache_agreement")
        if not n or not isinstance(rate, (int, float)):
            said = "none compared"
        else:
            said = f"agreement {rate:.0%} over {n} request{'s' * (n != 1)}"
        return said if worker is None else f"worker {worker}: {said}"

    parts = "; ".join(part(w, e) for w, e in entries)
    counts = [e["cache_predictions"] for _, e in entries]
    if any(e.get("cache_agreement_low") for _, e in entries):
        out.ok = False
        stream = []
        if any(e.get("connected") is False for _, e in entries):
            stream.append("the router's event stream from it is not connected")
        if any(e.get("rehash_mode") for _, e in entries):
            stream.append("its block hashes differ from the config's hash settings")
        out.detail = f"{parts}: " + ("; ".join(stream) + "; " if stream else "") + LOW_HINT
    elif max(counts) >= AGREEMENT_MIN:
        out.ok = True
        out.detail = parts
    elif max(counts) == 0:
        out.detail = ("not enough requests yet (none compared): a request counts once the engine's answer reports "
                      "usage.prompt_tokens_details.cached_tokens (vLLM --enable-prompt-tokens-details)")
    else:
        out.detail = f"not enough requests yet ({max(counts)} of {AGREEMENT_MIN} compared): {parts}"
    return out
