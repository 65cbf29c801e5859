"""Health checks judge the engine, not the router's own event loop, and a slow engine keeps its index.

A red-team request blocked the router's event loop for 2.5-5 s: the health checks in flight
timed out *because the loop was stalled* (their answers sat in the socket buffer while their
timers went off late), both backends were ejected, and each ejection purged the backend's
KV events from the index. Here a real ``kvrouter serve`` follows two loopback engines, each
with a vLLM-shaped event publisher, and:

- the router process is stopped (SIGSTOP, then SIGCONT: its loop stalls for several health
  timeouts, exactly as a blocking request stalls it) while both engines' checks are in
  flight: no backend is ejected, the index keeps both, and the discounted checks are counted;
- an engine whose ``/health`` hangs (a SIGSTOPped or wedged engine: its KV cache is still
  there) is ejected without being purged;
- an engine that refuses connections (its process is gone) is ejected and purged.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.events import BlockStored, EventBatch, encode_batch
from indexer.hashing import BlockHasher
from kvpub import EnginePublisher
from support import QWEN3_DIR, LoopbackEngine, RouterProc, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MODEL = "qwen3"
INTERVAL_S = 0.5
"""Health interval: each check may take 1 s (``health_timeout``'s floor)."""
STALL_S = 3.0
"""How long the router's loop is stalled: three health timeouts."""
ANSWER_S = 0.3
"""How long a stalled test's engines take to answer ``/health``: their checks are surely in
flight when the router is stopped, and answered (well within the timeout) while it is."""
BLOCKS = 32
PURGE_SEEN_S = 1.5
"""How long after an ejection a purge would surely show in ``/debug/backends``: the subscriber
thread purges at once, the router re-reads its stats every 0.5 s."""


class Engine(LoopbackEngine):
    """An engine whose ``/health`` answers after ``delay_s``, hangs while ``hung``, and sets
    ``checked`` whenever a check arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = threading.Event()
        self.delay_s = 0.0
        self.hung = False

    def routes(self, app: Any) -> None:
        pass

    async def _health(self, request: Any) -> Any:
        self.checked.set()
        await asyncio.sleep(self.delay_s)
        while self.hung:
            await asyncio.sleep(0.05)
        return await super()._health(request)


@dataclass
class Fleet:
    router: RouterProc
    engines: list[Engine]
    client: httpx.Client

    def backends(self) -> dict[str, dict[str, Any]]:
        return {b["name"]: b for b in self.client.get(self.router.url + "/debug/backends").json()["backends"]}

    def discounted(self) -> dict[str, float]:
        prefix = "kvrouter_health_checks_discounted_total{"
        return {line.split('"')[1]: float(line.rsplit(" ", 1)[1])
                for line in self.client.get(self.router.url + "/metrics").text.splitlines() if line.startswith(prefix)}


def stored_batch(seed: int) -> bytes:
    """One batch of ``BLOCKS`` stored blocks with their true hashes (the router's verifier checks them)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 150_000) for _ in range(16 * BLOCKS)]
    hashes = BlockHasher("sha256", 16, None, "0.33.0").hash_blocks(tokens)
    return encode_batch(EventBatch(time.time(), [BlockStored(hashes, None, tokens, 16, None, "GPU")], 0), "0.33.0")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A router following two engines, each holding ``BLOCKS`` blocks in the router's index."""
    pubs = [EnginePublisher(), EnginePublisher()]
    with Engine() as e0, Engine() as e1:
        engines = [e0, e1]
        config = {
            "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "max_model_len": 4096,
                        "backends": [{"name": f"engine-{i}", "url": e.url, "kv_events": p.endpoint,
                                      "kv_replay": p.replay_endpoint} for i, (e, p) in enumerate(zip(engines, pubs))]}],
            "router": {"health_interval_s": INTERVAL_S},
        }
        router = RouterProc("router", config, tmp_path, log_level="info", tuning={"metrics_scrape_interval_s": 3600})
        f = Fleet(router, engines, httpx.Client(timeout=10.0))
        try:
            for i, pub in enumerate(pubs):
                pub.wait_subscribed()
                pub.publish(stored_batch(i))
            wait_for(lambda: all(b["blocks"] == BLOCKS for b in f.backends().values()), "both engines indexed", timeout=15)
            yield f
        finally:
            for e in engines:
                e.hung = False
            os.kill(router.proc.popen.pid, signal.SIGCONT)
            f.client.close()
            router.stop()
            for pub in pubs:
                pub.close()


def test_a_stalled_router_loop_ejects_no_backend_and_keeps_the_index(fleet: Fleet) -> None:
    for e in fleet.engines:
        e.delay_s = ANSWER_S
        e.checked.clear()
    wait_for(lambda: all(e.checked.is_set() for e in fleet.engines), "a check of both engines", timeout=5)
    pid = fleet.router.proc.popen.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 4 * INTERVAL_S
    while time.monotonic() < deadline:  # the late checks, their second tries and the next rounds
        backends = fleet.backends()
        assert all(b["healthy"] and b["ejections"] == 0 for b in backends.values()), backends
        assert all(b["blocks"] == BLOCKS for b in backends.values()), backends
        time.sleep(0.05)
    assert fleet.discounted() == {"engine-0": 1.0, "engine-1": 1.0}
    assert "discounted" in fleet.router.log()


def test_a_hung_engine_is_ejected_but_keeps_its_index_entries(fleet: Fleet) -> None:
    fleet.engines[1].hung = True
    wait_for(lambda: not fleet.backends()["engine-1"]["healthy"], "the hung engine's ejection", timeout=10)
    assert "Timeout" in fleet.backends()["engine-1"]["last_error"]
    deadline = time.monotonic() + PURGE_SEEN_S
    while time.monotonic() < deadline:
        backends = fleet.backends()
        assert not backends["engine-1"]["healthy"] and backends["engine-1"]["blocks"] == BLOCKS, backends
        assert backends["engine-0"]["healthy"] and backends["engine-0"]["ejections"] == 0, backends
        time.sleep(0.05)
    fleet.engines[1].hung = False
    wait_for(lambda: fleet.backends()["engine-1"]["healthy"], "the engine's re-admission", timeout=10)
    assert fleet.backends()["engine-1"]["blocks"] == BLOCKS


def test_a_refused_engine_is_ejected_and_purged(fleet: Fleet) -> None:
    fleet.engines[1].stop()
    wait_for(lambda: not fleet.backends()["engine-1"]["healthy"], "the gone engine's ejection", timeout=10)
    wait_for(lambda: fleet.backends()["engine-1"]["blocks"] == 0, "the gone engine's purge", timeout=5)
    assert fleet.backends()["engine-0"]["blocks"] == BLOCKS
