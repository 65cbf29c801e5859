"""The engines' scraped queue gauges reconcile the router's own load count without double counting it.

A real router in front of a real HTTP engine that holds completions open and reports on
``/metrics`` the requests it holds plus some from "another client". The router must take
from a scrape only what it did not send itself (``scraped_unseen``), keep that until the
next scrape, and count its own requests live: a scrape showing the router's own requests
(a second or more old) must not weigh on the backend once those have finished.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from support import QWEN3_DIR, LoopbackEngine, RouterProc, wait_for

pytestmark = pytest.mark.slow

MODEL = "qwen3"


class HoldingEngine(LoopbackEngine):
    """Completions wait until :meth:`release`; /metrics reports them as running, plus
    ``others`` waiting requests from clients the router does not see."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        self.others = 0
        self._go: asyncio.Event | None = None

    def routes(self, app: Any) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)

    async def _metrics(self, _: Any) -> Any:
        from aiohttp import web

        return web.Response(text=f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {self.others}\n"
                                 f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {self.held}\n")

    async def _completions(self, request: Any) -> Any:
        from aiohttp import web

        await request.read()
        if self._go is None:
            self._go = asyncio.Event()
        self.held += 1
        try:
            await self._go.wait()
        finally:
            self.held -= 1
        return web.json_response({"id": "c", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def release(self) -> None:
        def go() -> None:
            if self._go is not None:
                self._go.set()
        self._loop.call_soon_threadsafe(go)


def _load(url: str) -> dict[str, Any]:
    return httpx.get(url + "/debug/backends", timeout=5).json()["backends"][0]["load"]


def _scraped_after(url: str, running: float, waiting: float) -> dict[str, Any]:
    """The backend's load once a scrape has seen ``running`` and ``waiting``."""
    box: dict[str, Any] = {}

    def seen() -> bool:
        box["load"] = _load(url)
        return box["load"]["scraped_running"] == running and box["load"]["scraped_waiting"] == waiting
    wait_for(seen, f"a scrape showing running={running}, waiting={waiting}", 15)
    return box["load"]


def test_scrape_adds_only_the_requests_the_router_did_not_send(tmp_path: Any) -> None:
    with HoldingEngine() as engine:
        config = {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256",
                              "hash_seed": "0", "vllm_version": "0.33.0",
                              "backends": [{"name": "a", "url": engine.url}]}],
                  "router": {"workers": 1, "health_interval_s": 0.5}}
        router = RouterProc("router", config, tmp_path, tuning={"metrics_scrape_interval_s": 0.2})
        client = httpx.Client(timeout=30)
        try:
            engine.others = 5
            load = _scraped_after(router.url, 0, 5)
            assert load["in_flight"] == 0 and load["scraped_unseen"] == 5.0, load

            # Two requests of the router's own, held on the engine: the scrape sees 2 + 5; the
            # router counts its 2 live and takes 5 from the scrape, not 7.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2) as pool:
                futures = [pool.submit(client.post, router.url + "/v1/completions",
                                       json={"model": MODEL, "prompt": f"hold {i}", "max_tokens": 1}) for i in range(2)]
                wait_for(lambda: engine.held == 2, "the engine to hold both requests", 15)
                load = _scraped_after(router.url, 2, 5)
                assert load["in_flight"] == 2 and load["scraped_unseen"] == 5.0, load
                metrics = httpx.get(router.url + "/metrics", timeout=5).text
                assert 'kvrouter_backend_scraped_unseen_requests{backend="a"} 5.0' in metrics
                engine.release()
                assert [f.result(timeout=15).status_code for f in futures] == [200, 200]

            # Finished: the router's count drops at once, whatever the last scrape said.
            load = _load(router.url)
            assert load["in_flight"] == 0 and load["scraped_unseen"] in (0.0, 5.0), load
            # The other client leaves: the next scrape shows nothing unseen.
            engine.others = 0
            load = _scraped_after(router.url, 0, 0)
            assert load["scraped_unseen"] == 0.0, load
        finally:
            client.close()
            router.stop()
