"""What ``kvrouter serve --workers N`` costs: connection spread and per-request cost.

Two measurements, each a subcommand (run them under ``flock /tmp/kvr-bench.lock``):

``accept``: how evenly the kernel spreads connections over 2 worker processes, with
  ``SO_REUSEPORT`` (each worker listens on its own socket, what router/http/workers.py does)
  and with one listening socket inherited by both (gunicorn's and ``uvicorn --workers``'
  way). Each worker is a uvloop server that answers each request line after ``--work-us``
  of CPU; the client opens ``--connections`` connections, ``--concurrency`` at a time,
  each sending ``--requests`` requests. Prints the busier worker's share of connections
  per round and the median over ``--rounds``.

``path``: the router's event-loop CPU per request (decide + send, as
  bench_request_path.py) for one router alone and for the same router as worker 0 of a
  2-worker fleet-state ring (every ticket change appended as a record, the other
  worker's ring folded before every decision). Interleaved rounds, medians, and the
  ratio shared/alone.

    .venv/bin/python benchmarks/bench_workers.py accept [--rounds 5]
    .venv/bin/python benchmarks/bench_workers.py path [--rounds 5] [--requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import socket
import statistics
import subprocess
import sys
import tempfile
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

    from kvconfig import parse_config
    from router.core import Router
    from router.fleet.ring import Ring

    router = Router(parse_config(CONFIG))
    shm = Path("/dev/shm")
    tmp = tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None)  # where the supervisor puts it
    ring = None
    if shared:
        Ring.create(Path(tmp.name) / "fleet", 2).close()
        ring = Ring.attach(Path(tmp.name) / "fleet", 0)
        router.share(ring, 0, "bench")
    out = await measure(router, texts, n)
    if ring is not None:
        ring.close()
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
    args = ap.parse_args()
    {"accept": accept, "path": path}[args.cmd](args)


if __name__ == "__main__":
    main()
