"""Traffic for chaos and soak runs: open-loop multi-turn sessions, every answer classified.

A chaos run must tell a clean failure from a dirty one, so each streamed request ends
in exactly one :class:`Outcome`:

* ``ok``: a 200 stream that ended with ``data: [DONE]``;
* ``openai_error``: a non-200 answer whose body is an OpenAI error object;
* ``sse_error``: a 200 stream that ended with an ``{"error": ...}`` event;
* ``connection``: the connection to the router broke after the request was sent (the
  router itself died: nobody is left to answer);
* ``bad_error``: a non-200 answer that is not OpenAI-shaped;
* ``truncated``: a 200 stream that ended without ``[DONE]`` or an error event (the
  silent truncation a client cannot tell from a short answer);
* ``hang``: nothing ended the request within ``hang_s``.

The last three are never acceptable. Sessions come from the ``mixed`` workload
(:func:`loadtest.workloads.mixed`, token-id prompts: the routing, not the tokenizer,
is exercised), generated in chunks of fresh seeds so a run of any length needs memory
for one chunk only. Sessions go to the routers round-robin; a session whose router
refuses the connection (a killed replica) is retried on the next one, as a client
with several endpoints does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import httpx

from loadtest.workloads import MixedSpec, Session, Workload, mixed

Outcome = Literal["ok", "openai_error", "sse_error", "connection", "bad_error", "truncated", "hang"]
CLEAN_FAILURES = ("openai_error", "sse_error", "connection")
DIRTY_FAILURES = ("bad_error", "truncated", "hang")


@dataclass(slots=True)
class Record:
    """One request as the client saw it (wall seconds on the run's monotonic clock)."""

    session: str
    turn: int
    router: int
    sent_t: float
    done_t: float = 0.0
    outcome: Outcome = "hang"
    status: int = 0
    backend: str = "-"
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    detail: str = ""
    retried: int = 0


def chaos_spec(length_scale: float = 0.15, output_tokens: int = 24) -> MixedSpec:
    """The mixed workload cut down so that 2 cores can drive 4 engines: short contexts and
    answers (every output token is an SSE event through the router), multi-turn kinds
    weighted up so prefixes are shared."""
    return MixedSpec.with_overrides({
        "length_scale": length_scale, "answer_tokens": output_tokens, "agent_output_tokens": output_tokens,
        "rag_output_tokens": output_tokens, "oneoff_output_tokens": output_tokens,
        "max_context_tokens": 4096, "chat": 0.45, "agent": 0.3, "rag": 0.2, "oneoff": 0.05,
    })


def session_stream(spec: MixedSpec, seed: int, chunk: int = 200) -> Iterator[Session]:
    """Sessions without end, start times increasing: chunk k is ``mixed`` of seed ``seed + k``
    shifted to begin where chunk k-1 ended."""
    offset = 0.0
    for k in itertools.count():
        wl: Workload = mixed(spec, seed=seed + k, max_requests=chunk)
        if not wl.sessions:
            return
        t0 = wl.sessions[0].start_s
        last = offset
        for s in wl.sessions:
            last = offset + s.start_s - t0
            yield Session(f"{s.session_id}-{k}", last, s.turns)
        offset = last + 1.0 / max(spec.rate, 1e-9)


class Traffic:
    """Runs sessions against ``targets`` until :meth:`stop`; ``records`` grows as requests end.

    ``rate_scale`` multiplies the workload's arrival rate and ``speedup`` compresses its
    clock (think times included), as :mod:`loadtest.replay` does.
    """

    def __init__(self, targets: list[str], model: str, sessions: Iterator[Session], *, speedup: float,
                 rate_scale: float, hang_s: float = 60.0, on_record: Callable[[Record], None] | None = None) -> None:
        self.targets = targets
        self.model = model
        self.sessions = sessions
        self.speedup = speedup
        self.rate_scale = rate_scale
        self.hang_s = hang_s
        self.on_record = on_record
        self.records: list[Record] = []
        self.t0 = time.monotonic()
        self._stop = asyncio.Event()
        self._rr = itertools.count()
        self.in_flight = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Start sessions on schedule until stopped, then wait for every started one to end."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(self.hang_s, connect=5.0)
        tasks: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            first: float | None = None
            for s in self.sessions:
                first = s.start_s if first is None else first
                delay = (s.start_s - first) / (self.speedup * self.rate_scale) - self.now()
                if delay > 0:
                    try:
                        await asyncio.wait_for(self._stop.wait(), delay)
                    except TimeoutError:
                        pass
                if self._stop.is_set():
                    break
                t = asyncio.create_task(self._session(client, s, next(self._rr)))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*list(tasks))

    async def _session(self, client: httpx.AsyncClient, s: Session, rr: int) -> None:
        for i, turn in enumerate(s.turns):
            if self._stop.is_set():
                return
            if i and turn.think_s > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), turn.think_s / self.speedup)
                    return
                except TimeoutError:
                    pass
            body = {**turn.body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
            rec = await self.send(client, turn.path, body, s.session_id, i, rr)
            if rec.outcome != "ok":
                return

    async def send(self, client: httpx.AsyncClient, path: str, body: dict, session: str, turn: int, rr: int) -> Record:
        """One streamed request, failing over to the next router only while none accepts the connection."""
        rec = Record(session, turn, rr % len(self.targets), self.now())
        self.in_flight += 1
        try:
            for attempt in range(len(self.targets)):
                rec.router = (rr + attempt) % len(self.targets)
                rec.retried = attempt
                try:
                    await asyncio.wait_for(self._stream(client, self.targets[rec.router] + path, body, session, rec),
                                           self.hang_s)
                    break
                except TimeoutError:
                    rec.outcome, rec.detail = "hang", f"no end within {self.hang_s:.0f}s"
                    break
                except httpx.HTTPError as e:
                    rec.outcome, rec.detail = "connection", f"{type(e).__name__}: {e}"[:200]
                    if rec.status:
                        break
                    # No answer began (refused, or a reset pooled connection): that router is
                    # gone, the request never reached an engine through it; try the next.
        finally:
            self.in_flight -= 1
        rec.done_t = self.now()
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    async def _stream(self, client: httpx.AsyncClient, url: str, body: dict, session: str, rec: Record) -> None:
        t_start = time.monotonic()
        rec.outcome = "hang"
        async with client.stream("POST", url, json=body, headers={"x-session-id": session}) as resp:
            rec.status = resp.status_code
            rec.backend = resp.headers.get("x-kvrouter-backend", "-")
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.outcome = "openai_error" if _openai_error(raw) else "bad_error"
                rec.detail = raw.decode(errors="replace")[:200]
                if rec.backend == "-":
                    rec.backend = _named_backend(rec.detail)
                return
            rec.outcome = "truncated"
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.outcome = "ok"
                    return
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    rec.detail = "a stream chunk is not JSON"
                    return
                if "error" in chunk:
                    rec.outcome = "sse_error"
                    rec.detail = str(chunk["error"])[:200]
                    return
                if rec.ttft_s is None and any((c.get("text") or (c.get("delta") or {}).get("content"))
                                              for c in chunk.get("choices") or ()):
                    rec.ttft_s = time.monotonic() - t_start
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _named_backend(message: str) -> str:
    """The backend an error message names (``backend engine-1 failed ...``; the router names
    the configured backend, never its address), or ``-``."""
    m = re.search(r"backend (\S+) ", message)
    return m.group(1) if m else "-"


def _openai_error(raw: bytes) -> bool:
    try:
        doc = json.loads(raw)
    except ValueError:
        return False
    err = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
