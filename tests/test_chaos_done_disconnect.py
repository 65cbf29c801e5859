"""A client that hangs up right after ``data: [DONE]`` got a whole stream, not a 499.

The chaos soak's clients (and most OpenAI clients) stop reading at ``[DONE]`` and close
the connection. The engine's response ends a moment later (its chunked terminator, or
here a deliberate pause before it), and the router, still waiting for that end, sees the
client's disconnect. It used to count such a stream as a client disconnect (status 499,
``kvrouter_client_disconnects_total``) and close the upstream connection, as if it had
been cut short: ~1.2% of the soak's complete streams. A client that leaves *before*
``[DONE]`` is still a 499, and every load ticket is released either way.

Behind a real ``kvrouter serve`` is an aiohttp engine on loopback in this process that
streams a few chunks, ``[DONE]``, and then waits ``TAIL_S`` before ending the response.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web

from support import QWEN3_DIR, LoopbackEngine, RouterProc, wait_for

pytestmark = [pytest.mark.timeout(90)]

MODEL = "m"
TAIL_S = 0.4
CHUNKS = 3
GAP_S = 0.3
"""Between chunks: a client that hangs up after the first must be seen gone before [DONE] is
read from the engine, even when the router's loop is late by a busy host's stall."""


class LingeringEngine(LoopbackEngine):
    """Streams ``CHUNKS`` text chunks and ``[DONE]``, then ends the response only after ``TAIL_S``."""

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(CHUNKS):
            doc = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
            await asyncio.sleep(GAP_S)
        await response.write(b"data: [DONE]\n\n")
        await asyncio.sleep(TAIL_S)
        try:
            await response.write_eof()
        except ConnectionResetError:  # the router closed its connection (aiohttp's reset is one)
            pass
        return response

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._stream)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    with LingeringEngine() as engine:
        config = {
            "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "max_model_len": 4096,
                        "backends": [{"name": "lingering", "url": engine.url}]}],
            "router": {"retries": 0, "health_interval_s": 3600, "workers": 1},
        }
        proc = RouterProc("router", config, tmp_path_factory.mktemp("done-disconnect"), log_level="info",
                      tuning={"metrics_scrape_interval_s": 3600})
        try:
            yield proc
        finally:
            proc.stop()


def _counts(router: RouterProc) -> tuple[float, float, float]:
    """(requests answered 200, answered 499, client disconnects) from ``/metrics``."""
    ok = gone = cut = 0.0
    for line in httpx.get(router.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvrouter_requests_total{") and 'backend="lingering"' in line:
            ok += float(line.rsplit(" ", 1)[1]) if 'status="200"' in line else 0.0
            gone += float(line.rsplit(" ", 1)[1]) if 'status="499"' in line else 0.0
        elif line.startswith("kvrouter_client_disconnects_total{"):
            cut += float(line.rsplit(" ", 1)[1])
    return ok, gone, cut


def _in_flight(router: RouterProc) -> int:
    return sum(b["load"]["in_flight"] for b in httpx.get(router.url + "/debug/backends", timeout=10).json()["backends"])


async def _read(router: RouterProc, until: str) -> list[str]:
    """Stream one completion and hang up as soon as a ``data:`` line equals ``until`` (or contains it)."""
    seen: list[str] = []
    async with httpx.AsyncClient(timeout=20) as client:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    seen.append(line[5:].strip())
                    if until in seen[-1]:
                        break
    return seen


def test_hanging_up_after_done_counts_as_a_whole_stream(router: RouterProc) -> None:
    ok0, gone0, cut0 = _counts(router)
    for _ in range(5):
        seen = asyncio.run(_read(router, "[DONE]"))
        assert seen[-1] == "[DONE]" and len(seen) == CHUNKS + 1, seen
    wait_for(lambda: _counts(router)[0] >= ok0 + 5, "five 200s counted", timeout=10 + 5 * (TAIL_S + CHUNKS * GAP_S))
    ok, gone, cut = _counts(router)
    assert (ok - ok0, gone - gone0, cut - cut0) == (5, 0, 0)
    wait_for(lambda: _in_flight(router) == 0, "load tickets released")


def test_hanging_up_before_done_is_still_a_client_disconnect(router: RouterProc) -> None:
    ok0, gone0, cut0 = _counts(router)
    seen = asyncio.run(_read(router, '"t0"'))
    assert len(seen) == 1, seen
    wait_for(lambda: _counts(router)[1] >= gone0 + 1, "a 499 counted", timeout=10)
    ok, gone, cut = _counts(router)
    assert (ok - ok0, gone - gone0, cut - cut0) == (0, 1, 1)
    wait_for(lambda: _in_flight(router) == 0, "load ticket released")
