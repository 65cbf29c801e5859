"""Per-request cost of the two async HTTP clients the router could use upstream: httpx vs aiohttp.

The router talks to its engines over one pooled keep-alive client per backend, and every
call's client-side CPU is spent on the router's event loop, which every request in
flight waits for. This measures, against a loopback server answering at once (uvicorn +
httptools in a child process, so its CPU is not counted), for each client:

* ``cpu_us``: the client process's CPU time per request (``time.process_time``), the
  cost that matters on a busy event loop;
* ``wall_us``: wall time per request, one request at a time;
* ``conc_wall_us``: wall time per request with 32 requests in flight.

Each client runs ``--repeats`` rounds of ``--requests`` POSTs of a ~1 kB JSON body, the
two clients taking turns round by round (a slow spell of a shared machine hits both);
the table shows each figure's median over the rounds.

    .venv/bin/python benchmarks/bench_http_clients.py [--requests 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support import free_port, wait_http  # noqa: E402

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 900}], "max_tokens": 1}).encode()
ANSWER = json.dumps({"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "ok"}}]}).encode()


async def null_server(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]})
    await send({"type": "http.response.body", "body": ANSWER})


Post = Callable[[], Awaitable[bytes]]


async def measure(post: Post, n: int) -> dict[str, float]:
    for _ in range(50):  # warm the pool
        await post()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        await post()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    sem = asyncio.Semaphore(32)

    async def one() -> None:
        async with sem:
            await post()

    t1 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return {"cpu_us": cpu / n * 1e6, "wall_us": wall / n * 1e6, "conc_wall_us": (time.perf_counter() - t1) / n * 1e6}


async def with_httpx(url: str, n: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0) as client:
        async def post() -> bytes:
            r = await client.post("/v1/chat/completions", content=BODY, headers={"content-type": "application/json"})
            return r.content

        return await measure(post, n)


async def with_aiohttp(url: str, n: int) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=30.0)
    async with aiohttp.ClientSession(base_url=url, connector=connector, auto_decompress=False,
                                     skip_auto_headers=("Accept-Encoding", "User-Agent")) as session:
        async def post() -> bytes:
            async with session.post("/v1/chat/completions", data=BODY, headers={"content-type": "application/json"}) as r:
                return await r.read()

        return await measure(post, n)


CLIENTS = {"httpx": with_httpx, "aiohttp": with_aiohttp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in CLIENTS}
        for _ in range(args.repeats):
            for name, run in CLIENTS.items():
                rounds[name].append(asyncio.run(run(f"http://127.0.0.1:{port}", args.requests)))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
        print(f"{args.requests} POSTs per round, median of {args.repeats} interleaved rounds (loopback null server, uvloop):")
        print(f"{'client':8} {'cpu us/req':>11} {'wall us/req':>12} {'wall us/req @32':>16}")
        for name, m in med.items():
            print(f"{name:8} {m['cpu_us']:11.0f} {m['wall_us']:12.0f} {m['conc_wall_us']:16.0f}")
        if args.json:
            args.json.write_text(json.dumps({"median": med, "rounds": rounds}, indent=2))
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        import uvicorn

        uvicorn.run(null_server, host="127.0.0.1", port=int(sys.argv[2]), loop="uvloop", http="httptools",
                    access_log=False, log_level="warning")
    else:
        main()
