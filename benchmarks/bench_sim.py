"""Simulator cost: CPU seconds per simulated request with 8 engines, one process vs one process each.

``kvrouter sim --instances 8`` (all engines in one asyncio process, the shipped layout)
is compared in the same run with the naive baseline of 8 ``kvrouter sim`` processes of
one engine each. The same open-loop load (Poisson arrivals, completions with prompt
token ids of 200-2000 tokens, 128 output tokens streamed, spread round-robin) runs
against each for ``--seconds`` seconds per window; the simulator processes' CPU time
(user + system, from /proc) over a window divided by the requests finished in it is
the cost. Timing fidelity is reported too: client wall e2e x speedup / engine-modelled
e2e (1.0 = the engines kept their modelled time). Medians over ``--reps`` windows.

    .venv/bin/python benchmarks/bench_sim.py [--instances 8] [--speedup 8] [--rate 16] [--seconds 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "loadtest" / "data" / "tokenizers" / "qwen3"
TICKS = os.sysconf("SC_CLK_TCK")


def _free_base(n: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65000 and all(_free(p) for p in range(base, base + n)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def _start(instances: int, per_process: int, speedup: float) -> tuple[list[subprocess.Popen], list[str]]:
    base = _free_base(3 * instances)
    procs, urls = [], []
    for p in range(instances // per_process):
        first = base + p * per_process
        args = [sys.executable, "-m", "router.cli", "sim", "--model", "m", "--tokenizer", str(TOKENIZER),
                "--port", str(first), "--kv-events-port", str(first + instances),
                "--replay-port", str(first + 2 * instances), "--instances", str(per_process),
                "--speedup", str(speedup), "--hash-seed", "0"]
        procs.append(subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls += [f"http://127.0.0.1:{first + i}" for i in range(per_process)]
    deadline = time.monotonic() + 120
    for url in urls:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(url)
            time.sleep(0.2)
    return procs, urls


async def _load(urls: list[str], rate: float, seconds: float, seed: int) -> list[float]:
    rng = random.Random(seed)

    async def one(c: httpx.AsyncClient, url: str, ids: list[int]) -> float:
        t0 = time.monotonic()
        body = {"model": "m", "prompt": ids, "max_tokens": 128, "ignore_eos": True, "stream": True}
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            async for _ in r.aiter_raw():
                pass
        return time.monotonic() - t0

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=500)) as c:
        tasks, n = [], 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ids = [rng.randrange(1, 150_000) for _ in range(rng.randrange(200, 2000))]
            tasks.append(asyncio.create_task(one(c, urls[n % len(urls)], ids)))
            n += 1
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def _modelled_e2e(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics").text
        total += sum(float(v) for v in re.findall(r"^vllm:e2e_request_latency_seconds_sum\{[^}]*\} (\S+)$", text, re.M))
    return total


def measure(instances: int, per_process: int, args: argparse.Namespace) -> tuple[float, float]:
    procs, urls = _start(instances, per_process, args.speedup)
    pids = [p.pid for p in procs]
    try:
        costs, fidelity = [], []
        for rep in range(args.reps):
            cpu0, model0 = _cpu_s(pids), _modelled_e2e(urls)
            wall = asyncio.run(_load(urls, args.rate, args.seconds, seed=rep))
            cpu1, model1 = _cpu_s(pids), _modelled_e2e(urls)
            costs.append((cpu1 - cpu0) / len(wall))
            fidelity.append(sum(wall) * args.speedup / (model1 - model0))
        return statistics.median(costs), statistics.median(fidelity)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=8.0)
    ap.add_argument("--rate", type=float, default=16.0, help="requests per wall second, whole fleet")
    ap.add_argument("--seconds", type=float, default=8.0, help="load window per repetition")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    one_cost, one_fid = measure(args.instances, args.instances, args)
    many_cost, many_fid = measure(args.instances, 1, args)
    print(f"{args.instances} engines, speedup {args.speedup}, {args.rate} req/s, 128 output tokens, medians of {args.reps}")
    print(f"  one process      : {one_cost * 1e3:7.2f} ms CPU / request   timing fidelity {one_fid:.3f}")
    print(f"  {args.instances} processes (naive): {many_cost * 1e3:7.2f} ms CPU / request   timing fidelity {many_fid:.3f}")
    print(f"  ratio naive / one process: {many_cost / one_cost:.2f}x")


if __name__ == "__main__":
    main()
