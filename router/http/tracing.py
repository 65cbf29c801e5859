"""Turning OpenTelemetry tracing on: the standard environment variables, the SDK, the exporter.

Off by default. Tracing is asked for the standard way, with no key in the router's config:

- ``OTEL_TRACES_EXPORTER``: ``otlp``, ``console`` (one JSON line per span on stdout, next
  to the access log), or both comma-separated; ``none`` or unset: off. Unlike the SDK's own
  default (``otlp``), unset means off: platforms set ``OTEL_*`` variables in every pod,
  and a router should not start exporting because of them.
- ``kvrouter serve --otel``: on, with ``otlp`` unless ``OTEL_TRACES_EXPORTER`` names
  another exporter (``none`` still wins).
- ``OTEL_SDK_DISABLED=true``: off, whatever else says.

The rest is the SDK's and its exporter's, read by them: ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; default ``http://localhost:4318``),
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*`` (the batch processor's delay and sizes).
``OTEL_SERVICE_NAME`` defaults to ``kvrouter``. OTLP goes over HTTP/protobuf, which the
``otel`` extra installs; ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` works when
``opentelemetry-exporter-otlp-proto-grpc`` is installed too.

The SDK is an optional extra (``pip install 'kvrouter[otel]'``): a router asked to trace
without it stops at start with one line naming the extra (:func:`check`, run before any
worker starts), and a router not asked imports nothing of OpenTelemetry: this module
imports the SDK inside :func:`check` and :func:`start` only.

Each router process has a tracer provider of its own (:func:`start`), with a batch span
processor, whose export thread runs in that process: ``serve --workers N`` starts each
worker as a process of its own that runs :func:`start` itself, and the supervisor, which
routes nothing, traces nothing. The provider is the router's, not the process-global one:
recent FastAPI releases trace the requests they serve through the global provider, and
would add a second server span to each request that falls through to FastAPI. Spans still
queued when the process exits are flushed then (the provider's exit hook).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

EXTRA = "pip install 'kvrouter[otel]'"
EXPORTERS = ("otlp", "console")
SERVICE_NAME = "kvrouter"
_OTLP_MODULES = {
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.trace_exporter", EXTRA),
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "pip install opentelemetry-exporter-otlp-proto-grpc"),
}


class TracingError(ValueError):
    """Tracing was asked for in a way the router cannot do: one line, for stderr."""


def exporters(otel_flag: bool = False, env: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters asked for (see the module docstring); empty: tracing is off.
    Raises :class:`TracingError` on an exporter the router does not offer."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if not names:
        return ["otlp"] if otel_flag else []
    unknown = sorted(set(names) - set(EXPORTERS) - {"none"})
    if unknown:
        raise TracingError(f"OTEL_TRACES_EXPORTER: kvrouter exports spans with otlp or console (or none), "
                           f"not {', '.join(unknown)}")
    return [n for n in EXPORTERS if n in names]


def protocol(env: Mapping[str, str] = os.environ) -> str:
    """The OTLP transport: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else HTTP/protobuf."""
    value = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    value = value.strip().lower()
    if value not in _OTLP_MODULES:
        raise TracingError(f"OTEL_EXPORTER_OTLP_PROTOCOL: kvrouter exports OTLP over http/protobuf or grpc, not {value}")
    return value


def check(names: list[str], env: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`TracingError` (one line naming what to install) unless the SDK and the
    exporters ``names`` need can be imported: at start, before a worker is started, rather
    than a traceback in every worker."""
    needed = [("opentelemetry.sdk.trace", EXTRA)]
    if "otlp" in names:
        needed.append(_OTLP_MODULES[protocol(env)])
    for module, hint in needed:
        try:
            importlib.import_module(module)
        except ImportError:
            raise TracingError(f"tracing is on (OTEL_TRACES_EXPORTER={','.join(names)}) but {module} is not "
                               f"installed: {hint}") from None


def start(names: list[str], worker: int | None = None, env: Mapping[str, str] = os.environ) -> Tracer:
    """This process's tracer provider, exporting to ``names`` through batch processors; its tracer."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    resource = Resource.create({} if worker is None else {"kvrouter.worker": worker})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    for name in names:
        exporter: SpanExporter
        if name == "otlp":
            module = importlib.import_module(_OTLP_MODULES[protocol(env)][0])
            exporter = module.OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter(out=sys.stdout, formatter=_one_line)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on: spans to %s as service %s", ", ".join(names), resource.attributes.get("service.name"))
    return provider.get_tracer("kvrouter")


def _one_line(span: ReadableSpan) -> str:
    """A span as one JSON line: stdout is the access log's, one JSON object per line."""
    return span.to_json(indent=None) + "\n"
