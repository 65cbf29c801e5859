"""An ejected engine's re-sync leaves no memory behind in the router (issue 17 §2).

Each ejection purges the engine's worker from the index; when the engine speaks again the
router re-synchronises it by replaying its whole history from seq 0 (up to vLLM's 10,000
buffered batches), held at once until the replay ends. The 1-hour soak's router RSS rose
in steps at ejections: glibc kept each burst's pages resident in the subscriber's and
libzmq's thread arenas after they were freed (docs/chaos/soak_report.md). Here a real
router follows one engine (a loopback HTTP engine and a vLLM-shaped publisher with a
4.5 MB history), the engine fails its health checks and comes back again and again, and
after every re-sync, with the index rebuilt to the same size, the router's anonymous
memory must stay near where it was before the first ejection with no trend (a leak per
ejection fails it), and every re-sync must have given its freed pages back to the OS
(``indexer/heap.py``, ``kvrouter_kv_event_heap_trims_total``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.events import BlockStored, EventBatch, encode_batch
from indexer.hashing import BlockHasher
from kvpub import EnginePublisher
from support import QWEN3_DIR, LoopbackEngine, RouterProc, wait_for

MODEL = "qwen3"
HISTORY = 900
"""Batches in the engine's replay buffer. Under the replay ROUTER's send high-water mark
(1,000 by default, vLLM's too): a longer answer loses batches on loopback, and the index
each re-sync rebuilds (the memory it holds) would vary from cycle to cycle."""
BLOCKS_PER_BATCH = 64
CYCLES = 12
GROWTH_BOUND_MB = 12.0
"""Anonymous memory a re-synced router may hold above its level before the first ejection.
After each re-sync glibc's thread arenas settle in one of a few states, so the level
jumps between cycles without a trend: over 40 cycles on a quiet host it cycled through
about +0.6, +3.2 and +6.2 MB; a loaded CI host read +8.3 once. Without the trim the level
sits 63 MB higher (the start-up's freed pages never given back)."""
FLOOR_RISE_BOUND_MB = 3.0
"""How far the lowest reading of the last four cycles may sit above the lowest of the
first four. The arena states make single readings noisy, but their floor is steady: it
rose 0.6 MB over 40 cycles (15 KB per ejection). A leak of 0.5 MB per ejection raises it
4 MB within the cycles."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class FlakyEngine(LoopbackEngine):
    """An engine whose ``/health`` answers 503 while ``healthy`` is False."""

    healthy = True

    def routes(self, app: Any) -> None:
        pass

    async def _health(self, _: Any) -> Any:
        from aiohttp import web

        return web.json_response({}, status=200 if self.healthy else 503)


def batches(n: int, seed: int) -> Iterator[bytes]:
    """``n`` batches of ``BLOCKS_PER_BATCH`` stored blocks with their true sha256 hashes
    (the router's hash verifier checks them), ~5 KB each: a 4.5 MB history, like a few
thousand of a busy engine's steps."""
    rng = random.Random(seed)
    hasher = BlockHasher("sha256", 16, None, "0.33.0")
    for _ in range(n):
        tokens = [rng.randrange(1, 150_000) for _ in range(16 * BLOCKS_PER_BATCH)]
        ev = BlockStored(hasher.hash_blocks(tokens), None, tokens, 16, None, "GPU")
        yield encode_batch(EventBatch(time.time(), [ev], 0), "0.33.0")


def anon_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def test_ejection_and_resync_cycles_leave_router_memory_flat(tmp_path: Path) -> None:
    pub = EnginePublisher(buffer_steps=HISTORY)
    more = batches(HISTORY + CYCLES + 1, seed=17)
    for payload in (next(more) for _ in range(HISTORY)):
        pub.publish(payload, send=False)
    with FlakyEngine() as engine:
        config = {
            "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "max_model_len": 4096,
                        "backends": [{"name": "engine-0", "url": engine.url, "kv_events": pub.endpoint,
                                      "kv_replay": pub.replay_endpoint}]}],
            "router": {"health_interval_s": 0.5},
        }
        router = RouterProc("router", config, tmp_path, log_level="info", tuning={"metrics_scrape_interval_s": 3600})
        client = httpx.Client(timeout=10.0)

        def backend() -> dict[str, Any]:
            return client.get(router.url + "/debug/backends").json()["backends"][0]

        def resynced(replays: int) -> bool:
            b = backend()
            return b["healthy"] and b["replays"] > replays and b["last_seq"] == pub.seq - 1

        try:
            pub.wait_subscribed()
            pub.publish(next(more))
            wait_for(lambda: resynced(0), "the first sync", timeout=30)
            time.sleep(0.5)
            before = anon_mb(router.proc.popen.pid)
            growth, blocks = [], []
            for _ in range(CYCLES):
                replays = backend()["replays"]
                engine.healthy = False
                wait_for(lambda: not backend()["healthy"] and backend()["blocks"] == 0, "ejected and purged", timeout=10)
                engine.healthy = True
                wait_for(lambda: backend()["healthy"], "re-admitted", timeout=10)
                pub.publish(next(more))
                wait_for(lambda: resynced(replays), "re-synchronised from the engine's history", timeout=30)
                time.sleep(0.5)
                growth.append(round(anon_mb(router.proc.popen.pid) - before, 2))
                blocks.append(backend()["blocks"])
            metrics = client.get(router.url + "/metrics").text
        finally:
            client.close()
            router.stop()
            pub.close()
    assert blocks == [HISTORY * BLOCKS_PER_BATCH] * CYCLES, f"a re-sync rebuilt a different index: {blocks}"
    assert max(growth) < GROWTH_BOUND_MB, f"router anonymous memory above its pre-ejection level, per cycle: {growth} MB"
    assert min(growth[-4:]) - min(growth[:4]) < FLOOR_RISE_BOUND_MB, f"growing per ejection: {growth} MB"
    trims = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
             if line.startswith("kvrouter_kv_event_heap_trims_total{")}
    assert sum(trims.values()) >= CYCLES + 1 and trims.get("released", 0) >= 1, trims
