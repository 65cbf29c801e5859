"""What ``kvrouter serve --workers N`` costs and buys: connection spread, per-request cost, the no-sharing ablation.

Three measurements, each a subcommand (run them under ``flock /tmp/kvr-bench.lock``):

``accept``: how evenly the kernel spreads connections over 2 worker processes, with
  ``SO_REUSEPORT`` (each worker listens on its own socket, what router/workers.py does)
  and with one listening socket inherited by both (gunicorn's and ``uvicorn --workers``'
  way). Each worker is a uvloop server that answers each request line after ``--work-us``
  of CPU; the client opens ``--connections`` connections, ``--concurrency`` at a time,
  each sending ``--requests`` requests. Prints the busier worker's share of connections
  per round and the median over ``--rounds``.

``path``: the router's event-loop CPU per request (decide + send, as
  bench_request_path.py) for one router alone and for the same router as worker 0 of a
  2-worker shared segment (load rows published on every ticket change, load summed over
  workers for every candidate, decisions appended to the ring and the other ring
  replayed). Interleaved rounds, medians, and the ratio shared/alone.

``ablation``: decision quality with and without sharing. A simulated fleet
  (``kvrouter sim``, ``--engines`` engines) behind ``kvrouter serve`` with 1 worker, N
  workers sharing state, and N workers with ``router.share_worker_state: false`` (each
  worker sees only its own requests: 1/N of the load and of the decisions). Three
  bursts, repeated ``--bursts`` times per round with fresh prompts: 8 concurrent
  requests sharing a new 360-token prefix (one process sends them all to one backend),
  16 concurrent requests that extend a prefix cached on one engine by a long distinct
  tail, and 4 per engine of distinct cold ~800-token prompts (one process spreads both
  by load). Prints how many prefix bursts were split and the mean max/mean ratio of
  requests per backend of each burst.

``decisions``: the Redis mechanism that carries decision memory between replicas
  (router/replica_decisions.py), pub/sub (``PUBLISH``, a subscriber connection) against
  a stream (``XADD MAXLEN ~``, a reader blocked in ``XREAD``). A sender process sends
  ``--messages`` messages of ``--records`` records (one decision each: a backend name and
  ``--keys`` stored keys, the shape the router publishes) every ``--gap-ms``; a receiver
  process decodes each and notes when it arrived. Prints the propagation delay (send to
  decoded, p50/p99), redis-server's CPU per message and the memory Redis holds after,
  interleaved rounds, medians.

    .venv/bin/python benchmarks/bench_workers.py accept [--rounds 5]
    .venv/bin/python benchmarks/bench_workers.py path [--rounds 5] [--requests 40]
    .venv/bin/python benchmarks/bench_workers.py ablation [--rounds 5] [--workers 2,4]
    .venv/bin/python benchmarks/bench_workers.py decisions [--rounds 5] [--messages 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]

# -- accept ------------------------------------------------------------------------------

_SERVER = r"""
import asyncio, os, socket, sys, time
import uvloop
worker, work_us, fd, host, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
if fd >= 0:
    sock = socket.socket(fileno=fd)
else:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
reply = f"{worker}\n".encode()
class P(asyncio.Protocol):
    def connection_made(self, t): self.t = t
    def data_received(self, data):
        for _ in range(data.count(b"\n")):
            end = time.thread_time() + work_us / 1e6
            while time.thread_time() < end:
                pass
            self.t.write(reply)
async def main():
    server = await asyncio.get_running_loop().create_server(P, sock=sock)
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


async def _drive(port: int, connections: int, concurrency: int, requests: int) -> collections.Counter[int]:
    got: collections.Counter[int] = collections.Counter()
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            worker = -1
            for _ in range(requests):
                writer.write(b"x\n")
                worker = int(await reader.readline())
            got[worker] += 1
            writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    return got


def accept_round(mode: str, args: argparse.Namespace) -> float:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    fd = -1
    if mode == "shared":
        holder.listen(4096)
        fd = holder.fileno()
        os.set_inheritable(fd, True)
    procs = [subprocess.Popen([sys.executable, "-c", _SERVER, str(w), str(args.work_us), str(fd), "127.0.0.1", str(port)],
                              stdout=subprocess.PIPE, pass_fds=(fd,) if fd >= 0 else ()) for w in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        got = asyncio.run(_drive(port, args.connections, args.concurrency, args.requests))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        holder.close()
    return max(got.values()) / sum(got.values())


def accept(args: argparse.Namespace) -> None:
    shares: dict[str, list[float]] = {"reuseport": [], "shared": []}
    for r in range(args.rounds):
        for mode in shares:
            s = accept_round(mode, args)
            shares[mode].append(s)
            print(f"round {r + 1}  {mode:9}  busier worker's share of connections {s:.3f}", flush=True)
    print(f"\nmedian over {args.rounds} rounds ({args.connections} connections x {args.requests} requests, "
          f"{args.concurrency} at a time, {args.work_us} us CPU per request):")
    for mode, v in shares.items():
        print(f"  {mode:9}  busier worker's share {statistics.median(v):.3f} (min {min(v):.3f}, max {max(v):.3f})")


# -- path --------------------------------------------------------------------------------

async def path_round(texts: Any, n: int, shared: bool) -> dict[str, list[float]]:
    from bench_request_path import CONFIG, measure

    from router.config import parse_config
    from router.core import Router
    from router.shared_state import Segment

    router = Router(parse_config(CONFIG))
    shm = Path("/dev/shm")
    tmp = tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None)  # where the supervisor puts it
    segment = None
    if shared:
        segment = Segment.create(Path(tmp.name) / "shared", 2)
        router.share(segment, 0, "bench")
    out = await measure(router, texts, n)
    if segment is not None:
        segment.close()
    tmp.cleanup()
    return out


def path(args: argparse.Namespace) -> None:
    from bench_router_overhead import Texts

    texts = Texts()
    medians: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for mode in ("alone", "shared"):
            got = asyncio.run(path_round(texts, args.requests, mode == "shared"))
            for case, us in got.items():
                medians.setdefault((mode, case), []).append(statistics.median(us))
                print(f"round {r + 1}  {mode:6} {case:22} median {statistics.median(us):7.0f} us", flush=True)
    print("\nmedian over rounds (event-loop CPU per request, decide + send):")
    for case in ("warm 10-turn 8k+200", "cold 1k", "cold 4k"):
        a, s = statistics.median(medians[("alone", case)]), statistics.median(medians[("shared", case)])
        print(f"  {case:22} alone {a:6.0f} us  shared {s:6.0f} us  ratio {s / a:.3f}  (+{s - a:.0f} us)")


# -- ablation ----------------------------------------------------------------------------

def _free_ports(n: int) -> int:
    from loadtest.fleet import free_port_run

    return free_port_run(n)


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    from loadtest.fleet import wait_http

    wait_http(url, timeout=timeout, proc=proc)


async def _burst(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    import httpx

    async def one(p: str) -> str:
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(url + "/v1/completions", json={"model": "qwen3", "prompt": p, "max_tokens": max_tokens})
            r.raise_for_status()
            return r.headers["x-kvrouter-backend"]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _max_mean(landed: list[str], backends: int) -> float:
    counts = collections.Counter(landed)
    return max(counts.values()) / (len(landed) / backends)


def ablation(args: argparse.Namespace) -> None:
    QWEN3_DIR = REPO / "loadtest" / "data" / "tokenizers" / "qwen3"

    workdir = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    k = args.engines
    base = _free_ports(3 * k)
    sim = subprocess.Popen([sys.executable, "-m", "router.cli", "sim", "--port", str(base), "--model", "qwen3",
                            "--tokenizer", str(QWEN3_DIR), "--kv-events-port", str(base + k), "--replay-port", str(base + 2 * k),
                            "--instances", str(k), "--speedup", str(args.speedup)],
                           stdout=open(workdir / "sim.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO)
    setups = [("1 worker", 1, True)] + [(f"{n} workers, shared", n, True) for n in args.workers] + \
             [(f"{n} workers, not shared", n, False) for n in args.workers]
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for i in range(k):
            _wait(f"http://127.0.0.1:{base + i}/health", sim)
        backends = [{"name": f"sim{i}", "url": f"http://127.0.0.1:{base + i}", "kv_events": f"tcp://127.0.0.1:{base + k + i}",
                     "kv_replay": f"tcp://127.0.0.1:{base + 2 * k + i}"} for i in range(k)]
        rng = random.Random(args.seed)
        for r in range(args.rounds):
            for name, n, share in setups:
                port = _free_ports(1)
                cfg = {"models": [{"name": "qwen3", "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256",
                                   "hash_seed": "0", "backends": backends}],
                       "router": {"port": port, "workers": n, "share_worker_state": share, "health_interval_s": 0.5}}
                path = workdir / f"router-{n}-{share}.yaml"
                path.write_text(json.dumps(cfg))
                router = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
                                          stdout=open(workdir / f"router-{n}-{share}.log", "ab"), stderr=subprocess.STDOUT,
                                          cwd=REPO, env={**os.environ, "KVROUTER_WORKERS": ""})
                url = f"http://127.0.0.1:{port}"
                try:
                    _wait(url + "/health", router)
                    time.sleep(2.0)  # every worker up and following the event streams
                    out = results.setdefault(name, {"prefix": [], "cached": [], "cold": [], "splits": []})
                    for b in range(args.bursts):
                        prefix = f"system {rng.random()} " + "shared context words go here " * 60
                        landed = asyncio.run(_burst(url, [prefix + f" question {q}?" for q in range(8)], 4))
                        out["prefix"].append(_max_mean(landed, k))
                        out["splits"].append(len(set(landed)))
                        cached = f"document {rng.random()} " + "a cached system prompt of moderate length " * 40
                        asyncio.run(_burst(url, [cached + " warm"], 1))
                        time.sleep(0.5)  # the engine's events say where it is
                        tails = [cached + " " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(400)) for _ in range(16)]
                        landed = asyncio.run(_burst(url, tails, 16))
                        out["cached"].append(_max_mean(landed, k))
                        colds = [" ".join(f"c{rng.randrange(10**6)}" for _ in range(400)) for _ in range(4 * k)]
                        landed = asyncio.run(_burst(url, colds, 16))
                        out["cold"].append(_max_mean(landed, k))
                    print(f"round {r + 1}  {name:24} prefix bursts split {sum(s > 1 for s in out['splits'][-args.bursts:])}"
                          f"/{args.bursts}, cached-prefix max/mean {statistics.mean(out['cached'][-args.bursts:]):.2f}, "
                          f"cold max/mean {statistics.mean(out['cold'][-args.bursts:]):.2f}", flush=True)
                finally:
                    router.terminate()
                    router.wait(60)
        print(f"\nover {args.rounds} rounds x {args.bursts} bursts ({k} engines, speedup {args.speedup}); "
              "max/mean: requests on the busiest backend over the mean, averaged over bursts")
        print(f"  {'setup':24} {'8 on a new prefix: split':>25} {'max/mean':>9} {'16 on a cached prefix':>22} {'cold':>6}")
        for name, out in results.items():
            split = sum(s > 1 for s in out["splits"])
            print(f"  {name:24} {split:>16}/{len(out['splits'])} bursts {statistics.mean(out['prefix']):9.2f}"
                  f" {statistics.mean(out['cached']):22.2f} {statistics.mean(out['cold']):6.2f}")
    finally:
        sim.terminate()
        sim.wait(30)


def _receive(url: str, mode: str, key: str, n: int, ready: Any, out: Any) -> None:
    """The receiving replica (a process of its own): decode ``n`` messages, report each delay."""
    import msgspec
    import redis.asyncio as aredis

    decode = msgspec.msgpack.Decoder().decode

    async def run() -> list[float]:
        r = aredis.Redis.from_url(url)
        delays: list[float] = []
        if mode == "pubsub":
            ps = r.pubsub(ignore_subscribe_messages=True)
            await ps.subscribe(key)
            ready.set()
            async for m in ps.listen():
                delays.append(time.time() - decode(m["data"])[1])
                if len(delays) == n:
                    break
            await ps.aclose()
        else:
            last = "$"
            ready.set()
            while len(delays) < n:
                for _, entries in await r.xread({key: last}, block=0, count=256):
                    for entry_id, fields in entries:
                        last = entry_id
                        delays.append(time.time() - decode(fields[b"m"])[1])
        await r.aclose()
        return delays

    out.put(asyncio.run(run()))


def _redis_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decisions(args: argparse.Namespace) -> None:
    import multiprocessing
    import shutil

    import msgspec
    import redis
    import redis.asyncio as aredis

    port = _free_ports(1)
    workdir = Path(tempfile.mkdtemp(prefix="bench-decisions-"))
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                              stdout=open(workdir / "redis.log", "wb"), stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    sync = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            sync.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    rng = random.Random(args.seed)
    encode = msgspec.msgpack.Encoder().encode
    results: dict[str, dict[str, list[float]]] = {}
    ctx = multiprocessing.get_context("spawn")
    try:
        for r in range(args.rounds):
            for mode in ("pubsub", "stream") if r % 2 == 0 else ("stream", "pubsub"):
                key = f"bench:{mode}:{r}"
                ready, out = ctx.Event(), ctx.Queue()
                receiver = ctx.Process(target=_receive, args=(url, mode, key, args.messages, ready, out))
                receiver.start()
                ready.wait(30)
                time.sleep(0.2)
                mem0 = sync.info("memory")["used_memory"]
                cpu0 = _redis_cpu(server.pid)

                async def send() -> None:
                    a = aredis.Redis.from_url(url)
                    for i in range(args.messages):
                        records = [("qwen3", f"engine-{rng.randrange(8)}", [rng.getrandbits(63) for _ in range(args.keys)])
                                   for _ in range(args.records)]
                        payload = encode(["bench/0", time.time(), records])
                        if mode == "pubsub":
                            await a.publish(key, payload)
                        else:
                            await a.xadd(key, {"m": payload}, maxlen=args.maxlen, approximate=True)
                        await asyncio.sleep(args.gap_ms / 1000)
                    await a.aclose()

                asyncio.run(send())
                delays = sorted(out.get(timeout=60))
                receiver.join(10)
                cpu = _redis_cpu(server.pid) - cpu0
                mem = sync.info("memory")["used_memory"] - mem0
                sync.delete(key)
                res = results.setdefault(mode, {"p50": [], "p99": [], "cpu": [], "mem": []})
                res["p50"].append(delays[len(delays) // 2] * 1e3)
                res["p99"].append(delays[int(len(delays) * 0.99)] * 1e3)
                res["cpu"].append(cpu / args.messages * 1e6)
                res["mem"].append(mem / 1024)
                print(f"round {r + 1} {mode:7} p50 {res['p50'][-1]:.3f} ms  p99 {res['p99'][-1]:.3f} ms  "
                      f"redis {res['cpu'][-1]:.1f} µs/message  memory held {res['mem'][-1]:.0f} KiB", flush=True)
        print(f"\nmedians of {args.rounds} rounds; {args.messages} messages of {args.records} records x {args.keys} keys, "
              f"one every {args.gap_ms} ms (stream MAXLEN ~ {args.maxlen})")
        for mode, res in results.items():
            print(f"  {mode:7} delay p50 {statistics.median(res['p50']):.3f} ms, p99 {statistics.median(res['p99']):.3f} ms; "
                  f"redis-server {statistics.median(res['cpu']):.1f} µs per message; "
                  f"memory held after {statistics.median(res['mem']):.0f} KiB")
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accept")
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--connections", type=int, default=400)
    a.add_argument("--concurrency", type=int, default=32)
    a.add_argument("--requests", type=int, default=5)
    a.add_argument("--work-us", type=int, default=200)
    p = sub.add_parser("path")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=40)
    b = sub.add_parser("ablation")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--bursts", type=int, default=4)
    b.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    b.add_argument("--speedup", type=float, default=1.0)
    b.add_argument("--engines", type=int, default=2)
    b.add_argument("--seed", type=int, default=7)
    d = sub.add_parser("decisions")
    d.add_argument("--rounds", type=int, default=5)
    d.add_argument("--messages", type=int, default=2000)
    d.add_argument("--records", type=int, default=2)
    d.add_argument("--keys", type=int, default=8)
    d.add_argument("--gap-ms", type=float, default=2.0)
    d.add_argument("--maxlen", type=int, default=10_000)
    d.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    {"accept": accept, "path": path, "ablation": ablation, "decisions": decisions}[args.cmd](args)


if __name__ == "__main__":
    main()
