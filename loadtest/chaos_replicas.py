"""``kvrouter chaos --replicas``: one router vs three on one Redis index (issue 17 §5).

The same workload (a fixed list of ``mixed`` sessions) runs three times on a fresh fleet
each: one router on the in-memory index (the reference), one router on a Redis index fed
by ``kvrouter indexer``, and three routers on that Redis index with the sessions spread
round-robin over them. Each run reports the engines' cached ratio (``cached_tokens`` over
``prompt_tokens`` in the answers), TTFT p90 in engine seconds, and max/mean of the
requests each engine served.

Three replicas share the index but not their load counts: each router sees only the
requests it sent itself. ``queue_max_mean`` measures what that costs: every 0.5 s the
engines' own queues (``vllm:num_requests_running`` + ``waiting``) are scraped, and the
mean over samples of the busiest engine's queue over the fleet's mean says how evenly
the work was spread at each moment (request counts over a whole run hide bursts).
Shared load is issue 16's job; this only says how much of any loss it explains.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.chaos import ChaosOptions, environment, rate_scale_for
from loadtest.chaos_traffic import Record, Traffic, chaos_spec
from loadtest.fleet import scrape
from loadtest.replay import percentiles
from loadtest.workloads import mixed

SETUPS = (("1 router, memory index", 1, False), ("1 router, Redis index", 1, True), ("3 routers, Redis index", 3, True))


@dataclass(slots=True)
class ReplicaOptions:
    out: Path
    speedup: float = 1.0
    target_load: float = 0.7
    rate_scale: float | None = None
    max_requests: int = 600
    repeats: int = 3
    """Rounds of the three setups, interleaved (one machine's noise hits all three alike);
    each figure is the median over rounds."""
    seed: int = 0
    quiet: bool = False


def _engine_queues(urls: list[str], stop: threading.Event, rows: list[dict[str, float]], interval_s: float = 0.5) -> None:
    while not stop.wait(interval_s):
        row = {}
        for u in urls:
            try:
                m = scrape(u + "/metrics", timeout_s=2.0)
            except (httpx.HTTPError, ValueError):
                continue
            row[u] = m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)
        if row:
            rows.append(row)


def summarize_run(name: str, records: list[Record], speedup: float, queues: list[dict[str, float]]) -> dict[str, Any]:
    ok = [r for r in records if r.outcome == "ok"]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_backend: dict[str, int] = {}
    for r in ok:
        per_backend[r.backend] = per_backend.get(r.backend, 0) + 1
    counts = list(per_backend.values())
    imbalance = [max(q.values()) / (sum(q.values()) / len(q)) for q in queues if q and sum(q.values()) > 0]
    return {
        "setup": name,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "cached_ratio": cached / prompt if prompt else 0.0,
        "ttft_s": percentiles([r.ttft_s * speedup for r in ok if r.ttft_s is not None]),
        "e2e_s": percentiles([(r.done_t - r.sent_t) * speedup for r in ok]),
        "backend_requests": dict(sorted(per_backend.items())),
        "max_mean_requests": (max(counts) / (sum(counts) / len(counts))) if counts else None,
        "queue_max_mean": sum(imbalance) / len(imbalance) if imbalance else None,
    }


def median_run(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds of one setup."""
    def med(xs: list[float | None]) -> float | None:
        vals = sorted(x for x in xs if x is not None)
        return statistics.median(vals) if vals else None

    return {
        "setup": name,
        "requests": sum(r["requests"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "cached_ratio": med([r["cached_ratio"] for r in runs]),
        "ttft_s": {k: med([r["ttft_s"][k] for r in runs]) for k in ("p50", "p90", "p99", "mean")},
        "max_mean_requests": med([r["max_mean_requests"] for r in runs]),
        "queue_max_mean": med([r["queue_max_mean"] for r in runs]),
    }


def run_replicas(opt: ReplicaOptions) -> dict[str, Any]:
    from rich.console import Console

    console = Console(quiet=opt.quiet)
    opt.out.mkdir(parents=True, exist_ok=True)
    chaos = ChaosOptions(out=opt.out, speedup=opt.speedup, target_load=opt.target_load, seed=opt.seed,
                         workload=chaos_spec())
    meta: dict[str, Any] = {"speedup": opt.speedup, "max_requests": opt.max_requests, "seed": opt.seed}
    rate_scale = rate_scale_for(chaos, opt.rate_scale, console.print, meta)
    workload = mixed(chaos.workload, seed=opt.seed + 1000, max_requests=opt.max_requests)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in SETUPS}
    for rep, (name, routers, redis) in ((r, s) for r in range(opt.repeats) for s in SETUPS):
        console.print(f"replicas: round {rep + 1}/{opt.repeats}, {name} ...")
        with environment(chaos, opt.out / "work" / name.replace(" ", "_").replace(",", ""), routers, redis) as env:
            traffic = Traffic([r.url for r in env.routers], chaos.spec.model, iter(workload.sessions),
                              speedup=opt.speedup, rate_scale=rate_scale, hang_s=120.0)
            stop = threading.Event()
            queues: list[dict[str, float]] = []
            sampler = threading.Thread(target=_engine_queues, args=([e.url for e in env.fleet.engines], stop, queues),
                                       daemon=True)
            sampler.start()
            asyncio.run(traffic.run())
            stop.set()
            sampler.join(10)
            run = summarize_run(name, traffic.records, opt.speedup, queues)
            console.print(f"  cached {run['cached_ratio']:.3f}, TTFT p90 {run['ttft_s']['p90']}, "
                          f"max/mean {run['max_mean_requests']}")
            rounds[name].append(run)
    runs = [median_run(name, rounds[name]) for name, _, _ in SETUPS]
    one, three = runs[1], runs[2]
    verdict = {
        "cached_ratio_loss": 1 - three["cached_ratio"] / one["cached_ratio"] if one["cached_ratio"] else None,
        "ttft_p90_change": (three["ttft_s"]["p90"] / one["ttft_s"]["p90"] - 1) if one["ttft_s"]["p90"] else None,
    }
    verdict["pass"] = (verdict["cached_ratio_loss"] is not None and verdict["cached_ratio_loss"] <= 0.05
                       and verdict["ttft_p90_change"] is not None and verdict["ttft_p90_change"] <= 0.10)
    meta["repeats"] = opt.repeats
    doc = {"meta": meta, "runs": runs, "three_vs_one_redis": verdict, "rounds": rounds}
    (opt.out / "replicas.json").write_text(json.dumps(doc, indent=1))
    from loadtest.chaos_report import write_replicas_report

    write_replicas_report(doc, opt.out)
    console.print((opt.out / "replicas_report.md").read_text())
    return doc
