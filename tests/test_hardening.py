"""Issue 17's hardening, checked against real ``kvrouter serve`` processes on loopback.

Behind the routers is :class:`EchoEngine`: a small aiohttp server in this process that
answers vLLM's OpenAI endpoints the way a client needs (JSON, or an SSE stream) and
records the headers of every request it gets, so a test can see exactly what reached an
engine; it also fails on cue (a stream cut mid-way, a listener that goes away).

Three routers, one per key set-up (see router/http/auth.py for the table):

- ``secured``: a client key, an admin key and the engine's own key, all in the file;
- ``env_keyed``: only a client key and the engine's key, both from the environment;
- ``open_fleet``: no key at all, decision headers on, the client's Authorization passed on.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from aiohttp import web

from kvconfig import ConfigError, load_config, parse_config
from support import QWEN3_DIR, REPO, LoopbackEngine, RouterProc

pytestmark = pytest.mark.slow

CLIENT_KEY = "sk-client-" + uuid.uuid4().hex
ADMIN_KEY = "sk-admin-" + uuid.uuid4().hex
ENGINE_KEY = "sk-engine-" + uuid.uuid4().hex
ENV_CLIENT_KEY = "sk-env-client-" + uuid.uuid4().hex
ENV_ENGINE_KEY = "sk-env-engine-" + uuid.uuid4().hex
SECRETS = (CLIENT_KEY, ADMIN_KEY, ENGINE_KEY)
MODEL = "m"
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize", "/debug/route")
ADMIN_PATHS = (("POST", "/debug/route"), ("GET", "/debug/backends"))


class EchoEngine(LoopbackEngine):
    """An OpenAI-shaped engine on a loopback port that remembers what it was sent.

    ``seen[x-request-id]`` holds each request's headers (lower-cased names, every value);
    ``health_auth`` the Authorization of the last health check. A completion whose prompt
    is ``"cut"`` and streams sends one event and then closes the connection."""

    RESPONSE_HEADERS = {
        "x-kvrouter-backend": "forged-by-engine",
        "x-kvrouter-reason": "forged-by-engine",
        "x-engine-secret-route": "10.9.8.7:4242",
        "proxy-authenticate": "Basic realm=engine",
        "keep-alive": "timeout=99",
        "cache-control": "no-store",
        "set-cookie": "engine_session=tenant-a; Path=/",
    }

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list[tuple[str, str]]] = {}
        self.health_auth: str | None = None

    def headers_of(self, rid: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for k, v in self.seen[rid]:
            out.setdefault(k, []).append(v)
        return out

    async def _health(self, request: web.Request) -> web.Response:
        self.health_auth = request.headers.get("authorization")
        return web.json_response({})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        rid = request.headers.get("x-request-id", "")
        self.seen[rid] = [(k.lower(), v) for k, v in request.headers.items()]
        body = json.loads(raw)
        headers = {**self.RESPONSE_HEADERS, "x-request-id": rid}
        if not body.get("stream"):
            return web.json_response({"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}, headers=headers)
        response = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "text": "o"}]}\n\n')
        if body.get("prompt") == "cut":
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def routes(self, app: web.Application) -> None:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"):
            app.router.add_post(path, self._answer)


def config(backends: list[dict[str, Any]], models: dict[str, list[str]] | None = None, **router: Any) -> dict[str, Any]:
    models = models or {MODEL: [b["name"] for b in backends]}
    by_name = {b["name"]: b for b in backends}
    return {
        "models": [
            {"name": m, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_seed": "0", "max_model_len": 4096,
             "backends": [by_name[n] for n in names]}
            for m, names in models.items()
        ],
        # One health check, at start: a backend the test takes down stays routable until a request finds it gone.
        "router": {"health_interval_s": 3600, "retries": 0, **router},
    }


QUIET = {"metrics_scrape_interval_s": 3600}
"""No engine scrapes, as no health checks after the first."""


@pytest.fixture(scope="module")
def engine() -> Iterator[EchoEngine]:
    with EchoEngine() as e:
        yield e


@pytest.fixture(scope="module")
def doomed() -> Iterator[EchoEngine]:
    """An engine the connect-error test takes down."""
    with EchoEngine() as e:
        yield e


@pytest.fixture(scope="module")
def secured(engine: EchoEngine, doomed: EchoEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    backends = [{"name": "echo", "url": engine.url, "api_key": ENGINE_KEY}, {"name": "doomed", "url": doomed.url}]
    cfg = config(backends, {MODEL: ["echo"], "gone": ["doomed"]}, api_key=CLIENT_KEY, admin_api_key=ADMIN_KEY)
    r = RouterProc("secured", cfg, tmp_path_factory.mktemp("secured"), tuning=QUIET)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def env_keyed(engine: EchoEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    env = {"KVROUTER_API_KEY": ENV_CLIENT_KEY, "KVROUTER_BACKEND_API_KEY": ENV_ENGINE_KEY, "KVROUTER_ADMIN_API_KEY": ""}
    r = RouterProc("env", config([{"name": "echo", "url": engine.url}]), tmp_path_factory.mktemp("env"), env=env, tuning=QUIET)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def open_fleet(engine: EchoEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    cfg = config([{"name": "echo", "url": engine.url}], expose_decision_headers=True, forward_client_authorization=True)
    r = RouterProc("open", cfg, tmp_path_factory.mktemp("open"), tuning=QUIET)
    yield r
    r.stop()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def completion(url: str, *, key: str | None = None, headers: dict[str, str] | None = None, **body: Any) -> tuple[httpx.Response, str]:
    """POST /v1/completions with a fresh x-request-id (the engine files what it saw under it)."""
    rid = uuid.uuid4().hex
    sent = {"x-request-id": rid, **(bearer(key) if key else {}), **(headers or {})}
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1, **body}, headers=sent, timeout=30)
    return r, rid


def error_of(r: httpx.Response) -> dict[str, Any]:
    return r.json()["error"]


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# -- 1. deeply nested JSON --------------------------------------------------------------


@pytest.mark.parametrize("path", POST_PATHS)
def test_deeply_nested_json_is_a_400_on_every_post_endpoint(secured: RouterProc, path: str) -> None:
    key = ADMIN_KEY if path.startswith("/debug") else CLIENT_KEY
    for content in (b"[" * 5000, b'{"model": "m", "prompt": ' + b"[" * 5000):
        r = httpx.post(secured.url + path, content=content, headers={**bearer(key), "content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert error_of(r)["code"] == "invalid_json" and "nested too deeply" in error_of(r)["message"]
    assert "Traceback" not in secured.log() and "RecursionError" not in secured.log()


@pytest.mark.parametrize("depth", [100, 500, 900, 950, *range(960, 990, 3), 995])
def test_a_body_the_decoder_takes_but_nested_deep_is_never_a_500(secured: RouterProc, depth: int) -> None:
    """Nesting just under the decoder's limit decodes, then may exhaust the stack wherever
    the router walks the body next (the chat template renders tools with ``tojson``, the
    history memo encodes every field): a 400 then, too."""
    long = b" ".join([b"hi"] * 1500)  # long enough for the history memo to hash it
    head = b'{"model": "m", "messages": [{"role": "user", "content": "' + long + b'"}], "extra": '
    tool = b'{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": '
    for path, content in (
        ("/v1/chat/completions", head + nested(depth) + b"}"),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": ' + nested(depth) + b"}]}"),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": ['
         + tool + nested(depth) + b"}}}]}"),
        ("/v1/completions", b'{"model": "m", "prompt": ' + nested(depth) + b"}"),
    ):
        r = httpx.post(secured.url + path, content=content, headers={**bearer(CLIENT_KEY), "content-type": "application/json"})
        assert r.status_code in (200, 400), r.text
    assert "Traceback" not in secured.log()


# -- 2, 3. client key, admin key, constant-time comparison, keys from the environment ----


def test_the_client_key_opens_the_openai_endpoints_and_not_debug(secured: RouterProc) -> None:
    r, _ = completion(secured.url, key=CLIENT_KEY)
    assert r.status_code == 200, r.text
    assert httpx.get(secured.url + "/v1/models", headers=bearer(CLIENT_KEY)).status_code == 200
    for method, path in ADMIN_PATHS:
        r = httpx.request(method, secured.url + path, json={"model": MODEL, "prompt": "x"}, headers=bearer(CLIENT_KEY))
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", r.text


def test_the_admin_key_opens_debug_and_not_the_openai_endpoints(secured: RouterProc) -> None:
    for method, path in ADMIN_PATHS:
        r = httpx.request(method, secured.url + path, json={"model": MODEL, "prompt": "x"}, headers=bearer(ADMIN_KEY))
        assert r.status_code == 200, r.text
    r, _ = completion(secured.url, key=ADMIN_KEY)
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"


@pytest.mark.parametrize("value", [
    None, "", f"Bearer {CLIENT_KEY}x", f"Bearer {CLIENT_KEY[:-1]}", f"Basic {CLIENT_KEY}", CLIENT_KEY, f"Bearer{CLIENT_KEY}",
])
def test_anything_but_the_whole_key_is_refused(secured: RouterProc, value: str | None) -> None:
    r, _ = completion(secured.url, headers={} if value is None else {"authorization": value})
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"


def test_the_bearer_scheme_is_case_insensitive(secured: RouterProc) -> None:
    r, _ = completion(secured.url, headers={"authorization": f"bearer {CLIENT_KEY}"})
    assert r.status_code == 200, r.text


def test_debug_is_closed_when_only_a_client_key_is_configured(env_keyed: RouterProc) -> None:
    for key in (ENV_CLIENT_KEY, "anything", None):
        for method, path in ADMIN_PATHS:
            r = httpx.request(method, env_keyed.url + path, json={"model": MODEL, "prompt": "x"}, headers=bearer(key) if key else {})
            assert r.status_code == 403 and error_of(r)["code"] == "admin_disabled", r.text


def test_keys_come_from_the_environment(engine: EchoEngine, env_keyed: RouterProc) -> None:
    assert completion(env_keyed.url)[0].status_code == 401
    r, rid = completion(env_keyed.url, key=ENV_CLIENT_KEY)
    assert r.status_code == 200, r.text
    assert engine.headers_of(rid)["authorization"] == [f"Bearer {ENV_ENGINE_KEY}"]
    assert "KVROUTER_API_KEY" in env_keyed.log() and ENV_CLIENT_KEY not in env_keyed.log()


def test_with_no_key_configured_everything_stays_open(open_fleet: RouterProc) -> None:
    assert completion(open_fleet.url)[0].status_code == 200
    assert httpx.get(open_fleet.url + "/v1/models").status_code == 200
    for method, path in ADMIN_PATHS:
        assert httpx.request(method, open_fleet.url + path, json={"model": MODEL, "prompt": "x"}).status_code == 200


def test_an_empty_key_is_rejected_at_start_not_read_as_no_key() -> None:
    raw = config([{"name": "b", "url": "http://127.0.0.1:1"}], api_key="")
    with pytest.raises(ConfigError, match="router.api_key"):
        parse_config(raw)


# -- 4. cross-tenant probing: decision headers are opt-in --------------------------------


def test_only_the_backend_header_is_sent_by_default(secured: RouterProc) -> None:
    r, _ = completion(secured.url, key=CLIENT_KEY)
    assert r.headers.get_list("x-kvrouter-backend") == ["echo"]
    assert "x-kvrouter-reason" not in r.headers


def test_decision_headers_are_sent_when_exposed(open_fleet: RouterProc) -> None:
    r, _ = completion(open_fleet.url)
    assert r.headers.get_list("x-kvrouter-backend") == ["echo"]
    assert r.headers.get_list("x-kvrouter-reason") not in ([], ["forged-by-engine"])


# -- 5. no internal addresses in client errors -------------------------------------------


def test_a_backend_that_cannot_be_reached_is_named_not_located(secured: RouterProc, doomed: EchoEngine) -> None:
    doomed.stop()
    r = httpx.post(secured.url + "/v1/completions", json={"model": "gone", "prompt": "hi"}, headers=bearer(CLIENT_KEY))
    assert r.status_code == 502 and error_of(r)["code"] == "upstream_error", r.text
    message = error_of(r)["message"]
    assert "doomed" in message
    assert "127.0.0.1" not in r.text and str(doomed.port) not in r.text and "Error" not in message
    # The operator still sees where, as ``kind: message (url)``, not as aiohttp's repr.
    line = next(x for x in secured.log().splitlines() if "backend doomed: connect:" in x)
    assert f"ClientConnectorError: Cannot connect to host 127.0.0.1:{doomed.port}" in line and f"({doomed.url})" in line
    assert "ConnectionKey(" not in secured.log()
    metrics = httpx.get(secured.url + "/metrics", headers=bearer(ADMIN_KEY)).text
    assert 'kvrouter_upstream_failures_total{backend="doomed",kind="connect"}' in metrics


def test_a_stream_cut_mid_way_ends_with_an_error_event_without_details(secured: RouterProc) -> None:
    with httpx.stream("POST", secured.url + "/v1/completions", json={"model": MODEL, "prompt": "cut", "stream": True},
                      headers=bearer(CLIENT_KEY), timeout=30) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-1][len("data: "):])["error"]
    assert error["message"] == "backend echo failed mid-stream"


# -- 6. Authorization towards engines; no secret anywhere a client or a log reader sees ---


def test_engines_get_their_own_key_never_the_clients(engine: EchoEngine, secured: RouterProc) -> None:
    r, rid = completion(secured.url, key=CLIENT_KEY)
    assert r.status_code == 200
    assert engine.headers_of(rid)["authorization"] == [f"Bearer {ENGINE_KEY}"]
    tok_rid = uuid.uuid4().hex
    r = httpx.post(secured.url + "/tokenize", json={"model": MODEL, "prompt": "x"}, headers={**bearer(CLIENT_KEY), "x-request-id": tok_rid})
    assert r.status_code == 200
    assert engine.headers_of(tok_rid)["authorization"] == [f"Bearer {ENGINE_KEY}"]


def test_the_clients_authorization_is_passed_on_only_when_configured(engine: EchoEngine, open_fleet: RouterProc) -> None:
    r, rid = completion(open_fleet.url, key="tenant-own-key")
    assert r.status_code == 200
    assert engine.headers_of(rid)["authorization"] == ["Bearer tenant-own-key"]
    r, rid = completion(open_fleet.url)
    assert "authorization" not in engine.headers_of(rid)


def test_no_configured_secret_appears_in_logs_debug_or_error_bodies(secured: RouterProc) -> None:
    url, seen = secured.url, []
    client, admin = bearer(CLIENT_KEY), bearer(ADMIN_KEY)
    json_type = {"content-type": "application/json"}
    for r in (
        httpx.get(url + "/debug/backends", headers=admin),
        httpx.post(url + "/debug/route?include_tokens=true", json={"model": MODEL, "prompt": "secret?"}, headers=admin),
        httpx.get(url + "/debug/backends", headers=client),
        httpx.get(url + "/v1/models", headers=bearer("wrong")),
        httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=client),
        httpx.post(url + "/v1/completions", content=b"{not json", headers={**client, **json_type}),
        httpx.post(url + "/v1/completions", content=b"\xff\xfe", headers={**client, **json_type}),
        httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=client),
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1] * 5000, "max_tokens": 1}, headers=client),
        httpx.post(url + "/v1/completions", json={"model": "gone", "prompt": "x"}, headers=client),
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "cut", "stream": True}, headers=client),
        httpx.get(url + "/metrics"),
        httpx.get(url + "/nowhere", headers=client),
        httpx.delete(url + "/debug/backends", headers=admin),
    ):
        seen.append(f"{r.status_code} {r.headers} {r.text}")
    assert {s[:3] for s in seen} >= {"200", "400", "401", "404"}
    everything = "\n".join(seen) + secured.log()
    leaked = [name for name, s in zip(("client", "admin", "engine"), SECRETS) if s in everything]
    assert not leaked, f"secrets leaked: {leaked}"


# -- 7. header hygiene -----------------------------------------------------------------


def test_hop_by_hop_and_kvrouter_headers_do_not_cross_the_router(engine: EchoEngine, secured: RouterProc) -> None:
    r, rid = completion(secured.url, key=CLIENT_KEY, headers={
        "connection": "keep-alive, traceparent",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "keep-alive": "timeout=5",
        "te": "trailers",
        "proxy-authorization": "Basic c2VjcmV0",
        "x-kvrouter-backend": "spoofed",
        "x-kvrouter-reason": "spoofed",
        "x-kvrouter-anything": "spoofed",
    })
    assert r.status_code == 200, r.text
    upstream = engine.headers_of(rid)
    for name in ("traceparent", "keep-alive", "te", "proxy-authorization", "x-kvrouter-backend", "x-kvrouter-reason", "x-kvrouter-anything"):
        assert name not in upstream, name
    assert upstream["x-request-id"] == [rid]
    assert r.headers.get_list("x-kvrouter-backend") == ["echo"]
    for name in ("x-kvrouter-reason", "x-engine-secret-route", "proxy-authenticate", "keep-alive"):
        assert name not in r.headers, name
    assert r.headers["cache-control"] == "no-store" and r.headers["x-request-id"] == rid


def test_a_request_without_a_usable_id_gets_one_the_engine_and_the_client_share(engine: EchoEngine, secured: RouterProc) -> None:
    """No ``x-request-id``, or one the router will not take (too long, not printable ASCII):
    the router makes one, and the engine gets that one alone, the client's never."""
    for sent in ({}, {"x-request-id": "x" * 200}, {"x-request-id": "café".encode()}):
        r = httpx.post(secured.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1},
                       headers={**bearer(CLIENT_KEY), **sent}, timeout=30)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid), rid
        assert engine.headers_of(rid)["x-request-id"] == [rid]


def test_a_cookie_an_engine_sets_is_never_sent_with_another_clients_request(engine: EchoEngine, tmp_path: Path) -> None:
    """The router's one session per engine carries every client's requests. The engine is
    named by host name here: aiohttp's default jar ignores cookies from IP addresses, so a
    jar would hide behind 127.0.0.1 and store this one."""
    by_name = engine.url.replace("127.0.0.1", "localhost")
    router = RouterProc("cookies", config([{"name": "echo", "url": by_name}]), tmp_path, tuning=QUIET)
    try:
        first, _ = completion(router.url)  # answered with Set-Cookie
        assert first.status_code == 200
        second, rid = completion(router.url)
        assert second.status_code == 200
        assert "cookie" not in engine.headers_of(rid)
    finally:
        router.stop()


def raw_request(port: int, head: bytes, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("value", [b"a\x00b", b"a\x01b", b"a\x7fb", b"a\x0bb"])
def test_a_header_with_a_control_character_never_reaches_an_engine(engine: EchoEngine, secured: RouterProc, value: bytes) -> None:
    rid = uuid.uuid4().hex
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {CLIENT_KEY}\r\nx-request-id: {rid}\r\n".encode()
            + b"user-agent: " + value + b"\r\n")
    answer = raw_request(secured.port, head, body)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert rid not in engine.seen


def test_a_folded_header_line_cannot_smuggle_a_header_upstream(engine: EchoEngine, secured: RouterProc) -> None:
    rid = uuid.uuid4().hex
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {CLIENT_KEY}\r\nx-request-id: {rid}\r\n".encode()
            + b"user-agent: a\r\n x-injected: 1\r\n")
    answer = raw_request(secured.port, head, body)
    if rid in engine.seen:
        assert answer.startswith(b"HTTP/1.1 200")
        upstream = engine.headers_of(rid)
        assert "x-injected" not in upstream
        assert all("\n" not in v and "\r" not in v for vs in upstream.values() for v in vs)
    else:
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]


# -- 8. the example configs keep the unauthenticated ZMQ endpoints off public networks ---


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_point_kv_events_at_loopback_or_private_hosts(path: Path) -> None:
    cfg = load_config(path)
    endpoints = [e for m in cfg.models for b in m.backends for e in (b.kv_events, b.kv_replay) if e]
    assert endpoints
    for endpoint in endpoints:
        host = urlsplit(endpoint).hostname
        assert host is not None
        address = ipaddress.ip_address(host)
        assert address.is_loopback or address.is_private, endpoint
    assert "unauthenticated" in path.read_text()


def test_a_backend_url_with_credentials_is_rejected() -> None:
    raw = config([{"name": "b", "url": "http://user:pass@127.0.0.1:1"}])
    with pytest.raises(ConfigError, match="credentials"):
        parse_config(raw)


# -- /metrics: a cache side channel, closed to clients when keys are set ------------------


def test_metrics_take_the_admin_column(secured: RouterProc, env_keyed: RouterProc, open_fleet: RouterProc) -> None:
    """Diffing /metrics around one request told whether a guessed prompt was cached."""
    assert httpx.get(secured.url + "/metrics", headers=bearer(CLIENT_KEY)).status_code == 401
    assert httpx.get(secured.url + "/metrics").status_code == 401
    assert "kvrouter_requests_total" in httpx.get(secured.url + "/metrics", headers=bearer(ADMIN_KEY)).text
    r = httpx.get(env_keyed.url + "/metrics", headers=bearer(ENV_CLIENT_KEY))
    assert r.status_code == 403 and "admin_api_key" in error_of(r)["message"]
    assert "kvrouter_requests_total" in httpx.get(open_fleet.url + "/metrics").text
    assert httpx.get(secured.url + "/livez").status_code == 200  # its "gone" model may have lost its backend
    assert httpx.get(env_keyed.url + "/livez").status_code == 200 and httpx.get(env_keyed.url + "/readyz").status_code == 200
