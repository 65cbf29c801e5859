"""OpenTelemetry tracing (router/http/tracing.py, router/http/spans.py), on real routers and engines.

The router's spans are read with the SDK's in-memory exporter, so the router runs in this
process (the app of ``kvrouter serve``, served by uvicorn on a thread) in front of a real
simulated fleet (``kvrouter sim``) and of a loopback engine that records the headers it
is sent (the simulator does not), to see the ``traceparent`` an engine gets. Real
``kvrouter serve`` processes show the rest: each worker of ``--workers 2`` exports its own
spans (console exporter, stdout), a router that does not trace imports nothing of
OpenTelemetry beyond what FastAPI itself does, and a router asked to trace without the SDK
stops at start with one line naming the extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from router.http import tracing
from router.tuning import Tuning
from support import KVROUTER, QWEN3_DIR, REPO, LoopbackEngine, RouterProc, free_port
from test_request_observability import sim_config
from test_router_e2e import InProcessRouter

MODEL = "qwen3"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
STAGES = ["tokenize", "route", "upstream"]


class TracedRouter(InProcessRouter):
    """The router's app with a tracer whose spans an in-memory exporter keeps, served by
    uvicorn on a thread (``kvrouter serve``'s code path, less the process)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        super().__init__(config, Tuning(**QUIET), tracer=provider.get_tracer("test"))

    def trace_of(self, request_id: str, stages: int = 3, timeout: float = 10.0) -> tuple[ReadableSpan, list[ReadableSpan]]:
        """The request span of ``request_id`` and its children, once all have ended (the
        spans end after the answer's last byte went out, which the client may see first)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans.get_finished_spans()
            roots = [s for s in spans if s.attributes.get("kvrouter.request_id") == request_id]
            if roots:
                root = roots[0]
                children = sorted((s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
                                  key=lambda s: s.start_time)
                if len(children) >= stages:
                    assert len(roots) == 1 and len(children) == stages, (roots, children)
                    return root, children
            assert time.monotonic() < deadline, f"no trace of {request_id}: {[s.name for s in spans]}"
            time.sleep(0.02)


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


def test_a_request_is_a_span_with_tokenize_route_and_upstream_children(sim_fleet: Any) -> None:
    sim = sim_fleet(instances=2)
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    with TracedRouter(sim_config(sim)) as router, httpx.Client(base_url=router.url, timeout=30) as c:
        traces = []
        for i, headers in enumerate(({"traceparent": CLIENT_PARENT}, {})):
            r = c.post("/v1/chat/completions", json=chat, headers={"x-request-id": f"traced-{i}", **headers})
            assert r.status_code == 200
            usage = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")][-1]["usage"]
            traces.append((router.trace_of(f"traced-{i}"), r.headers["x-kvrouter-backend"], usage))
            time.sleep(0.3)  # the engine's events reach the index: the second request is a cache hit
        assert c.get("/health").status_code == 200
        time.sleep(0.2)
        assert not [s for s in router.spans.get_finished_spans() if s.attributes.get("url.path") == "/health"]

    for n, ((root, children), backend, usage) in enumerate(traces):
        # One request span (server kind), three stage spans under it, in order and within it.
        assert root.name == "POST /v1/chat/completions" and root.kind == SpanKind.SERVER
        assert [s.name for s in children] == STAGES
        assert all(s.context.trace_id == root.context.trace_id for s in children)
        tokenize, route, upstream = children
        assert upstream.kind == SpanKind.CLIENT
        assert root.start_time <= tokenize.start_time <= tokenize.end_time == route.start_time
        assert route.end_time == upstream.start_time <= upstream.end_time <= root.end_time
        assert [e.name for e in upstream.events] == ["first token"]
        assert upstream.start_time < upstream.events[0].timestamp < upstream.end_time
        # The decision and the answer, as the access log has them.
        a = root.attributes
        assert a["http.request.method"] == "POST" and a["http.route"] == "/v1/chat/completions"
        assert a["http.response.status_code"] == 200 and root.status.status_code == StatusCode.UNSET
        assert a["kvrouter.model"] == MODEL and a["kvrouter.backend"] == backend == upstream.attributes["kvrouter.backend"]
        assert (a["kvrouter.prompt_tokens"], a["kvrouter.completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert a["kvrouter.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert a["kvrouter.predicted_cached_tokens"] == route.attributes["kvrouter.predicted_cached_tokens"]
        assert 0 < a["kvrouter.ttft_ms"] <= (root.end_time - root.start_time) / 1e6
        assert route.attributes["kvrouter.policy"] == "kv_aware" and route.attributes["kvrouter.backend"] == backend
        assert route.attributes["kvrouter.reason"] == a["kvrouter.reason"]
        assert route.attributes["kvrouter.candidates"] == 2 and len(route.attributes["kvrouter.order"]) == 2
        assert tokenize.attributes["kvrouter.plan"] == "ExactIds"
        assert tokenize.attributes["kvrouter.num_tokens"] == usage["prompt_tokens"]
        assert tokenize.attributes["kvrouter.blocks"] == usage["prompt_tokens"] // 16
        if n == 0:  # the client's traceparent is the request span's parent
            assert hex_ids(root)[0] == CLIENT_TRACE and f"{root.parent.span_id:016x}" == CLIENT_SPAN
            assert root.parent.is_remote
            assert route.attributes["kvrouter.matched_blocks"] == 0
        else:  # none sent: a trace of its own
            assert root.parent is None and hex_ids(root)[0] != CLIENT_TRACE
            assert a["kvrouter.reason"] == "cache_hit" and route.attributes["kvrouter.matched_blocks"] > 0
            assert a["kvrouter.cached_tokens"] > 0 and a["kvrouter.predicted_cached_tokens"] == a["kvrouter.cached_tokens"]


class HeaderEngine(LoopbackEngine):
    """Answers chat completions and embeddings at once and keeps each request's
    ``traceparent`` by ``x-request-id``; a chat whose last message is ``"fail"`` gets a 500."""

    def __init__(self) -> None:
        super().__init__()
        self.traceparent: dict[str, str | None] = {}

    async def _answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.traceparent[request.headers.get("x-request-id", "")] = request.headers.get("traceparent")
        if body.get("messages", [{}])[-1].get("content") == "fail":
            return web.json_response({"error": {"message": "engine failed"}}, status=500)
        if request.path == "/v1/embeddings":
            return web.json_response({"object": "list", "data": [{"embedding": [0.0]}],
                                      "usage": {"prompt_tokens": 2, "total_tokens": 2}})
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                                  "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/embeddings", self._answer)


@pytest.fixture
def header_engine() -> Iterator[HeaderEngine]:
    with HeaderEngine() as e:
        yield e


def engine_config(url: str) -> dict[str, Any]:
    return {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_seed": "0",
                        "backends": [{"name": "loop", "url": url}]}],
            "router": {"health_interval_s": 3600, "retries": 0}}


QUIET = {"metrics_scrape_interval_s": 3600}
"""No engine scrapes: the tests count the requests the engine sees."""


def test_the_engine_gets_the_routers_span_as_its_parent(header_engine: HeaderEngine) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1}
    with TracedRouter(engine_config(header_engine.url)) as router, httpx.Client(base_url=router.url, timeout=30) as c:
        for rid, headers in (("with-parent", {"traceparent": CLIENT_PARENT}), ("without", {}),
                             ("bad-parent", {"traceparent": "00-not-a-trace-context-01"})):
            assert c.post("/v1/chat/completions", json=chat, headers={"x-request-id": rid, **headers}).status_code == 200
            root, children = router.trace_of(rid)
            sent = header_engine.traceparent[rid]
            assert sent is not None
            version, trace_id, parent_id, flags = sent.split("-")
            # The router's trace, with its request span as the engine's parent (not the client's span).
            assert version == "00" and int(flags, 16) & 1  # sampled (the SDK may set W3C's "random" bit too)
            assert (trace_id, parent_id) == hex_ids(root)
            assert parent_id != CLIENT_SPAN and parent_id not in {hex_ids(s)[1] for s in children}
            assert (trace_id == CLIENT_TRACE) == (rid == "with-parent")

        # An engine's 500: the request span and the upstream span are errors.
        r = c.post("/v1/chat/completions", headers={"x-request-id": "failing"},
                   json={**chat, "messages": [{"role": "user", "content": "fail"}]})
        assert r.status_code == 500
        root, (_, _, upstream) = router.trace_of("failing")
        assert root.status.status_code == StatusCode.ERROR and root.attributes["error.type"] == "500"
        assert upstream.status.status_code == StatusCode.ERROR

        # The router's own 4xx: the request span alone (nothing was routed), not an error.
        r = c.post("/v1/chat/completions", headers={"x-request-id": "unknown-model"}, json={**chat, "model": "nope"})
        assert r.status_code == 404
        root, _ = router.trace_of("unknown-model", stages=0)
        assert root.attributes["http.response.status_code"] == 404 and root.status.status_code == StatusCode.UNSET
        assert "unknown-model" not in header_engine.traceparent

        # A passthrough (no prompt routed on): the request span alone, and the engine still its child.
        r = c.post("/v1/embeddings", headers={"x-request-id": "embedded"}, json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200
        root, _ = router.trace_of("embedded", stages=0)
        assert root.name == "POST /v1/embeddings" and root.attributes["kvrouter.backend"] == "loop"
        assert header_engine.traceparent["embedded"].split("-")[1:3] == list(hex_ids(root))

        # A path the router does not know: named by its method alone (a scan makes no new span names).
        assert c.get("/no/such/path").status_code == 404
        time.sleep(0.2)
        assert [s.name for s in router.spans.get_finished_spans() if s.attributes.get("url.path") == "/no/such/path"] == ["GET"]


@pytest.mark.parametrize(("env", "flag", "expected"), [
    ({}, False, []),
    ({}, True, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, False, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, True, ["console"]),
    ({"OTEL_TRACES_EXPORTER": " Console , otlp"}, False, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none"}, True, []),
    ({"OTEL_TRACES_EXPORTER": ""}, False, []),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, True, []),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, False, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False, []),
])
def test_which_exporters_the_environment_asks_for(env: dict[str, str], flag: bool, expected: list[str]) -> None:
    assert tracing.exporters(flag, env) == expected


def test_an_exporter_or_protocol_the_router_does_not_offer_is_one_line() -> None:
    with pytest.raises(tracing.TracingError, match="not jaeger, zipkin"):
        tracing.exporters(False, {"OTEL_TRACES_EXPORTER": "zipkin,otlp,jaeger"})
    with pytest.raises(tracing.TracingError, match="not http/json"):
        tracing.protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert tracing.protocol({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "grpc"


# -- real `kvrouter serve` processes -------------------------------------------------------

IMPORT_SPY = """\
import atexit, json, os, sys

FIRST_PARTY = tuple(os.path.join(os.environ["KVR_REPO"], p) + os.sep for p in ("router", "kvconfig", "indexer"))
imported = []


class Spy:
    \"\"\"Notes which file imports each OpenTelemetry module: the first frame that is not importlib's.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "opentelemetry" or name == "router.http.spans":
            f = sys._getframe(1)
            while f is not None and ("importlib" in f.f_code.co_filename or f.f_code.co_filename.startswith("<")):
                f = f.f_back
            imported.append((name, f.f_code.co_filename if f is not None else "?"))
        return None


def _dump():
    with open(os.environ["KVR_MODULES_OUT"], "w") as out:
        json.dump({"by_us": [n for n, f in imported if f.startswith(FIRST_PARTY)],
                   "loaded": sorted(m for m in sys.modules if m.startswith(("opentelemetry", "router.http")))}, out)


sys.meta_path.insert(0, Spy())
atexit.register(_dump)
"""


@pytest.mark.parametrize("traced", [False, True], ids=["off", "on"])
def test_a_router_that_does_not_trace_imports_nothing_of_opentelemetry(header_engine: HeaderEngine, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch, traced: bool) -> None:
    """No ``OTEL_TRACES_EXPORTER``: off, even with an OTLP endpoint in the environment (as
    platforms set in every pod). What the router's dependencies import of OpenTelemetry on
    their own (FastAPI the API, for its own tracing; redis-py the SDK's metrics, when the SDK
    is installed) is theirs: the check is that no module of this repository imports any of
    it, and that the SDK's tracing, without which no span can be made, is never loaded.
    Traced (``console``), the same spy sees the router import it: the check can fail."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(IMPORT_SPY)
    out = tmp_path / "modules.json"
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    env = {"PYTHONPATH": f"{site}{os.pathsep}{REPO}", "KVR_MODULES_OUT": str(out), "KVR_REPO": str(REPO),
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **({"OTEL_TRACES_EXPORTER": "console"} if traced else {})}
    router = RouterProc("untraced", engine_config(header_engine.url), tmp_path, env=env, log_level="info",
                        extra_args=["--workers", "1"], tuning=QUIET)
    rid = f"traced-{traced}"
    try:
        r = httpx.post(router.url + "/v1/chat/completions", headers={"x-request-id": rid, "traceparent": CLIENT_PARENT},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=30)
        assert r.status_code == 200
    finally:
        router.proc.terminate()
        router.proc.popen.wait(30)
    assert router.proc.popen.returncode == 0, router.log()
    seen = json.loads(out.read_text())
    assert "router.http.dispatch" in seen["loaded"]  # the spy saw the router serve
    ours = [m for m in seen["loaded"] if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter", "router.http.spans"))]
    if traced:
        assert "opentelemetry.sdk.trace" in seen["by_us"] and "router.http.spans" in ours
        assert CLIENT_TRACE in router.log()
        return
    assert seen["by_us"] == [] and ours == []
    assert "tracing on" not in router.log()
    # Tracing off, the client's traceparent reaches the engine as it was (the proxy's allow-list).
    assert header_engine.traceparent[rid] == CLIENT_PARENT


def test_each_worker_exports_its_own_spans(header_engine: HeaderEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--workers 2`` with the console exporter: spans from both worker processes, flushed
    when they drain and exit (the batch processor's thread is each worker's own)."""
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "60000"}
    router = RouterProc("workers", engine_config(header_engine.url), tmp_path, env=env, log_level="info",
                        extra_args=["--workers", "2"], tuning=QUIET)
    rids = [f"w-{i}" for i in range(16)]
    try:
        for rid in rids:  # a connection each: SO_REUSEPORT spreads them over the workers
            r = httpx.post(router.url + "/v1/chat/completions", headers={"x-request-id": rid},
                           json={"model": MODEL, "messages": [{"role": "user", "content": rid}], "max_tokens": 1}, timeout=30)
            assert r.status_code == 200
    finally:
        router.proc.terminate()
        router.proc.popen.wait(60)
    assert router.proc.popen.returncode == 0, router.log()
    spans = [json.loads(line) for line in router.log().splitlines() if line.startswith('{"name"')]
    served = {s["attributes"]["kvrouter.request_id"]: s for s in spans if s["kind"] == "SpanKind.SERVER"}
    roots = {rid: s for rid, s in served.items() if s["name"].startswith("POST")}  # not the start's polls of GET /debug/backends
    assert sorted(roots) == sorted(rids)
    assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"kvrouter"}
    assert {s["resource"]["attributes"]["kvrouter.worker"] for s in roots.values()} == {0, 1}
    for root in roots.values():
        children = [s["name"] for s in spans if s["parent_id"] == root["context"]["span_id"]]
        assert sorted(children) == sorted(STAGES)
        assert header_engine.traceparent[root["attributes"]["kvrouter.request_id"]].split("-")[2] == root["context"]["span_id"][2:]


BLOCK_SDK = """\
import sys


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""


@pytest.mark.parametrize(("env", "args"), [({"OTEL_TRACES_EXPORTER": "otlp"}, []), ({}, ["--otel"]),
                                           ({"OTEL_TRACES_EXPORTER": "console"}, ["--workers", "2"])])
def test_tracing_without_the_sdk_stops_at_start_with_one_line(tmp_path: Path, env: dict[str, str], args: list[str]) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_SDK)
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump(engine_config("http://127.0.0.1:9")))
    full = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full |= {"PYTHONPATH": f"{site}{os.pathsep}{REPO}", **env}
    r = subprocess.run([*KVROUTER, "serve", "--config", str(cfg), "--port", str(free_port()), *args], env=full, cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.endswith("is not installed: pip install 'kvrouter[otel]'\n"), r.stderr
    assert r.stderr.startswith("tracing is on (OTEL_TRACES_EXPORTER="), r.stderr
