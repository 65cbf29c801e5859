"""Short-request throughput: req/s through kvrouter (1 and 2 workers) and vllm-router, driven by wrk.

Issue 16 asks for 2 workers >= 1.7x one worker and >= 7,000 req/s on this 2-core machine,
with a load generator that outruns the router. A Python client cannot: at ~100 us of CPU
per request it saturates near the router's own rate and would measure itself. ``wrk``
(C, epoll, a Debian package: ``apt-get install wrk``) costs ~10 us per request; its CPU
is measured and printed with every figure so a reader can see it is not the limit.

The engine behind every router is :mod:`benchmarks.instant_engine` (fixed answers on
uvloop + httptools, ~13 us of CPU per request), not ``kvrouter sim``: on 2 shared cores
the engine's CPU is taken from the router, and the simulator costs several times the
router's per request. The request is a short chat completion (``max_tokens`` 1, non-
streamed) from ``--connections`` keep-alive connections, the same body for every target.

Targets, all in front of the same engine in the same run: ``kvrouter 1w`` (``kvrouter
serve --workers 1``, kv_aware, one backend), ``kvrouter 2w`` (``--workers 2``, when this
tree's ``serve`` has it), ``kvrouter 1w 64b`` (one worker, the engine configured as 64
backends: what weighing each backend costs per request, which the capacity model in
docs/scaling.md needs), ``vllm-router rr`` (the Rust router, round_robin; tokio uses both
cores). Rounds are interleaved (every target once per round, the order rotated) and each
figure is the median over ``--repeats`` rounds; ratios are medians of the per-round ratios,
so a slow spell of this shared machine hits both sides of a ratio alike.

Columns: req/s; router CPU in cores (all its processes) and in us per request (the cost
that sets capacity on dedicated cores: ``1e6 / us`` req/s per core); the engine's and
wrk's CPU in cores (2.0 = both cores); ``other``: the machine's busy CPU that none of
them used (other processes: on a shared machine a run with ``other`` near 1 had half the
cores); non-2xx and socket errors, which must be 0.

    flock /tmp/kvr-bench.lock .venv/bin/python benchmarks/bench_throughput.py [--repeats 3] [--seconds 5] [--json OUT]
    make bench-throughput
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from support import KVROUTER, QWEN3_DIR, Proc, free_port, wait_http  # noqa: E402

from benchmarks.instant_engine import MODEL  # noqa: E402
from loadtest.fleet import Engine, tree_cpu  # noqa: E402
from loadtest.peer import INSTALL_HINT, VllmRouter, vllm_router_binary  # noqa: E402

WRK_MISSING = ("wrk is not installed: this bench needs it (a Python client cannot outrun the router). "
               "Install it with `apt-get install wrk` (Debian/Ubuntu) and run again.")
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi, how are you?"}], "max_tokens": 1}

# wrk's Lua hooks: POST the body; at the end print one JSON line the bench parses
# (wrk's own text summary rounds and changes units).
LUA = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests": %%d, "duration_us": %%d, "connect": %%d, "read": %%d, "write": %%d, "status": %%d, "timeout": %%d, "p50_us": %%d, "p99_us": %%d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass
class Sample:
    """One wrk run against one target."""

    target: str
    rps: float
    router_cores: float
    router_us_per_req: float
    engine_cores: float
    wrk_cores: float
    other_cores: float
    """CPU that neither the router, the engine nor wrk used (other processes on a shared machine)."""
    errors: int
    p50_ms: float
    p99_ms: float


def busy_cpu() -> float:
    """The machine's busy CPU seconds so far (every core, every process)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def run_wrk(url: str, script: Path, seconds: float, connections: int, threads: int, pin: str | None) -> tuple[dict[str, Any], float]:
    """One wrk run: its JSON summary and the CPU seconds wrk itself used (from wait4's rusage)."""
    args = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script), url]
    if pin is not None:
        args = ["taskset", "-c", pin, *args]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    out = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    line = next((ln for ln in out.splitlines() if ln.startswith("WRKJSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {out[-2000:]}")
    return json.loads(line[len("WRKJSON "):]), usage.ru_utime + usage.ru_stime


def measure(target: str, port: int, router_pid: int, engine_pid: int, script: Path, args: argparse.Namespace) -> Sample:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    run_wrk(url, script, 1, args.connections, args.threads, args.pin_wrk)  # warm-up: connections, pools, caches
    m0, r0, e0 = busy_cpu(), tree_cpu(router_pid), tree_cpu(engine_pid)
    summary, wrk_cpu = run_wrk(url, script, args.seconds, args.connections, args.threads, args.pin_wrk)
    m1, r1, e1 = busy_cpu(), tree_cpu(router_pid), tree_cpu(engine_pid)
    elapsed = summary["duration_us"] / 1e6
    n = summary["requests"]
    errors = sum(summary[k] for k in ("connect", "read", "write", "status", "timeout"))
    return Sample(target, n / elapsed, (r1 - r0) / elapsed, (r1 - r0) / max(n, 1) * 1e6, (e1 - e0) / elapsed,
                  wrk_cpu / elapsed, max(0.0, (m1 - m0) - (r1 - r0) - (e1 - e0) - wrk_cpu) / elapsed, errors, summary["p50_us"] / 1e3, summary["p99_us"] / 1e3)


def tree_env(tree: Path | None) -> dict[str, str] | None:
    """The environment that runs ``tree``'s router with this venv (None: this checkout)."""
    return None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}


def serve_supports_workers(tree: Path | None = None) -> bool:
    """Whether the tree's ``kvrouter serve`` takes ``--workers`` (the multi-process serve)."""
    out = subprocess.run([*KVROUTER, "serve", "--help"], capture_output=True, text=True, cwd=tree or REPO, timeout=60,
                         env=tree_env(tree)).stdout
    return "--workers" in out


def start_kvrouter(engine_port: int, workers: int, tmp: Path, multi: bool, backends: int = 1,
                   tree: Path | None = None) -> tuple[Proc, int]:
    """``kvrouter serve`` over the instant engine; ``--workers`` always given when ``serve`` has
    it (its default is the number of cores, so one process must be asked for). ``tree``: the
    router of another checkout (``git worktree add DIR COMMIT``), for before and after in one run."""
    cfg = {
        "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256", "hash_seed": "0",
                    "backends": [{"name": f"instant-{i}", "url": f"http://127.0.0.1:{engine_port}"} for i in range(backends)]}],
        "router": {"policy": "kv_aware"},
    }
    tag = f"{workers}w-{backends}b" + ("-before" if tree else "")
    path = tmp / f"kvrouter-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    cmd = [*KVROUTER, "serve", "--config", str(path), "--port", str(port), "--log-level", "warning"]
    if multi:
        cmd += ["--workers", str(workers)]
    proc = Proc(cmd, tmp / f"kvrouter-{tag}.log", env=tree_env(tree), **({"cwd": tree} if tree else {}))
    wait_http(f"http://127.0.0.1:{port}/health", timeout=180, proc=proc.popen)
    return proc, port


def report(samples: list[list[Sample]], args: argparse.Namespace) -> dict[str, Any]:
    targets = [s.target for s in samples[0]]
    by: dict[str, list[Sample]] = {t: [s for rnd in samples for s in rnd if s.target == t] for t in targets}

    def med(t: str, field: str) -> float:
        return statistics.median(getattr(s, field) for s in by[t])

    print(f"\nshort chat requests, wrk -t{args.threads} -c{args.connections}, {args.seconds:g} s per run, "
          f"medians of {len(samples)} interleaved rounds:")
    print(f"{'target':16} {'req/s':>8} {'router cores':>12} {'router us/req':>13} {'req/s/core':>10} "
          f"{'engine cores':>12} {'wrk cores':>9} {'other cores':>11} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}")
    rows = {}
    for t in targets:
        row = {f: med(t, f) for f in ("rps", "router_cores", "router_us_per_req", "engine_cores", "wrk_cores", "other_cores", "p50_ms", "p99_ms")}
        row["errors"] = sum(s.errors for s in by[t])
        row["rps_runs"] = [s.rps for s in by[t]]
        rows[t] = row
        print(f"{t:16} {row['rps']:8.0f} {row['router_cores']:12.2f} {row['router_us_per_req']:13.1f} "
              f"{1e6 / row['router_us_per_req']:10.0f} {row['engine_cores']:12.2f} {row['wrk_cores']:9.2f} {row['other_cores']:11.2f} "
              f"{row['p50_ms']:7.2f} {row['p99_ms']:7.2f} {row['errors']:6d}")
    ratios: dict[str, float] = {}

    def ratio(a: str, b: str) -> None:
        if a in by and b in by:
            per_round = [x.rps / y.rps for rnd in samples for x in rnd for y in rnd if x.target == a and y.target == b]
            ratios[f"{a} / {b}"] = statistics.median(per_round)

    ratio("kvrouter 2w", "kvrouter 1w")
    ratio("before 2w", "before 1w")
    ratio("kvrouter 1w", "before 1w")
    ratio("kvrouter 2w", "before 2w")
    ratio("kvrouter 1w", "vllm-router rr")
    ratio("kvrouter 2w", "vllm-router rr")
    print("\nratios (median of per-round ratios):")
    for k, v in ratios.items():
        print(f"  {k:32} {v:5.2f}x")
    # A shared machine's other jobs take CPU from whichever target runs; the rounds in which
    # they took little from both sides of a ratio show what the router does with the cores.
    quiet: dict[str, list[float]] = {}
    for rnd in samples:
        got = {s.target: s for s in rnd}
        for a, b in (("kvrouter 2w", "kvrouter 1w"), ("before 2w", "before 1w")):
            if a in got and b in got and max(got[a].other_cores, got[b].other_cores) < args.quiet:
                quiet.setdefault(f"{a} / {b}", []).append(got[a].rps / got[b].rps)
    if quiet:
        print(f"  in quiet rounds (other processes < {args.quiet:g} cores on both sides):")
        for k, v in quiet.items():
            print(f"  {k:32} {statistics.median(v):5.2f}x  ({len(v)} of {len(samples)} rounds: "
                  + ", ".join(f"{x:.2f}" for x in v) + ")")
    print("\ngoals (issue 16):")
    if "kvrouter 2w" in rows:
        r = ratios["kvrouter 2w / kvrouter 1w"]
        print(f"  2 workers >= 1.7x one worker: {r:.2f}x -> {'met' if r >= 1.7 else 'NOT met'}")
        best = rows["kvrouter 2w"]["rps"]
        print(f"  >= 7,000 req/s on 2 cores: {best:.0f} req/s (median; best round "
              f"{max(rows['kvrouter 2w']['rps_runs']):.0f}) -> {'met' if best >= 7000 else 'NOT met'}")
    else:
        print("  2-worker cell not measured: this tree's `kvrouter serve` has no --workers yet")
    wrk_max = max(r["wrk_cores"] for r in rows.values())
    print(f"  load generator: wrk used at most {wrk_max:.2f} of a core (of {os.cpu_count()})")
    other = max(r["other_cores"] for r in rows.values())
    if other > 0.2:
        print(f"  note: other processes used up to {other:.2f} cores during these runs (a shared machine): "
              "req/s is then below what the router sustains alone; router us/req is the steadier figure")
    return {"rows": rows, "ratios": ratios, "quiet_ratios": quiet, "rounds": [[asdict(s) for s in rnd] for rnd in samples]}


def engine_only(args: argparse.Namespace, tmp: Path) -> None:
    """The engines alone under wrk: why the bench uses the instant engine, not the simulator
    or a uvicorn app (their req/s and CPU per request on this machine)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    script = tmp / "post.lua"
    script.write_text(LUA % json.dumps(json.dumps(BODY)))
    port = free_port()
    engines = {
        "instant (httptools)": [sys.executable, "-m", "benchmarks.instant_engine", str(port)],
        "uvicorn ASGI": [sys.executable, str(REPO / "benchmarks" / "bench_router_overhead.py"), "--null-engine", str(port + 1)],
        "kvrouter sim": [*KVROUTER, "sim", "--port", str(port + 2), "--kv-events-port", str(free_port()), "--model", MODEL,
                         "--tokenizer", str(QWEN3_DIR), "--hash-seed", "0", "--speedup", "1000"],
    }
    for i, (name, cmd) in enumerate(engines.items()):
        proc = Proc(cmd, tmp / f"engine-{i}.log")
        try:
            wait_http(f"http://127.0.0.1:{port + i}/health", timeout=120, proc=proc.popen)
            s = measure(name, port + i, proc.popen.pid, proc.popen.pid, script, args)
            print(f"  {name:22} {s.rps:8.0f} req/s  {s.router_us_per_req:6.1f} us CPU/request  wrk {s.wrk_cores:.2f} cores  errors {s.errors}")
        finally:
            proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians over them)")
    ap.add_argument("--seconds", type=float, default=5.0, help="wrk duration per run")
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="wrk threads (one outruns the router; see its CPU column)")
    ap.add_argument("--workers", default="1,2", help="kvrouter worker counts to measure (2+ needs serve --workers)")
    ap.add_argument("--many-backends", type=lambda v: [int(x) for x in v.split(",") if x], default=[64],
                    help="also kvrouter 1w configured with this many backends (all the same engine): the per-backend "
                         "cost of a decision (default 64; empty to skip)")
    ap.add_argument("--quiet", type=float, default=0.25,
                    help="also report the 2w/1w ratio over rounds where other processes used less than this many cores")
    ap.add_argument("--pin-wrk", default=None, metavar="CPUS", help="run wrk under `taskset -c CPUS` (e.g. 1)")
    ap.add_argument("--no-peer", action="store_true", help="leave vllm-router out")
    ap.add_argument("--engine-only", action="store_true", help="measure the candidate engines alone and exit")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--before", type=Path, default=None, metavar="TREE",
                    help="also targets 'before 1w' and 'before 2w': the router of this other checkout (e.g. a git "
                         "worktree at an older commit), interleaved with this tree's in every round")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        print(WRK_MISSING, file=sys.stderr)
        sys.exit(2)

    tmp = Path(tempfile.mkdtemp(prefix="bench_throughput_"))
    if args.engine_only:
        engine_only(args, tmp)
        return
    script = tmp / "post.lua"
    script.write_text(LUA % json.dumps(json.dumps(BODY)))
    procs: list[Proc | VllmRouter] = []
    try:
        engine_port = free_port()
        engine = Proc([sys.executable, "-m", "benchmarks.instant_engine", str(engine_port)], tmp / "engine.log")
        procs.append(engine)
        wait_http(f"http://127.0.0.1:{engine_port}/health", timeout=60, proc=engine.popen)
        targets: dict[str, tuple[int, int]] = {}  # name -> (port, pid whose process tree is the router)
        worker_counts = [int(w) for w in args.workers.split(",") if w]
        multi = serve_supports_workers()
        for w in worker_counts:
            if w != 1 and not multi:
                print(f"kvrouter {w}w: skipped, this tree's `kvrouter serve` has no --workers yet")
                continue
            proc, port = start_kvrouter(engine_port, w, tmp, multi)
            procs.append(proc)
            targets[f"kvrouter {w}w"] = (port, proc.popen.pid)
        if args.before is not None:
            multi_before = serve_supports_workers(args.before)
            for w in worker_counts:
                if w == 1 or multi_before:
                    proc, port = start_kvrouter(engine_port, w, tmp, multi_before, tree=args.before)
                    procs.append(proc)
                    targets[f"before {w}w"] = (port, proc.popen.pid)
        for b in (b for b in args.many_backends if b > 1):
            # what each backend a request is weighed against costs: every name is the same engine
            proc, port = start_kvrouter(engine_port, 1, tmp, multi, backends=b)
            procs.append(proc)
            targets[f"kvrouter 1w {b}b"] = (port, proc.popen.pid)
        if args.no_peer:
            pass
        elif vllm_router_binary() is None:
            print(f"vllm-router not installed ({INSTALL_HINT}): peer column skipped")
        else:
            peer = VllmRouter([Engine("instant", f"http://127.0.0.1:{engine_port}", "", "")], "round_robin", tmp, model=MODEL)
            peer.start(timeout_s=60)
            procs.append(peer)
            assert peer.child is not None
            targets["vllm-router rr"] = (peer.port, peer.child.popen.pid)

        names = list(targets)
        rounds: list[list[Sample]] = []
        for r in range(args.repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            rnd = []
            for t in order:
                port, pid = targets[t]
                s = measure(t, port, pid, engine.popen.pid, script, args)
                rnd.append(s)
                print(f"  round {r + 1} {t:16} {s.rps:8.0f} req/s  router {s.router_cores:.2f} cores "
                      f"({s.router_us_per_req:.0f} us/req)  engine {s.engine_cores:.2f}  wrk {s.wrk_cores:.2f}  other {s.other_cores:.2f}  "
                      f"errors {s.errors}",
                      flush=True)
            rounds.append(rnd)
        results = report(rounds, args)
        results["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        results["cpus"] = os.cpu_count()
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    main()
