"""What each request's answer says, measured at the router: its id, TTFT, duration, tokens and one access-log line.

The router's other metrics time its own stages; an operator's questions are about the
requests: how long until the first token, how long in all, how many tokens, on which
backend, why there. :class:`Observed` wraps an endpoint's ASGI ``send`` and reads the answer
as it goes out, so the proxy relays bytes as before and nothing here is on the path of a
byte to the client:

- **Request id.** The client's ``x-request-id`` when it is a sane one (at most 128 printable
  ASCII characters), else a new one. The engine gets it (the proxy forwards the header) and
  the client gets it back on every answer, the router's own errors included.
- **TTFT.** The first body chunk of a stream that carries generated output (``text``,
  ``content``, ``reasoning_content``, ``tool_calls`` or a Responses ``delta``; vLLM's first
  chat chunk carries only the role). Streams only: a non-streamed answer's first byte is its last.
- **Tokens.** ``usage`` as the engine reported it: a non-streamed body's, a stream's last
  usage event (sent when the client asked for ``stream_options.include_usage``; always by
  the Responses and Anthropic APIs, which name them ``input_tokens`` and ``output_tokens``).
  Answers without usage count no tokens.
- **The access log.** One JSON line per request on the ``kvrouter.access`` logger: what
  :class:`AccessLine` lists. On by default; ``kvrouter serve --no-access-log`` (or
  ``KVROUTER_ACCESS_LOG=0``) turns it off, metrics stay.

- **Fidelity.** Where the router predicted the cached tokens on the backend it chose and the
  engine reported them, the two are compared (:class:`Fidelity`): the error by backend, and a
  running agreement rate that is logged once when it falls below :data:`AGREEMENT_LOW` and
  once when it recovers, and shown in ``/debug/backends``. Next to the engine's own count,
  the router's view of each engine's cache is checked on live traffic, request by request.

The request path adds what only it knows (model, decision reason, predicted cached tokens)
through :func:`current`, a context variable: the proxy runs in the request's own task.
With ``router.tenants`` the request's tenant is noted too, and its answer's usage counts
the tenant's reused and recomputed prompt tokens (:func:`router.http.tenants.used`).
With tracing on, each request is a :class:`router.http.spans.Traced` instead, which also
makes its OpenTelemetry spans (:mod:`router.http.tracing`).
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
import uuid
from typing import Any

import msgspec
from starlette.types import Message, Scope, Send

from router import metrics
from router.http.tenants import Tenant, used

access_log = logging.getLogger("kvrouter.access")
log = logging.getLogger(__name__)

REQUEST_ID = b"x-request-id"
MAX_ID_LEN = 128
TAIL_BYTES = 4096
"""Bytes of a stream's end kept to find its usage event (vLLM's is a few hundred)."""
_OUTPUT_MARKS = (b'"text":"', b'"content":"', b'"reasoning_content":"', b'"tool_calls":[', b'"delta":"')
"""Generated output in a chunk: completions, chat, Anthropic's ``text_delta``, the Responses API's ``*.delta`` events."""
_USAGE = b'"usage":{'


def access_log_on() -> bool:
    """``KVROUTER_ACCESS_LOG=0`` (what ``kvrouter serve --no-access-log`` sets for its workers) turns it off."""
    return os.environ.get("KVROUTER_ACCESS_LOG", "1").strip().lower() not in ("0", "false", "no", "off")


class AccessLine(msgspec.Struct, omit_defaults=True):
    """One request, as the access log writes it (times in milliseconds; absent: unknown)."""

    request_id: str
    method: str
    path: str
    status: int
    e2e_ms: float
    model: str | None = None
    backend: str | None = None
    reason: str | None = None
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    queue_wait_ms: float | None = None


AGREEMENT_ALPHA = 0.02
"""Weight of one request in the running agreement rate (about the last 50 requests count)."""
AGREEMENT_LOW = 0.8
AGREEMENT_OK = 0.9
"""A backend's agreement is low below 0.8 (after :data:`AGREEMENT_MIN` requests) and ok again above 0.9."""
AGREEMENT_MIN = 50


class Fidelity:
    """Predicted against reported cached tokens, per backend (this process's requests).

    Exact agreement is the rule when the index is fresh: both count whole blocks and vLLM
    never reports the whole prompt (docs/vllm-facts.md). A request sent on a prefix an earlier
    one is still computing, or one whose blocks the engine evicted after the decision, can
    differ without anything wrong; a rate that stays low means a stale or broken event
    stream, a hash mismatch, or an engine configured unlike the router's config."""

    def __init__(self) -> None:
        self.rate: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.low: set[str] = set()

    def record(self, backend: str, predicted: int, reported: int) -> None:
        diff = reported - predicted
        outcome = "exact" if diff == 0 else "under" if diff > 0 else "over"
        metrics.child(metrics.CACHE_PREDICTIONS, backend, outcome).inc()
        metrics.child(metrics.CACHE_PREDICTION_ERROR, backend).observe(abs(diff))
        n = self.count[backend] = self.count.get(backend, 0) + 1
        rate = self.rate[backend] = self.rate.get(backend, 1.0) + AGREEMENT_ALPHA * ((diff == 0) - self.rate.get(backend, 1.0))
        metrics.child(metrics.CACHE_AGREEMENT, backend).set(rate)
        if backend not in self.low and n >= AGREEMENT_MIN and rate < AGREEMENT_LOW:
            self.low.add(backend)
            log.warning("backend %s: the router's predicted cached tokens agree with the engine's on %.0f%% of recent "
                        "requests (below %.0f%%): check its event stream, hash settings and block size (kvrouter doctor)",
                        backend, 100 * rate, 100 * AGREEMENT_LOW)
        elif backend in self.low and rate > AGREEMENT_OK:
            self.low.discard(backend)
            log.info("backend %s: predicted cached tokens agree with the engine's again (%.0f%%)", backend, 100 * rate)

    def describe(self, backend: str) -> dict[str, Any]:
        """What ``/debug/backends`` shows of it."""
        return {"cache_agreement": round(self.rate[backend], 3) if backend in self.rate else None,
                "cache_predictions": self.count.get(backend, 0), "cache_agreement_low": backend in self.low}


FIDELITY = Fidelity()

_encode = msgspec.json.Encoder().encode
_current: contextvars.ContextVar[Observed | None] = contextvars.ContextVar("kvrouter_request", default=None)


def current() -> Observed | None:
    """The request being answered in this task, for the request path to add what it knows."""
    return _current.get()


def request_id_of(scope: Scope) -> tuple[str, bool]:
    """The client's ``x-request-id`` if sane, else a new one; and whether it is new."""
    for k, v in scope["headers"]:
        if k == REQUEST_ID:
            if 0 < len(v) <= MAX_ID_LEN and all(33 <= c < 127 for c in v):
                return v.decode(), False
            break
    return uuid.uuid4().hex, True


class Observed:
    """One request's answer as it goes out (see the module docstring)."""

    __slots__ = ("id", "method", "path", "started", "status", "model", "backend", "reason", "predicted_cached",
                 "queue_wait", "first_output", "stream", "tail", "log", "tenant", "charged", "_send", "_token")

    def __init__(self, scope: Scope, send: Send, log_access: bool) -> None:
        self.id, new = request_id_of(scope)
        if new:  # the engine gets the id the client will see (the proxy forwards the header), not one refused
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != REQUEST_ID] + [(REQUEST_ID, self.id.encode())]
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.started = time.perf_counter()
        self.status = 0
        self.model: str | None = None
        self.backend: str | None = None
        self.reason: str | None = None
        self.predicted_cached: int | None = None
        self.queue_wait: float | None = None
        """Seconds the request waited in the router's admission queue, when it waited."""
        self.first_output: float | None = None
        self.stream = False
        self.tail = b""
        self.log = log_access
        self.tenant: Tenant | None = None
        """Whose key the request carried, while ``router.tenants`` is configured."""
        self.charged = 0
        """The prompt tokens the router took from the tenant's minute before sending it."""
        self._send = send
        self._token = _current.set(self)

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._start(message)
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                if self.stream and self.first_output is None and any(m in body and _has_output(body, m) for m in _OUTPUT_MARKS):
                    self.first_output = time.perf_counter()
                self.tail = (self.tail + body[-TAIL_BYTES:])[-TAIL_BYTES:]
        await self._send(message)

    def _start(self, message: Message) -> None:
        self.status = message["status"]
        headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != REQUEST_ID]
        for k, v in headers:
            k = k.lower()
            if k == b"x-kvrouter-backend":
                self.backend = v.decode()
            elif k == b"content-type" and v.startswith(b"text/event-stream"):
                self.stream = True
        headers.append((REQUEST_ID, self.id.encode()))
        message["headers"] = headers

    def routed(self, d: Any) -> None:
        """The request path decided ``d`` (a :class:`router.choose.Decided`) and sends it now,
        once per try. Nothing here needs more than the model and reason already noted; a
        traced request (:class:`router.http.spans.Traced`) keeps it and the time for its spans."""

    def finish(self) -> None:
        """The answer has gone out: count it and write its access-log line."""
        _current.reset(self._token)
        now = time.perf_counter()
        e2e = now - self.started
        usage = usage_of(self.tail) if self.tail else None
        model, backend = self.model, self.backend
        ttft = self.first_output - self.started if self.first_output is not None else None
        if model is not None and backend is not None:
            metrics.child(metrics.REQUEST_E2E, model, backend).observe(e2e)
            if ttft is not None:
                metrics.child(metrics.REQUEST_TTFT, model, backend).observe(ttft)
            if usage is not None:
                for kind, n in zip(("prompt", "completion", "cached"), usage):
                    if n:
                        metrics.child(metrics.TOKENS, model, backend, kind).inc(n)
                if self.predicted_cached is not None and usage[2] is not None and self.status == 200:
                    FIDELITY.record(backend, self.predicted_cached, usage[2])
        if self.tenant is not None and usage is not None:
            used(self.tenant, self.charged, usage[0], usage[2])
        if self.log:
            p, c, cached = usage if usage is not None else (None, None, None)
            access_log.info(_encode(AccessLine(
                self.id, self.method, self.path, self.status, round(e2e * 1000, 3), model, backend, self.reason,
                None if ttft is None else round(ttft * 1000, 3), p, c, cached, self.predicted_cached,
                None if self.queue_wait is None else round(self.queue_wait * 1000, 3))).decode())


def _has_output(body: bytes, mark: bytes) -> bool:
    """Whether a ``mark`` in ``body`` opens a non-empty value (``"content":""`` is the role chunk's)."""
    at = body.find(mark)
    while at >= 0:
        nxt = body[at + len(mark): at + len(mark) + 1]
        if nxt and nxt not in (b'"', b"]"):
            return True
        at = body.find(mark, at + 1)
    return False


def usage_of(data: bytes) -> tuple[int | None, int | None, int | None] | None:
    """(prompt, completion, cached) tokens of the last ``usage`` object in ``data``, if any.

    Cut out by brace counting from its key rather than by decoding the whole body: a
    non-streamed answer (an embedding's thousands of floats) would cost more to decode than
    the request's routing did, and a stream's tail starts mid-event."""
    at = data.rfind(_USAGE)
    if at < 0:
        return None
    start = at + len(_USAGE) - 1
    depth = 0
    for i in range(start, min(len(data), start + 2048)):
        ch = data[i]
        if ch == 0x7B:
            depth += 1
        elif ch == 0x7D:
            depth -= 1
            if depth == 0:
                try:
                    u = msgspec.json.decode(data[start:i + 1])
                except msgspec.DecodeError:
                    return None
                if not isinstance(u, dict):
                    return None
                if "prompt_tokens" not in u and "input_tokens" in u:  # the Responses and Anthropic APIs
                    details = u.get("input_tokens_details")
                    cached = details.get("cached_tokens") if isinstance(details, dict) else None
                    return _int(u.get("input_tokens")), _int(u.get("output_tokens")), _int(cached)
                details = u.get("prompt_tokens_details")
                cached = details.get("cached_tokens") if isinstance(details, dict) else None
                return _int(u.get("prompt_tokens")), _int(u.get("completion_tokens")), _int(cached)
    return None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
