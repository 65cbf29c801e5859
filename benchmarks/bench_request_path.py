"""The router's own CPU per request, up to the proxy: decide (plan, look up, choose) and act (ticket, commit, owed work).

In process, no network and no engine: each request runs ``RequestPath.decide`` and
``RequestPath.send`` (which builds the proxied response without sending it), and the
event loop thread's CPU time is measured (``time.thread_time``), so other processes on
a shared machine do not count. Background work a request owes is waited for between
requests, outside the timed region. Cases as in bench_router_overhead.py: a warm 10-turn
~8k-token history plus a new ~200-token turn (routed on the history memo), cold 1k and
4k prompts (routed on their first block). Prints each case's median and p90 per round,
and the median over rounds.

    .venv/bin/python benchmarks/bench_request_path.py [--requests 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router_overhead import MODEL, QWEN3_DIR, Texts, cold_bodies, warm_chat, warm_turns  # noqa: E402

from kvconfig import parse_config  # noqa: E402
from router.core import Router  # noqa: E402

CONFIG = {
    "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256", "hash_seed": "0",
                "backends": [{"name": f"b{i}", "url": f"http://127.0.0.1:{9 + i}"} for i in range(2)]}],
    "router": {"policy": "kv_aware"},
}


async def one_round(texts: Texts, n: int) -> dict[str, list[float]]:
    router = Router(parse_config(CONFIG))
    return await measure(router, texts, n)


async def measure(router: Router, texts: Texts, n: int) -> dict[str, list[float]]:
    """CPU microseconds per request of each case, sorted, through ``router``'s path (shut down after)."""
    await router.models.load_tokenizers(router.executor)
    path = router.path

    async def one(body: dict[str, Any]) -> float:
        raw = json.dumps(body).encode()
        c0 = time.thread_time()
        decided = await path.decide(body, len(raw), "chat", {}, act=True)
        response = path.send(decided, "/v1/chat/completions", raw, {}, None, time.perf_counter())
        spent = time.thread_time() - c0
        response._attempts.end(200)  # what the proxy does when the exchange ends: the ticket released, the settle started
        while router.background.queued or router.background.tasks:
            await asyncio.sleep(0.002)
        return spent

    seen, history = warm_chat(texts)
    for _ in range(3):
        await one(seen)
    out = {}
    for case, bodies in (("warm 10-turn 8k+200", warm_turns(texts, history, n)),
                         ("cold 1k", cold_bodies(texts, 1000, n)), ("cold 4k", cold_bodies(texts, 4000, n))):
        out[case] = sorted([await one(b) * 1e6 for b in bodies])
    router.executor.shutdown(wait=False)
    router.background.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40, help="requests per case and round")
    ap.add_argument("--rounds", type=int, default=5, help="fresh routers, one after the other")
    args = ap.parse_args()
    texts = Texts()
    medians: dict[str, list[float]] = {}
    for r in range(args.rounds):
        got = asyncio.run(one_round(texts, args.requests))
        for case, us in got.items():
            medians.setdefault(case, []).append(statistics.median(us))
            print(f"round {r + 1}  {case:22} median {statistics.median(us):7.0f} us  p90 {us[int(0.9 * (len(us) - 1))]:7.0f} us")
    print("\nmedian over rounds (event-loop CPU per request, decide + send):")
    for case, ms in medians.items():
        print(f"  {case:22} {statistics.median(ms):7.0f} us")


if __name__ == "__main__":
    main()
