"""At scale, simulated: 64 engines publishing KV events into one router and into ``kvrouter indexer`` on Redis.

Issue 16 asks for the costs a capacity model needs, measured with a fleet larger than
this machine could run for real:

* **ingest CPU per 1,000 events/s**: the CPU a process spends following the engines'
  event streams, per 1,000 KV events a second (and per 1,000 blocks a second), for the
  router on its in-memory index and for ``kvrouter indexer`` writing Redis (plus the
  redis-server's own CPU for those writes);
* **Redis ops per routed request**: ``INFO commandstats`` before and after requests routed
  by a router on the Redis index, split into the router's own commands and the indexer's
  writes the requests caused; and the background ops a second an idle fleet costs
  (shared-load publication, health);
* **memory per million indexed blocks**: the in-memory index (tracemalloc growth) and
  Redis (``used_memory`` growth) after ingesting 1,000,000 (block, engine) entries over
  64 engines (every engine holds a 1,024-block shared prefix; the rest are its own).

The fleet: ``--engines`` simulated engines (default 64) run as ``kvrouter sim --instances
K`` processes (``--per-process``, default 16) at a low ``--speedup`` with a small KV cache
(``--num-blocks``), so prefills store blocks and evictions remove them at a steady rate.
A load driver in this process sends ``/v1/completions`` with fresh token-id prompts
(``--prompt-tokens``, no tokenization anywhere) straight to the engines, round-robin,
from ``--concurrency`` closed loops: the router and the indexer then do nothing but
ingest, and their CPU over the run minus their CPU over an idle spell of the same length
is the ingest cost. Every process's CPU is read from /proc (psutil, the process and its
children), so the driver's and the simulators' own CPU is not counted.

Ports are picked with the OS (runs of consecutive ones for the sim processes). Run it alone:

    flock /tmp/kvr-bench.lock .venv/bin/python benchmarks/bench_scale.py [--json OUT]     # ~3 min
    make bench-scale
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import redis
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
from bench_index import batches, fleet, ingest, python_bytes, start_redis  # noqa: E402
from loadtest.fleet import tree_cpu  # noqa: E402
from loadtest.fleet import FleetError  # noqa: E402
from support import KVROUTER, QWEN3_DIR, Proc, free_port, free_ports as free_port_run, wait_http  # noqa: E402

from indexer.events import BlockStored  # noqa: E402
from indexer.index import MemoryIndex  # noqa: E402
from indexer.redis_index import RedisIndex  # noqa: E402

MODEL = "qwen3-0.6b"
def start_sims(args: argparse.Namespace, tmp: Path) -> tuple[list[Proc], list[int], list[int], list[int]]:
    """``kvrouter sim --instances K`` processes for ``args.engines`` engines: the processes and
    every engine's HTTP, event and replay port. Each process takes three runs of consecutive
    ports picked with the OS; one that loses a port race (another process bound one of them
    first) is started again on fresh ones."""
    procs: list[Proc] = []
    http: list[int] = []
    events: list[int] = []
    replay: list[int] = []
    for start in range(0, args.engines, args.per_process):
        k = min(args.per_process, args.engines - start)
        for attempt in range(5):
            ports = [free_port_run(k) for _ in range(3)]
            proc = Proc(KVROUTER + [
                "sim", "--instances", str(k), "--port", str(ports[0]), "--kv-events-port", str(ports[1]),
                "--replay-port", str(ports[2]), "--model", MODEL, "--tokenizer", str(QWEN3_DIR), "--hash-seed", "0",
                "--speedup", str(args.speedup), "--num-blocks", str(args.num_blocks), "--max-model-len", "8192",
                "--seed", str(start)], tmp / f"sim-{start}-{attempt}.log")
            try:
                for i in range(k):
                    wait_http(f"http://127.0.0.1:{ports[0] + i}/health", timeout=240, proc=proc.popen)
            except FleetError:
                proc.stop()
                if "Address already in use" not in proc.log() or attempt == 4:
                    raise
                continue
            procs.append(proc)
            for run, out in zip(ports, (http, events, replay)):
                out.extend(range(run, run + k))
            break
    return procs, http, events, replay


def fleet_config(engines: int, index: str, http: list[int], events: list[int], replay: list[int]) -> dict[str, Any]:
    return {
        "models": [{
            "name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256", "hash_seed": "0",
            "backends": [{"name": f"e{i}", "url": f"http://127.0.0.1:{http[i]}",
                          "kv_events": f"tcp://127.0.0.1:{events[i]}", "kv_replay": f"tcp://127.0.0.1:{replay[i]}"}
                         for i in range(engines)],
        }],
        "router": {"policy": "kv_aware"},
        "index": index,
    }


def stream_totals(url: str, path: str) -> dict[str, int]:
    """Events, blocks and batches applied, summed over every stream (router /debug/backends
    or indexer /debug/streams), and how many streams are connected."""
    data = httpx.get(url + path, timeout=30).json()
    streams: list[dict[str, Any]] = []
    if isinstance(data, list):  # the indexer: one entry per stream
        streams = data
    else:
        for b in data["backends"]:
            streams.extend(b.get("event_streams", []))
    out = {"events": 0, "blocks": 0, "batches": 0, "connected": 0}
    for s in streams:
        for k in ("events", "blocks", "batches"):
            out[k] += int(s.get(k) or 0)
        out["connected"] += bool(s.get("connected"))
    return out


def events_by_type(url: str) -> dict[str, float]:
    """``kvrouter_kv_events_total`` summed per event type (router or indexer /metrics)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("kvrouter_kv_events_total{"):
            kind = line.split('type="', 1)[1].split('"', 1)[0]
            out[kind] = out.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def redis_calls(r: redis.Redis) -> dict[str, int]:
    """Calls per command from INFO commandstats, without the INFO calls themselves."""
    stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info"}


class Monitor:
    """Every command Redis executes, counted by who sent it (``MONITOR``): a client connection's
    local port, or ``lua`` for the commands a script runs inside Redis. INFO commandstats
    counts both alike; a round trip is a client's command, which is what a client pays for
    and what a Redis shard's network loop serves."""

    def __init__(self, url: str) -> None:
        import threading

        self.counts: dict[str, int] = {}
        self.by_command: dict[str, dict[str, int]] = {}
        self.on = False
        self._r = redis.Redis.from_url(url)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._listen()
        except (redis.RedisError, OSError):
            pass  # the server went away at the end of the run

    def _listen(self) -> None:
        with self._r.monitor() as m:
            for cmd in m.listen():
                if not self.on:
                    continue
                who = "lua" if cmd.get("client_type") == "lua" else str(cmd.get("client_port"))
                self.counts[who] = self.counts.get(who, 0) + 1
                name = str(cmd.get("command", "")).split(" ", 1)[0].lower()
                per = self.by_command.setdefault(who, {})
                per[name] = per.get(name, 0) + 1


def redis_ports(pid: int, redis_port: int) -> set[str]:
    """Local ports of a process's (and its children's) connections to Redis."""
    out: set[str] = set()
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            for c in p.net_connections(kind="tcp"):
                if c.raddr and c.raddr.port == redis_port:
                    out.add(str(c.laddr.port))
        except psutil.NoSuchProcess:
            pass
    return out


def diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) - a.get(k, 0)}


async def drive(urls: list[str], seconds: float | None, count: int | None, concurrency: int, prompt_tokens: int,
                seed: int) -> tuple[int, int, float]:
    """Closed loops sending fresh token-id completions round-robin over ``urls`` for ``seconds``
    or ``count`` requests: (answered 200, failed, elapsed seconds)."""
    rng = random.Random(seed)
    sent = ok = failed = 0
    stop = time.monotonic() + seconds if seconds is not None else float("inf")
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    headers = {"content-type": "application/json"}

    async def loop(http: aiohttp.ClientSession) -> None:
        nonlocal sent, ok, failed
        while time.monotonic() < stop and (count is None or sent < count):
            i = sent
            sent += 1
            body = json.dumps({"model": MODEL, "prompt": [rng.randrange(1000, 150000) for _ in range(prompt_tokens)],
                               "max_tokens": 1}).encode()
            try:
                async with http.post(urls[i % len(urls)] + "/v1/completions", data=body, headers=headers) as r:
                    await r.read()
                    ok += r.status == 200
                    failed += r.status != 200
            except aiohttp.ClientError:
                failed += 1

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(loop(http) for _ in range(concurrency)))
    return ok, failed, time.monotonic() - t0


def wait_streams(url: str, path: str, want: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stream_totals(url, path)["connected"] >= want:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}{path}: fewer than {want} event streams connected after {timeout:.0f} s")


def memory_per_million(url: str, engines: int, entries: int) -> dict[str, float]:
    """Bytes per million (block, engine) entries: MemoryIndex (tracemalloc) and Redis (used_memory)."""
    _, plan = fleet(engines, entries // engines, seed=16)
    n = sum(len(e) for events in plan.values() for e in events)
    used, own = python_bytes(MemoryIndex, plan)
    server = redis.Redis.from_url(url)
    gc.collect()
    before = int(server.info("memory")["used_memory"])
    index = RedisIndex(url, namespace="scale-mem")
    t0 = time.perf_counter()
    ingest(index, batches(plan, BlockStored))
    redis_ingest_s = time.perf_counter() - t0
    after = int(server.info("memory")["used_memory"])
    return {"entries": n, "memory_index_bytes_per_million": used / n * 1e6, "memory_index_own_estimate_per_million": own / n * 1e6,
            "redis_bytes_per_million": (after - before) / n * 1e6, "redis_ingest_blocks_per_s": n / redis_ingest_s}


FLEETS = ((8, 500), (8, 5000), (50, 500), (50, 5000), (50, 20000), (200, 5000), (200, 20000))
"""(engines, requests/s) rows of the capacity table in docs/scaling.md."""


def capacity(scale: dict[str, Any], throughput: dict[str, Any], *, util: float = 0.7, host_cores: int = 16,
             blocks_per_engine: int = 32768, redis_util: float = 0.5,
             events_per_request: float | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Workers, replicas, indexers and Redis a fleet needs, from the measured costs
    (docs/scaling.md, "Capacity model"): the costs used, and one row per :data:`FLEETS` entry.

    ``util``: the share of a core a worker (or an indexer) may use, headroom for bursts;
    ``host_cores``: workers per replica host; ``blocks_per_engine``: KV blocks an engine
    holds (~32k of 16 tokens for an 8B model on an 80 GB GPU); ``redis_util``: the share of
    its one core a Redis may use. A decision weighs every backend of the model, so the
    router's CPU per request is ``base + E x per_backend`` (bench_throughput: 2 workers, and
    1 worker at 1 and 64 backends). Ingest (events per request, CPU per 1,000 events/s, the
    idle cost of following an engine) and Redis (its CPU per lookup and per event written,
    memory per block) come from bench_scale. ``events_per_request`` replaces the measured
    figure (fresh 512-token prompts on full caches: every block new, so one BlockStored and
    ~27 BlockRemoved per request, the worst case) with a workload's own."""
    rows = throughput["rows"]
    base = (rows.get("kvrouter 2w") or rows["kvrouter 1w"])["router_us_per_req"]
    many = next((k for k in rows if k.startswith("kvrouter 1w ") and k.endswith("b")), None)
    per_backend = ((rows[many]["router_us_per_req"] - rows["kvrouter 1w"]["router_us_per_req"]) / (int(many.split()[-1][:-1]) - 1)
                   if many else 0.0)
    ing = scale["ingest"]
    engines_measured = scale["config"]["engines"]
    per = ing["per_process"]
    routed = scale["routed_cpu"]
    c = {
        "router_us_per_request": base, "router_us_per_backend": per_backend,
        "events_per_request": ing["router_events"]["events"] / max(ing["requests"], 1),
        "router_ingest_cores_per_1k_events": per["router (memory index)"]["cores_per_1k_events_per_s"],
        "router_idle_cores_per_engine": scale["idle"]["cores"]["router (memory index)"] / engines_measured,
        "indexer_cores_per_1k_events": per["indexer (Redis)"]["cores_per_1k_events_per_s"],
        "indexer_idle_cores_per_engine": scale["idle"]["cores"]["indexer (Redis)"] / engines_measured,
        "redis_us_per_event": per["redis-server"]["cores_per_1k_events_per_s"] * 1e3,
        "redis_router_extra_us_per_request": max(0.0, routed["cpu_us_per_request"]["router (Redis index)"]
                                                 - routed["memory_router_cpu_us_per_request"]),
        "memory_index_bytes_per_block": scale["memory"]["memory_index_bytes_per_million"] / 1e6,
        "redis_bytes_per_block": scale["memory"]["redis_bytes_per_million"] / 1e6,
    }
    ev_req = c["events_per_request"]
    # Redis' CPU per routed request = its lookup + the writes of the events the request causes
    c["redis_lookup_us_per_request"] = max(0.0, routed["cpu_us_per_request"]["redis-server"] - ev_req * c["redis_us_per_event"])
    if events_per_request is not None:
        ev_req = c["events_per_request"] = events_per_request
    out = []
    for engines, rps in FLEETS:
        req_us = base + engines * per_backend
        kev = rps * ev_req / 1000
        blocks = engines * blocks_per_engine
        row: dict[str, Any] = {"engines": engines, "rps": rps, "router_us_per_request": req_us, "events_per_s": kev * 1000}
        # memory index: every worker follows every stream, so ingest is paid once per worker
        room = util - (kev * c["router_ingest_cores_per_1k_events"] + engines * c["router_idle_cores_per_engine"])
        row["mem_workers"] = math.ceil(rps * req_us / 1e6 / room) if room > 0.1 else None
        row["mem_index_mib_per_worker"] = blocks * c["memory_index_bytes_per_block"] / 2**20
        # Redis index: the indexer ingests once; workers read Redis
        row["redis_workers"] = math.ceil(rps * (req_us + c["redis_router_extra_us_per_request"]) / 1e6 / util)
        row["replicas"] = math.ceil(row["redis_workers"] / host_cores)
        indexer_cores = kev * c["indexer_cores_per_1k_events"] + engines * c["indexer_idle_cores_per_engine"]
        row["indexers"] = math.ceil(indexer_cores / util)
        row["redis_cores"] = rps * (c["redis_lookup_us_per_request"] + ev_req * c["redis_us_per_event"]) / 1e6
        row["redis_shards"] = math.ceil(row["redis_cores"] / redis_util)
        row["redis_gib"] = blocks * c["redis_bytes_per_block"] / 2**30
        out.append(row)
    return c, out


def print_capacity(costs: dict[str, float], rows: list[dict[str, Any]]) -> None:
    print("costs: " + ", ".join(f"{k} {v:.4g}" for k, v in costs.items()))
    print(f"{'engines':>7} {'req/s':>6} {'us/req':>6} {'events/s':>9} | {'mem-index workers':>17} {'MiB/worker':>10} | "
          f"{'Redis-index workers':>19} {'replicas':>8} {'indexers':>8} {'Redis cores':>11} {'shards':>6} {'Redis GiB':>9}")
    for r in rows:
        mw = "-" if r["mem_workers"] is None else f"{r['mem_workers']}"
        print(f"{r['engines']:7d} {r['rps']:6d} {r['router_us_per_request']:6.0f} {r['events_per_s']:9.0f} | {mw:>17} "
              f"{r['mem_index_mib_per_worker']:10.0f} | {r['redis_workers']:19d} {r['replicas']:8d} {r['indexers']:8d} "
              f"{r['redis_cores']:11.2f} {r['redis_shards']:6d} {r['redis_gib']:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--per-process", type=int, default=16, help="engines per `kvrouter sim --instances` process")
    ap.add_argument("--speedup", type=float, default=2.0, help="the engines' --speedup (low: engine time close to real)")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per engine (small: evictions start soon)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the idle and the event-load spells")
    ap.add_argument("--routed", type=int, default=1500, help="requests routed through the Redis-index router")
    ap.add_argument("--memory-entries", type=int, default=1_000_000, help="(block, engine) entries for the memory figures")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the timed phases (medians)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--events-per-request", type=float, default=None,
                    help="with --capacity: a workload's KV events per request instead of the measured worst case")
    ap.add_argument("--capacity", nargs=2, type=Path, metavar=("THROUGHPUT_JSON", "SCALE_JSON"), default=None,
                    help="print the capacity table from bench_throughput's and this bench's --json files, and exit")
    args = ap.parse_args()
    if args.capacity is not None:
        tp, sc = (json.loads(p.read_text()) for p in args.capacity)
        print_capacity(*capacity(sc, tp, events_per_request=args.events_per_request))
        return

    tmp = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    procs: list[Proc] = []
    redis_proc = None
    results: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    try:
        ROUTER_MEM, INDEXER, ROUTER_REDIS = (free_port() for _ in range(3))
        redis_proc, redis_url = start_redis()
        rserver = redis.Redis.from_url(redis_url)
        sims, http, events, replay = start_sims(args, tmp)
        procs += sims
        engine_urls = [f"http://127.0.0.1:{p}" for p in http]
        (tmp / "mem.yaml").write_text(yaml.safe_dump(fleet_config(args.engines, "memory", http, events, replay)))
        (tmp / "redis.yaml").write_text(yaml.safe_dump(fleet_config(args.engines, redis_url, http, events, replay)))
        router_mem = Proc(KVROUTER + ["serve", "--config", str(tmp / "mem.yaml"), "--port", str(ROUTER_MEM), "--workers", "1",
                                      "--log-level", "warning"], tmp / "router-mem.log")
        indexer = Proc(KVROUTER + ["indexer", "--config", str(tmp / "redis.yaml"), "--port", str(INDEXER), "--log-level", "warning"],
                       tmp / "indexer.log")
        router_redis = Proc(KVROUTER + ["serve", "--config", str(tmp / "redis.yaml"), "--port", str(ROUTER_REDIS), "--workers", "1",
                                        "--log-level", "warning"], tmp / "router-redis.log")
        procs += [router_mem, indexer, router_redis]
        mem_url, idx_url, red_url = (f"http://127.0.0.1:{p}" for p in (ROUTER_MEM, INDEXER, ROUTER_REDIS))
        wait_http(mem_url + "/health", timeout=240, proc=router_mem.popen)
        wait_http(idx_url + "/health", timeout=240, proc=indexer.popen)
        wait_http(red_url + "/health", timeout=240, proc=router_redis.popen)
        wait_streams(mem_url, "/debug/backends", args.engines)
        wait_streams(idx_url, "/debug/streams", args.engines)
        measured = {"router (memory index)": router_mem.popen.pid, "indexer (Redis)": indexer.popen.pid,
                    "redis-server": redis_proc.pid, "router (Redis index)": router_redis.popen.pid}
        print(f"{args.engines} engines in {len(sims)} sim processes, router + indexer + Redis ready", flush=True)

        def snapshot() -> dict[str, Any]:
            return {"t": time.monotonic(), "cpu": {n: tree_cpu(p) for n, p in measured.items()},
                    "mem": stream_totals(mem_url, "/debug/backends"), "idx": stream_totals(idx_url, "/debug/streams"),
                    "types": events_by_type(mem_url),
                    "redis": redis_calls(rserver)}

        # 1. idle: what following 64 quiet streams, health checks and load scrapes cost
        a = snapshot()
        time.sleep(args.seconds)
        b = snapshot()
        idle_s = b["t"] - a["t"]
        idle_cores = {n: (b["cpu"][n] - a["cpu"][n]) / idle_s for n in measured}
        idle_ops = diff(a["redis"], b["redis"])
        results["idle"] = {"seconds": idle_s, "cores": idle_cores, "redis_ops_per_s": sum(idle_ops.values()) / idle_s,
                           "redis_ops": idle_ops}
        print(f"idle {idle_s:.0f} s: " + ", ".join(f"{n} {c:.3f} cores" for n, c in idle_cores.items())
              + f"; Redis {sum(idle_ops.values()) / idle_s:.1f} ops/s {idle_ops}", flush=True)

        # 2. event load, requests straight to the engines: the routers only ingest (medians of
        # --repeats rounds; each round's figures are kept in the JSON)
        def ingest_round(seed: int) -> dict[str, Any]:
            c = snapshot()
            ok, failed, elapsed = asyncio.run(drive(engine_urls, args.seconds, None, args.concurrency, args.prompt_tokens, seed=seed))
            time.sleep(1.0)  # the last events reach the subscribers
            d = snapshot()
            span = d["t"] - c["t"]
            ev = {k: {f: d[k][f] - c[k][f] for f in ("events", "batches")} for k in ("mem", "idx")}
            # Every prompt is fresh token ids, so each of its full blocks is stored once (and, the
            # caches being full, about as many are evicted): blocks stored = requests x full blocks.
            for k in ev:
                ev[k]["blocks"] = ok * (args.prompt_tokens // 16)
            mix = {t: d["types"].get(t, 0.0) - c["types"].get(t, 0.0) for t in d["types"]}
            load_ops = diff(c["redis"], d["redis"])
            out: dict[str, Any] = {"requests": ok, "failed": failed, "seconds": span, "requests_per_s": ok / elapsed,
                                   "router_events": ev["mem"], "indexer_events": ev["idx"], "event_mix": mix, "redis_ops": load_ops}
            print(f"event load: {ok} requests ({failed} failed) in {elapsed:.1f} s = {ok / elapsed:.0f} req/s; router applied "
                  f"{ev['mem']['events']} events ({ev['mem']['events'] / span:.0f}/s: {mix}) in {ev['mem']['batches']} batches, "
                  f"{ev['mem']['blocks']} blocks stored ({ev['mem']['blocks'] / span:.0f}/s); indexer {ev['idx']['events']} events", flush=True)
            per: dict[str, dict[str, float]] = {}
            for name, key in (("router (memory index)", "mem"), ("indexer (Redis)", "idx"), ("redis-server", "idx")):
                busy = d["cpu"][name] - c["cpu"][name] - idle_cores[name] * span
                events, blocks = ev[key]["events"], ev[key]["blocks"]
                per[name] = {"cpu_s": busy, "cores_per_1k_events_per_s": busy / events * 1e3 if events else float("nan"),
                             "cores_per_1k_blocks_per_s": busy / blocks * 1e3 if blocks else float("nan")}
            out["per_process"] = per
            out["redis_ops_per_event"] = sum(load_ops.values()) / max(ev["idx"]["events"], 1)
            out["redis_ops_per_batch"] = sum(load_ops.values()) / max(ev["idx"]["batches"], 1)
            return out

        rounds = [ingest_round(seed=1 + r) for r in range(args.repeats)]
        ingest = dict(sorted(rounds, key=lambda x: x["per_process"]["router (memory index)"]["cores_per_1k_events_per_s"])[len(rounds) // 2])
        ingest["per_process"] = {n: {f: statistics.median(r["per_process"][n][f] for r in rounds) for f in rounds[0]["per_process"][n]}
                                 for n in rounds[0]["per_process"]}
        ingest["rounds"] = rounds
        results["ingest"] = ingest
        ok = ingest["requests"]
        print(f"\ningest CPU (cores busy at 1,000 events/s; = CPU seconds per 1,000 events), idle subtracted, median of {len(rounds)}:")
        for name, v in ingest["per_process"].items():
            print(f"  {name:24} {v['cores_per_1k_events_per_s']:.4f} cores per 1k events/s   "
                  f"{v['cores_per_1k_blocks_per_s']:.4f} cores per 1k blocks stored/s   (rounds: "
                  + ", ".join(f"{r['per_process'][name]['cores_per_1k_events_per_s']:.4f}" for r in rounds) + ")")
        print(f"  events per engine request: {ingest['router_events']['events'] / max(ok, 1):.2f} (each request stores {args.prompt_tokens // 16} blocks)")
        print(f"  Redis writes: {ingest['redis_ops_per_event']:.2f} ops per event, {ingest['redis_ops_per_batch']:.2f} per batch")

        # 3a. routed through the Redis-index router and through the memory-index router, taking
        # turns (--repeats rounds, medians): CPU per routed request of each router, of the
        # indexer (the events those requests caused) and of redis-server
        def routed_round(url: str, names: tuple[str, ...], seed: int) -> tuple[dict[str, float], int, int, float, float]:
            e0 = snapshot()
            n_ok, n_failed, el = asyncio.run(drive([url], None, args.routed, min(args.concurrency, 16), args.prompt_tokens, seed=seed))
            time.sleep(1.0)
            f0 = snapshot()
            span_c = f0["t"] - e0["t"]
            cost = {n: (f0["cpu"][n] - e0["cpu"][n] - idle_cores[n] * span_c) / max(n_ok, 1) * 1e6 for n in names}
            commands = sum(diff(e0["redis"], f0["redis"]).values()) / max(n_ok, 1)
            return cost, n_ok, n_failed, el, commands

        redis_names = ("router (Redis index)", "indexer (Redis)", "redis-server")
        via_redis, via_mem = [], []
        for r in range(args.repeats):
            via_redis.append(routed_round(red_url, redis_names, seed=100 + r))
            via_mem.append(routed_round(mem_url, ("router (memory index)",), seed=200 + r))
        cost = {n: statistics.median(x[0][n] for x in via_redis) for n in redis_names}
        mem_us = statistics.median(x[0]["router (memory index)"] for x in via_mem)
        ok_c = sum(x[1] for x in via_redis)
        failed_c = sum(x[2] for x in via_redis) + sum(x[2] for x in via_mem)
        rps_c = statistics.median(x[1] / x[3] for x in via_redis)
        commands_c = statistics.median(x[4] for x in via_redis)
        results["routed_cpu"] = {"requests": ok_c, "failed": failed_c, "requests_per_s": rps_c, "cpu_us_per_request": cost,
                                 "commandstats_per_request": commands_c, "memory_router_cpu_us_per_request": mem_us,
                                 "rounds": {"redis": [x[0] for x in via_redis], "memory": [x[0] for x in via_mem]}}
        print(f"\nrouted, {args.repeats} rounds of {args.routed} requests through each router, taking turns ({failed_c} failed), "
              f"medians: CPU per routed request: " + ", ".join(f"{n} {v:.0f} us" for n, v in cost.items())
              + f"; {commands_c:.0f} Redis commands (scripts' included) per request")
        print(f"  the same through the memory-index router: router CPU {mem_us:.0f} us per request (ingest of its events included)")

        # 3b. the same again with MONITOR on: round trips per routed request, by sender
        redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        monitor = Monitor(redis_url)
        time.sleep(0.5)
        e = snapshot()
        monitor.on = True
        ok_r, failed_r, el_r = asyncio.run(drive([red_url], None, args.routed, min(args.concurrency, 16), args.prompt_tokens, seed=2))
        time.sleep(1.0)
        monitor.on = False
        f = snapshot()
        owners = {"router": redis_ports(router_redis.popen.pid, redis_port), "indexer": redis_ports(indexer.popen.pid, redis_port)}
        sent: dict[str, int] = {"router": 0, "indexer": 0, "inside scripts": 0, "other": 0}
        commands: dict[str, dict[str, int]] = {k: {} for k in sent}
        for who, n in monitor.counts.items():
            key = ("inside scripts" if who == "lua" else next((k for k, ports in owners.items() if who in ports), "other"))
            sent[key] += n
            for c, m in monitor.by_command.get(who, {}).items():
                commands[key][c] = commands[key].get(c, 0) + m
        batches_r = f["idx"]["batches"] - e["idx"]["batches"]
        r = {"requests": ok_r, "failed": failed_r, "seconds": el_r, "by_sender": sent, "commands": commands,
             "indexer_batches": batches_r,
             "round_trips_per_request_router": sent["router"] / max(ok_r, 1),
             "round_trips_per_request_indexer": sent["indexer"] / max(ok_r, 1),
             "script_commands_per_request": sent["inside scripts"] / max(ok_r, 1),
             "commandstats": diff(e["redis"], f["redis"])}
        results["routed"] = r
        print(f"  again with MONITOR on: {ok_r} requests ({failed_r} failed) in {el_r:.1f} s")
        print(f"  Redis round trips per routed request: router {r['round_trips_per_request_router']:.2f} {commands['router']}")
        print(f"  + the indexer's, for the events those requests caused: {r['round_trips_per_request_indexer']:.2f} per request "
              f"({sent['indexer'] / max(batches_r, 1):.2f} per event batch) {commands['indexer']}")
        print(f"  commands run inside scripts: {r['script_commands_per_request']:.1f} per request; unattributed {sent['other']}")

        # 4. memory per million indexed (block, engine) entries
        mem = memory_per_million(redis_url, args.engines, args.memory_entries)
        results["memory"] = mem
        print(f"\nmemory per million indexed (block, engine) entries over {args.engines} engines ({mem['entries']} ingested):")
        print(f"  memory index {mem['memory_index_bytes_per_million'] / 2**20:.1f} MiB (its own estimate "
              f"{mem['memory_index_own_estimate_per_million'] / 2**20:.1f} MiB); Redis {mem['redis_bytes_per_million'] / 2**20:.1f} MiB "
              f"(ingest {mem['redis_ingest_blocks_per_s']:.0f} blocks/s from one client)")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        for p in reversed(procs):
            p.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)


if __name__ == "__main__":
    main()
