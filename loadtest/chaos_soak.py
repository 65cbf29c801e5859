"""``kvrouter chaos --soak SECONDS``: steady traffic for a long time, and nothing may grow.

One fleet (4 engines, one process each) and one router with its in-memory index take
the chaos traffic (:mod:`loadtest.chaos_traffic`) at ``target_load`` of the measured
capacity, with no fault. Every ``sample_s`` the router's resident memory and open file
descriptors (``/proc``), its index entries and load tickets (``/debug/backends``),
its background jobs and tasks and event-loop tasks (``/metrics``) and the client's
request latency p99 over the last interval are sampled. After ``warmup_s`` a
least-squares line is fitted to each series; its slope, per hour and as a share of the
series' mean over the run, is the figure that says whether something leaks (a series
that is flat but noisy has a slope near 0 and a large spread). Written to
``soak.json``, ``soak_report.md`` and ``soak.png``.

Bounded caches grow until they are full, and that growth is not a leak only once the
bound is seen to hold. The router's prefix hash cache (router/prompt/hash_cache.py) is sampled
as ``hash_cache_blocks``; at the soak's traffic (~390,000 new blocks an hour) its default
bound of 500,000 blocks takes ~75 minutes to fill, longer than the hour, so the soak runs
the router with a bound of :data:`SOAK_HASH_CACHE_BLOCKS` (``--hash-cache-blocks``), full
within the warm-up: the hour then shows the plateau, and the bytes per block (hence the
default bound's cost, ~9 MB) are measured by tests/test_router_hash_cache.py. When the cache
fills only after the warm-up, the slopes are also fitted from the sample where it is
full (``slopes_after_fill``), and both are printed.

A burst (an engine ejected and re-admitted, requests piling up
while the shared machine stalls) raises resident memory in one step: the allocator keeps
pages it got for the burst's peak. A least-squares line through such a step reads as a
trend. So the router's RSS is also fitted *between* steps (:func:`rss_steps`: a rise of
at least :data:`STEP_MB` from one sample to the next): the within-segment slope, one line
per segment with a common slope, is the leak figure, and every step is listed with its
size and time next to the ejections counted by then. A leak cannot hide in steps: it
would have to come in jumps of ``STEP_MB`` each, and the steps' total is printed too.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from loadtest.chaos import ChaosOptions, environment, load_counters, rate_scale_for
from loadtest.chaos_traffic import Traffic, chaos_spec, session_stream
from loadtest.fleet import FleetSpec
from loadtest.replay import percentiles
from loadtest.workloads import MixedSpec

SERIES = ("rss_mb", "open_fds", "index_entries", "hash_cache_blocks", "segment_cache_tokens", "load_tickets",
          "background_jobs", "background_tasks", "asyncio_tasks", "latency_p99_s", "ttft_p99_s", "ejections")
SOAK_SIM_ARGS = ("--max-num-seqs", "4", "--step-overhead-ms", "200", "--num-blocks", "2048")
"""Half the chaos engines' speed (200 ms steps): an hour at 80% load costs the shared cores
about half as much, and caches still fill and evict within the warm-up."""
RUNTIME_METRICS = {"kvrouter_background_jobs": "background_jobs", "kvrouter_background_tasks": "background_tasks",
                   "kvrouter_asyncio_tasks": "asyncio_tasks", "kvrouter_hash_cache_blocks": "hash_cache_blocks",
                   "kvrouter_tokenizer_segment_cache_tokens": "segment_cache_tokens",
                   "kvrouter_backend_ejections": "ejections"}
"""``segment_cache_tokens`` fills only with ``--chat`` (token-id prompts are not tokenized):
RSS growing with it, toward ``Tuning.segment_cache_tokens`` (router/tuning.py), is a bounded cache filling."""
"""Series read from ``/metrics``; a labelled one (per model) is summed over its labels."""
SOAK_HASH_CACHE_BLOCKS = 32_768
"""The soak router's ``hash_cache_blocks``: full after ~5 minutes of soak traffic."""
ROUTER_DEFAULT_HASH_CACHE_BLOCKS = 500_000
"""The hash cache's default bound (router/tuning.py), what ``hash_cache_blocks=None`` runs."""
STEP_MB = 2.0
"""An RSS rise between two samples (10 s) at least this big is a step, not a trend: the
+21 MB/hour the hash cache's fill used to cost was 0.06 MB per sample, and the heap grows
in rises of at most ~0.6 MB otherwise (the 1-hour soak's); the two ejections of that hour
raised it by 13.2 and 3.2 MB."""


@dataclass(slots=True)
class SoakOptions:
    out: Path
    seconds: float = 3600.0
    sample_s: float = 10.0
    speedup: float = 1.0
    target_load: float = 0.8
    rate_scale: float | None = None
    warmup_s: float | None = None
    """Samples before this are left out of the fits (default: a fifth of the run, at most 10 min)."""
    health_interval_s: float = 2.0
    seed: int = 0
    quiet: bool = False
    hash_cache_blocks: int | None = SOAK_HASH_CACHE_BLOCKS
    """The router's ``hash_cache_blocks``; None: the router's default."""
    spec: FleetSpec = field(default_factory=lambda: FleetSpec(backends=4, sim_args=list(SOAK_SIM_ARGS)))
    workload: MixedSpec = field(default_factory=chaos_spec)
    eject_every_s: float | None = None
    """Force an ejection this often (the engines in turn paused with SIGSTOP for
    ``eject_pause_s``): what each ejection and re-admission costs shows in the fits (a
    check that only timed out keeps the engine's index entries: a paused engine keeps its cache).
    None: no fault, the plain soak."""
    eject_pause_s: float = 8.0


def _scrape_runtime(client: httpx.Client, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in client.get(url + "/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.partition("{")[0]
        if name in RUNTIME_METRICS:
            key = RUNTIME_METRICS[name]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def fit(ts: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope (per second) and intercept."""
    n = len(ts)
    if n < 2:
        return 0.0, ys[0] if ys else 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0, my
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var
    return slope, my - slope * mt


def slopes(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, float | None]]:
    """Per series after warm-up: slope per hour, mean, and the slope's drift over the fitted
    span as a share of the mean (what "flat" is judged on)."""
    kept = [s for s in samples if s["t"] >= warmup_s]
    out: dict[str, dict[str, float | None]] = {}
    for name in SERIES:
        pts = [(s["t"], float(s[name])) for s in kept if s.get(name) is not None]
        if len(pts) < 3:
            out[name] = {"per_hour": None, "mean": None, "drift_share": None, "points": len(pts)}
            continue
        ts, ys = [p[0] for p in pts], [p[1] for p in pts]
        slope, _ = fit(ts, ys)
        mean = sum(ys) / len(ys)
        span = ts[-1] - ts[0]
        out[name] = {"per_hour": slope * 3600.0, "mean": mean,
                     "drift_share": (slope * span / mean) if mean else None, "points": len(pts),
                     "min": min(ys), "max": max(ys)}
    return out


def rss_steps(samples: list[dict[str, Any]], from_s: float, step_mb: float = STEP_MB) -> dict[str, Any]:
    """RSS after ``from_s`` split at every rise of ``step_mb`` or more between consecutive
    samples: the steps (time, size, ejections counted by then) and the slope per hour of
    one line per segment with a common slope (each segment centred on its own means)."""
    kept = [s for s in samples if s["t"] >= from_s and s.get("rss_mb") is not None]
    segments: list[list[dict[str, Any]]] = [[]]
    steps = []
    for prev, cur in zip([None, *kept], kept):
        if prev is not None and cur["rss_mb"] - prev["rss_mb"] >= step_mb:
            steps.append({"t": cur["t"], "mb": cur["rss_mb"] - prev["rss_mb"], "ejections": cur.get("ejections")})
            segments.append([])
        segments[-1].append(cur)
    num = den = 0.0
    for seg in segments:
        if len(seg) < 3:
            continue
        mt = sum(s["t"] for s in seg) / len(seg)
        my = sum(s["rss_mb"] for s in seg) / len(seg)
        num += sum((s["t"] - mt) * (s["rss_mb"] - my) for s in seg)
        den += sum((s["t"] - mt) ** 2 for s in seg)
    return {"step_mb": step_mb, "steps": steps, "steps_total_mb": sum(st["mb"] for st in steps),
            "segments": len(segments), "per_hour_within_segments": (num / den * 3600.0) if den else None}


def analyse(doc: dict[str, Any]) -> dict[str, Any]:
    """The fits of a soak document from its samples and meta (also re-run on a saved ``soak.json``)."""
    meta, samples = doc["meta"], doc["samples"]
    warmup = meta["warmup_s"]
    filled = filled_at(samples, meta["hash_cache_blocks"]) if meta.get("hash_cache_blocks") else None
    meta["hash_cache_filled_s"] = filled
    doc["slopes"] = slopes(samples, warmup)
    doc["slopes_after_fill"] = slopes(samples, filled) if filled is not None and filled > warmup else None
    doc["rss_steps"] = rss_steps(samples, max(warmup, filled or 0.0))
    return doc


def filled_at(samples: list[dict[str, Any]], bound: int) -> float | None:
    """The first sample time at which the hash cache held its bound (whole chunks of 16
    blocks), or None if it never did."""
    full = bound // 16 * 16
    return next((s["t"] for s in samples if (s.get("hash_cache_blocks") or 0) >= full), None)


def run_soak(opt: SoakOptions) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(quiet=opt.quiet)
    opt.out.mkdir(parents=True, exist_ok=True)
    chaos = ChaosOptions(out=opt.out, speedup=opt.speedup, target_load=opt.target_load, seed=opt.seed,
                         health_interval_s=opt.health_interval_s, hang_s=120.0,
                         spec=replace(opt.spec, speedup=opt.speedup), workload=opt.workload,
                         router_tuning={} if opt.hash_cache_blocks is None else {"hash_cache_blocks": opt.hash_cache_blocks})
    bound = opt.hash_cache_blocks or ROUTER_DEFAULT_HASH_CACHE_BLOCKS
    meta: dict[str, Any] = {"seconds": opt.seconds, "sample_s": opt.sample_s, "speedup": opt.speedup,
                            "sim_args": chaos.spec.sim_args, "hash_cache_blocks": bound}
    rate_scale = rate_scale_for(chaos, opt.rate_scale, console.print, meta)
    warmup = opt.warmup_s if opt.warmup_s is not None else min(600.0, opt.seconds / 5)
    meta["warmup_s"] = warmup
    samples: list[dict[str, Any]] = []
    with environment(chaos, opt.out / "work" / "soak", 1, False) as env:
        router = env.routers[0]
        traffic = Traffic([router.url], chaos.spec.model, session_stream(opt.workload, opt.seed),
                          speedup=opt.speedup, rate_scale=rate_scale, hang_s=120.0)
        stop = threading.Event()

        def sampler() -> None:
            seen = 0
            with httpx.Client(timeout=30.0) as client:
                while not stop.wait(opt.sample_s):
                    t = traffic.now()
                    recs = traffic.records[seen:]
                    seen += len(recs)
                    rss, fds = router.usage()
                    row: dict[str, Any] = {"t": t, "rss_mb": rss / 2**20, "open_fds": fds, "requests": len(recs),
                                           "failed": sum(1 for r in recs if r.outcome != "ok")}
                    try:
                        backends = client.get(router.url + "/debug/backends").json()["backends"]
                        row["index_entries"] = sum(b["blocks"] for b in backends)
                        row["load_tickets"] = sum(b["load"]["in_flight"] for b in backends)
                        row.update(_scrape_runtime(client, router.url))
                    except (httpx.HTTPError, ValueError, KeyError) as e:
                        row["error"] = str(e)[:200]
                    ok = [r for r in recs if r.outcome == "ok"]
                    row["latency_p99_s"] = percentiles([r.done_t - r.sent_t for r in ok])["p99"]
                    row["ttft_p99_s"] = percentiles([r.ttft_s for r in ok if r.ttft_s is not None])["p99"]
                    samples.append(row)

        def timer() -> None:
            stop.wait(opt.seconds)
            traffic.stop()

        forced: list[dict[str, Any]] = []
        meta["forced_ejections"] = forced

        def ejector() -> None:
            assert opt.eject_every_s is not None
            for k in itertools.count():
                if stop.wait(opt.eject_every_s):
                    return
                p = env.fleet.procs[k % len(env.fleet.procs)]
                forced.append({"t": traffic.now(), "engine": p.name})
                p.signal(signal.SIGSTOP)
                stop.wait(opt.eject_pause_s)
                p.signal(signal.SIGCONT)

        threads = [threading.Thread(target=sampler, daemon=True), threading.Thread(target=timer, daemon=True)]
        if opt.eject_every_s is not None:
            threads.append(threading.Thread(target=ejector, daemon=True))
        for th in threads:
            th.start()
        with Progress(TextColumn("[bold]soak"), BarColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                      TextColumn("{task.fields[status]}"), console=console) as bar:
            task = bar.add_task("soak", total=opt.seconds, status="")

            async def drive() -> None:
                run = asyncio.create_task(traffic.run())
                while not run.done():
                    last = samples[-1] if samples else {}
                    bar.update(task, completed=min(opt.seconds, traffic.now()),
                               status=f"{len(traffic.records)} requests, rss {last.get('rss_mb', 0):.0f} MB, "
                                      f"fds {last.get('open_fds', 0)}")
                    await asyncio.sleep(1.0)
                await run

            asyncio.run(drive())
        stop.set()
        for th in threads:
            th.join(opt.sample_s + 30)
        loads = load_counters(env)
    failed = sum(1 for r in traffic.records if r.outcome != "ok")
    doc = analyse({"meta": meta, "requests": len(traffic.records), "failed": failed, "load_counters_after": loads,
                   "samples": samples})
    (opt.out / "soak.json").write_text(json.dumps(doc, indent=1))
    from loadtest.chaos_report import write_soak_report

    write_soak_report(doc, opt.out)
    _print_slopes(console, doc)
    return doc


def _print_slopes(console: Any, doc: dict[str, Any]) -> None:
    _print_table(console, doc, doc["slopes"], f"slopes after the {doc['meta']['warmup_s']:.0f} s warm-up")
    if doc.get("slopes_after_fill"):
        _print_table(console, doc, doc["slopes_after_fill"],
                     f"slopes after the hash cache filled at {doc['meta']['hash_cache_filled_s']:.0f} s")
    elif doc["meta"].get("hash_cache_filled_s") is None:
        console.print(f"[yellow]the hash cache never reached its bound ({doc['meta']['hash_cache_blocks']} blocks): "
                      "its fill is part of the slopes")
    st = doc["rss_steps"]
    within = "-" if st["per_hour_within_segments"] is None else f"{st['per_hour_within_segments']:+.3g} MB/hour"
    steps = ", ".join(f"+{x['mb']:.1f} MB at {x['t']:.0f} s" for x in st["steps"]) or "none"
    console.print(f"rss between steps of {st['step_mb']:.0f} MB or more: {within} over {st['segments']} segment(s); "
                  f"steps: {steps}")
    if console.quiet:
        print(json.dumps({k: v["per_hour"] for k, v in doc["slopes"].items()}))


def _print_table(console: Any, doc: dict[str, Any], fits: dict[str, dict[str, Any]], what: str) -> None:
    from rich.table import Table

    t = Table(title=f"soak: {doc['requests']} requests, {doc['failed']} failed; {what}")
    for col in ("series", "mean", "min", "max", "slope / hour", "drift over run / mean"):
        t.add_column(col)
    for name, s in fits.items():
        if s["per_hour"] is None:
            t.add_row(name, "-", "-", "-", "-", "-")
            continue
        drift = "-" if s["drift_share"] is None else f"{s['drift_share']:+.1%}"
        t.add_row(name, f"{s['mean']:.4g}", f"{s['min']:.4g}", f"{s['max']:.4g}", f"{s['per_hour']:+.4g}", drift)
    console.print(t)


def main(argv: list[str] | None = None) -> None:
    """``python -m loadtest.chaos_soak DIR``: fit a saved ``DIR/soak.json`` again and rewrite
    its report and plot (after a change to the analysis, without another hour of traffic)."""
    import sys

    from rich.console import Console

    from loadtest.chaos_report import write_soak_report

    out = Path((argv or sys.argv[1:])[0])
    doc = analyse(json.loads((out / "soak.json").read_text()))
    (out / "soak.json").write_text(json.dumps(doc, indent=1))
    write_soak_report(doc, out)
    _print_slopes(Console(), doc)


if __name__ == "__main__":
    main()
