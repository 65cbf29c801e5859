"""What a client can send, and what an engine can answer, that the router must not pass on as is.

A real ``kvrouter serve`` with a client key in front of :class:`LeakyEngine`, whose 5xx
answers name internal hosts and a password:

- a client that hangs up in the middle of its body is a 499 (``client_closed_request``),
  counted, with no traceback and nothing at ERROR in the log;
- an engine's 5xx body stays in the router's log; the client gets the status and a
  generic OpenAI error (a 4xx body is the client's business and is relayed);
- two ``Authorization`` headers, or a body that repeats a top-level key (a second
  ``cache_salt`` after one a gateway set), are a 400;
- 5xx answers a client's own requests cause do not open a backend's circuit (the router
  checks with a request of its own first), while a backend that fails every request
  still gets its circuit opened.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from support import QWEN3_DIR, LoopbackEngine, RouterProc, openai_error

pytestmark = pytest.mark.slow

MODEL = "m"
KEY = "sk-client-" + uuid.uuid4().hex
ADMIN = "sk-admin-" + uuid.uuid4().hex
SECRET = b"redis://:hunter2@10.1.2.3:6379/0 at internal-host.corp"


class LeakyEngine(LoopbackEngine):
    """A completion whose prompt is ``"500"`` (or ``"400"``) gets that status and a body
    with secrets in it, and one that starts with ``boom`` a 500; with ``fail_all`` every
    request gets a 500; any other gets a small answer."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_all = False

    async def _answer(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        prompt = body.get("prompt")
        if self.fail_all or (isinstance(prompt, str) and prompt.startswith("boom")):
            return web.json_response({"error": {"message": "internal", "type": "x", "code": 500}}, status=500)
        if prompt == "big":
            return web.Response(body=b'{"x": "' + b"a" * (2 << 20) + b'"}', content_type="application/json")
        if prompt == "big-chunked":
            response = web.StreamResponse(headers={"content-type": "application/json"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(8):
                await response.write(b"a" * (256 << 10))
            await response.write_eof()
            return response
        if prompt in ("500", "503", "400"):
            return web.Response(status=int(prompt), body=b'{"detail": "' + SECRET + b'"}', content_type="application/json")
        return web.json_response({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._answer)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    with LeakyEngine() as engine:
        config = {
            "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16,
                        "backends": [{"name": "only", "url": engine.url}]}],
            "router": {"api_key": KEY, "admin_api_key": ADMIN, "retries": 0,
                       "max_body_bytes": 1 << 19},  # answers up to twice that, 1 MiB
        }
        r = RouterProc("router", config, tmp_path_factory.mktemp("requests"), log_level="info",
                       tuning={"breaker_failures": 1000})
        try:
            yield r
        finally:
            r.stop()


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


def metric(router: RouterProc, name: str, **labels: str) -> float:
    text = httpx.get(router.url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return 0.0


def test_a_client_hanging_up_mid_body_is_a_499_without_a_traceback(router: RouterProc) -> None:
    before = metric(router, "kvrouter_rejected_requests_total", status="499", code="client_closed_request")
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"authorization: Bearer {KEY}\r\ncontent-length: 100000\r\n\r\n".encode()
                  + b'{"model": "m", "prompt": "')
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while metric(router, "kvrouter_rejected_requests_total", status="499", code="client_closed_request") <= before:
        assert time.monotonic() < deadline, "the hang-up was not counted as a 499"
        time.sleep(0.1)
    log = router.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


@pytest.mark.parametrize("status", [500, 503])
def test_an_engines_5xx_body_is_not_relayed(router: RouterProc, status: int) -> None:
    r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": str(status)}, headers=auth(), timeout=30)
    assert r.status_code == status
    assert SECRET not in r.content and b"hunter2" not in r.content
    assert openai_error(r.content)["type"] == "server_error"
    assert "hunter2" in router.log()  # the operator still sees what the engine said


def test_an_engines_4xx_body_is_relayed(router: RouterProc) -> None:
    r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "400"}, headers=auth(), timeout=30)
    assert r.status_code == 400 and SECRET in r.content


@pytest.mark.parametrize("prompt", ["big", "big-chunked"])
def test_an_answer_past_twice_max_body_bytes_is_a_502(router: RouterProc, prompt: str) -> None:
    """Non-streamed answers are held whole: three 200 MB ones once added 738 MB of RSS."""
    r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": prompt}, headers=auth(), timeout=30)
    assert r.status_code == 502 and openai_error(r.content)["code"] == "response_too_large", r.text[:300]
    ok = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "fine"}, headers=auth(), timeout=30)
    assert ok.status_code == 200


def test_two_authorization_headers_are_a_400(router: RouterProc) -> None:
    headers = [("authorization", f"Bearer {KEY}"), ("authorization", "Bearer sk-other"), ("content-type", "application/json")]
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    r = httpx.post(router.url + "/v1/completions", content=body, headers=headers, timeout=30)
    assert r.status_code == 400 and openai_error(r.content)["code"] == "duplicate_header", r.text


@pytest.mark.parametrize("body", [
    b'{"model": "m", "prompt": "hi", "cache_salt": "gateway", "cache_salt": "client"}',
    b'{"model": "m", "prompt": "hi", "cache_salt": "gateway", "cache\\u005fsalt": "client"}',
])
def test_a_repeated_top_level_key_is_a_400(router: RouterProc, body: bytes) -> None:
    r = httpx.post(router.url + "/v1/completions", content=body, headers={**auth(), "content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and openai_error(r.content)["code"] == "duplicate_key", r.text
    assert "cache_salt" in openai_error(r.content)["message"]


def test_a_repeated_nested_key_is_the_engines_business(router: RouterProc) -> None:
    body = b'{"model": "m", "prompt": "hi", "logit_bias": {"1": 1, "1": 2}}'
    r = httpx.post(router.url + "/v1/completions", content=body, headers={**auth(), "content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200, r.text


def circuits(router: RouterProc) -> dict[str, bool]:
    backends = httpx.get(router.url + "/debug/backends", timeout=10).json()["backends"]
    return {b["name"]: b["circuit_open"] for b in backends}


def test_request_caused_500s_do_not_open_a_circuit_but_a_failing_backend_still_does(tmp_path: Path) -> None:
    with LeakyEngine() as engine:
        config = {
            "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16,
                        "backends": [{"name": "a", "url": engine.url}, {"name": "b", "url": engine.url}]}],
            "router": {"retries": 0, "policy": "round_robin"},
        }
        router = RouterProc("breaker", config, tmp_path, log_level="info", tuning={"breaker_cooldown_s": 30, "breaker_failures": 3})
        try:
            for i in range(12):
                r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": f"boom {i}"}, timeout=30)
                assert r.status_code == 500
            time.sleep(0.5)  # the router's own requests to each engine
            assert circuits(router) == {"a": False, "b": False}
            assert metric(router, "kvrouter_breaker_verifications_total", backend="a", outcome="request_caused") >= 1
            ok = [httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": f"fine {i}"}, timeout=30)
                  for i in range(4)]
            assert [r.status_code for r in ok] == [200] * 4
            assert httpx.get(router.url + "/health", timeout=10).status_code == 200

            engine.fail_all = True
            deadline = time.monotonic() + 20
            while circuits(router) != {"a": True, "b": True}:
                assert time.monotonic() < deadline, circuits(router)
                httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "anything"}, timeout=30)
            assert metric(router, "kvrouter_breaker_verifications_total", backend="b", outcome="backend_failing") >= 1
        finally:
            router.stop()
