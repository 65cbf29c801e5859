"""A traced request's OpenTelemetry spans: one for the request, a child for each stage.

Imported only when tracing is on (:mod:`router.http.tracing`), so a router that does not
trace imports nothing of OpenTelemetry for it. :class:`Traced` is
:class:`~router.http.observe.Observed`, which already sees each request from its first
byte to its last, plus the spans:

- **The request span** (kind SERVER, named ``POST /v1/chat/completions``) starts when the
  request arrives. Its parent is the client's W3C ``traceparent`` when it sent a valid one
  (a new trace otherwise), and its own context replaces that header in the request, which
  the proxy forwards to the engine (``traceparent`` is on its allow-list): an engine that
  traces (vLLM's ``--otlp-traces-endpoint``) makes its span a child of the router's, not of
  the client's, so the router's part of the request is a span of the trace.
- **Stage spans**, children of it, made when the answer has gone out from times the
  request path takes anyway, so nothing of tracing runs while a request is being routed:
  ``tokenize`` (stage 3, *plan*: render, tokenize and hash, or a deferred plan's probe),
  ``route`` (the admission queue, look up, choose and the replicas' order, until the
  request is handed to the proxy) and ``upstream`` (kind CLIENT: from then to the answer's
  last byte, with a ``first token`` event at the TTFT of a stream). A request routed on no
  prompt (a passthrough: embeddings, ``/tokenize``) or refused before it was decided has
  the request span alone.

Attributes name what the access log names (``kvrouter.request_id``, ``kvrouter.backend``,
``kvrouter.reason``, tokens ...) next to the HTTP semantic conventions' own. A status of
500 or more, or an exception before any answer, sets the request span's status to ERROR
(a 4xx is the client's error, not the server's, as the conventions have it).

Sampling is the SDK's (``OTEL_TRACES_SAMPLER``, parent-based always-on by default): a
request sampled out still forwards its trace context, flagged unsampled, and makes no stage
span.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Scope, Send

from router.http.observe import Observed, usage_of

log = logging.getLogger(__name__)

TRACE_HEADERS = (b"traceparent", b"tracestate")
_W3C = TraceContextTextMapPropagator()
"""W3C trace context alone, not the SDK's global propagator: ``baggage`` would carry a
client's header to the engines, past the proxy's allow-list."""


def traced(tracer: Tracer, routes: set[str]) -> type[Traced]:
    """The :class:`Traced` class of one app: its tracer, and the paths a span may be named
    after (anything else, a scan of unknown paths, is named by its method alone)."""
    return type("Traced", (Traced,), {"__slots__": (), "tracer": tracer, "routes": frozenset(routes)})


class Traced(Observed):
    """One request, observed and traced (see the module docstring)."""

    __slots__ = ("span", "wall", "decided", "sent")
    tracer: ClassVar[Tracer]
    routes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, scope: Scope, send: Send, log_access: bool) -> None:
        super().__init__(scope, send, log_access)
        self.wall = time.time_ns()
        """The request's arrival in Unix nanoseconds, ``started`` on the perf_counter clock:
        what the stage spans' times are converted with."""
        self.decided: Any = None
        self.sent = 0.0
        client: dict[str, str] = {}
        headers = []
        for k, v in scope["headers"]:
            if k in TRACE_HEADERS:
                client[k.decode()] = v.decode("latin-1")
            else:
                headers.append((k, v))
        parent = _W3C.extract(client) if "traceparent" in client else None
        name = f"{self.method} {self.path}" if self.path in self.routes else self.method
        self.span = span = self.tracer.start_span(name, parent, SpanKind.SERVER, start_time=self.wall)
        ours: dict[str, str] = {}
        _W3C.inject(ours, set_span_in_context(span))
        headers += [(k.encode(), v.encode()) for k, v in ours.items()]
        scope["headers"] = headers

    def routed(self, d: Any) -> None:
        """Sent now (each try calls it; the first marks the end of ``route``)."""
        if self.decided is None:
            self.sent = time.perf_counter()
        self.decided = d

    def finish(self) -> None:
        now = time.perf_counter()
        super().finish()
        span = self.span
        if not span.is_recording():
            span.end()
            return
        try:
            self._spans(span, now)
        except Exception:  # noqa: BLE001 - the answer has gone out; a bug here must not reach the server's loop
            log.exception("tracing %s %s failed", self.method, self.path)
            span.end()

    def _at(self, t: float) -> int:
        """A ``time.perf_counter()`` reading as Unix nanoseconds."""
        return self.wall + int((t - self.started) * 1e9)

    def _spans(self, span: Span, now: float) -> None:
        end = self._at(now)
        status = self.status
        failed = status == 0 or status >= 500
        d = self.decided
        if d is not None:
            self._stages(set_span_in_context(span), d, end, failed)
        attrs: dict[str, Any] = {"http.request.method": self.method, "url.path": self.path, "kvrouter.request_id": self.id}
        if self.path in self.routes:
            attrs["http.route"] = self.path
        if status:
            attrs["http.response.status_code"] = status
        usage = usage_of(self.tail) if self.tail else None
        p, c, cached = usage if usage is not None else (None, None, None)
        ttft = None if self.first_output is None else round((self.first_output - self.started) * 1000, 3)
        for key, value in (("model", self.model), ("backend", self.backend), ("reason", self.reason),
                           ("predicted_cached_tokens", self.predicted_cached), ("ttft_ms", ttft), ("prompt_tokens", p),
                           ("completion_tokens", c), ("cached_tokens", cached)):
            if value is not None:
                attrs["kvrouter." + key] = value
        if failed:
            attrs["error.type"] = str(status) if status else "no_answer"
            span.set_status(Status(StatusCode.ERROR))
        span.set_attributes(attrs)
        span.end(end)

    def _stages(self, parent: Context, d: Any, end: int, failed: bool) -> None:
        """``tokenize``, ``route`` and ``upstream`` of a request the request path decided and sent."""
        tracer, plan, decision, ctx = self.tracer, d.plan, d.decision, d.ctx
        planned, sent = self._at(d.planned), self._at(self.sent)
        attrs: dict[str, Any] = {"kvrouter.plan": type(plan).__name__, "kvrouter.num_tokens": plan.num_tokens,
                                 "kvrouter.blocks": len(plan.keys)}
        if plan.outcome is not None:
            attrs["kvrouter.plan_outcome"] = plan.outcome
        ids = getattr(plan, "ids", None)
        if ids is not None:
            attrs["kvrouter.tokenize_ms"] = round(ids.tokenize_s * 1000, 3)
            attrs["kvrouter.hash_ms"] = round(ids.hash_s * 1000, 3)
        tracer.start_span("tokenize", parent, start_time=self._at(d.started), attributes=attrs).end(planned)

        chosen = next((c for c in d.candidates if c.backend == decision.backend), None)
        attrs = {"kvrouter.policy": d.rt.policy.name, "kvrouter.backend": decision.backend,
                 "kvrouter.reason": decision.reason, "kvrouter.order": list(decision.order),
                 "kvrouter.candidates": len(d.candidates), "kvrouter.lookup_ms": round(d.lookup_s * 1000, 3)}
        if chosen is not None:
            attrs["kvrouter.matched_blocks"] = chosen.matched_blocks
            attrs["kvrouter.predicted_cached_tokens"] = chosen.predicted_cached_tokens(ctx.num_tokens, ctx.block_size)
        if d.admitted.waited:
            attrs["kvrouter.queue_wait_ms"] = round(d.admitted.waited * 1000, 3)
        tracer.start_span("route", parent, start_time=planned, attributes=attrs).end(sent)

        attrs = {"kvrouter.backend": self.backend or d.backend}
        if self.status:
            attrs["http.response.status_code"] = self.status
        upstream = tracer.start_span("upstream", parent, SpanKind.CLIENT, start_time=sent, attributes=attrs)
        if self.first_output is not None:
            upstream.add_event("first token", timestamp=self._at(self.first_output))
        if failed:
            upstream.set_status(Status(StatusCode.ERROR))
        upstream.end(end)
