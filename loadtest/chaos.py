"""``kvrouter chaos``: break one component of a live fleet per scenario and measure the damage.

Each scenario starts a fresh fleet (:mod:`loadtest.chaos_env`: 4 simulated engines, one
process each, and the router or routers in front), runs open-loop multi-turn traffic
(:mod:`loadtest.chaos_traffic`) at a target share of the fleet's measured capacity,
injects one fault, keeps the traffic going, stops it and checks:

* **failures**: every request that did not end ``ok``, and whether it was one the
  fault may take (in flight on the faulted component when the fault hit) and ended
  cleanly (an OpenAI error, an SSE error event, or a broken connection to a killed
  router); anything else is an *unexpected* failure;
* **eject / re-admit**: when the routers' ``/debug/backends`` first showed the faulted
  engine unhealthy after the fault, and healthy again after it recovered;
* **convergence**: when the index (``/debug/index``) first equalled every engine's true
  cache (``/debug/cache``) after recovery, and the blocks wrongly held or missed once
  traffic has stopped. A live cache changes between two reads, so "equal" is judged
  against a bracket: the index may hold a block only if the engine held it before or
  after the index was read, and must hold every block the engine held both times;
* **load counters** (in-flight, prefill tokens, decode sequences, active blocks) back
  to exactly zero once every request has ended;
* each router's RSS and open file descriptors before the fault and at the end.

The results go to ``chaos.json`` and ``chaos_report.md`` (plus ``chaos.png``).
``--soak SECONDS`` instead runs one fleet without faults and samples the router's
resources every ``--sample-s`` (:mod:`loadtest.chaos_soak`); ``--replicas``
compares 1 and 3 routers on a Redis index (:mod:`loadtest.chaos_replicas`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.chaos_env import ChaosFleet, IndexerChild, RedisChild, RouterChild
from loadtest.chaos_relay import TcpRelay
from loadtest.chaos_traffic import CLEAN_FAILURES, Record, Traffic, chaos_spec, session_stream
from loadtest.fleet import FleetSpec
from loadtest.workloads import MixedSpec, mixed

LOAD_FIELDS = ("in_flight", "prefill_tokens", "decode_seqs", "active_blocks")
SCENARIOS = ("engine_kill", "engine_pause", "event_cut", "engine_restart", "event_drop", "redis_restart", "replica_kill")
FAULTED_ENGINE = "engine-1"


@dataclass(slots=True)
class ChaosOptions:
    """Timings are wall seconds. The defaults are the full run; tests scale them down."""

    out: Path
    scenarios: tuple[str, ...] = SCENARIOS
    speedup: float = 1.0
    """Engine time = wall time by default: the faults' durations are the issue's wall seconds,
    and 70% of the engines' capacity is then ~19 requests a second, which 2 cores sustain."""
    rate_scale: float | None = None
    """Arrival-rate multiplier; None: measure capacity and use ``target_load``."""
    target_load: float = 0.7
    health_interval_s: float = 2.0
    warmup_s: float = 20.0
    after_s: float = 40.0
    """Traffic after the fault has recovered."""
    pause_s: float = 10.0
    cut_s: float = 30.0
    drop_fraction: float = 0.2
    drop_s: float = 30.0
    down_s: float = 8.0
    """How long a killed engine, Redis or router replica stays down before it restarts."""
    settle_s: float = 30.0
    """Longest wait, after traffic stops, for the index to equal the engines' caches."""
    hang_s: float = 60.0
    seed: int = 0
    spec: FleetSpec = field(default_factory=lambda: FleetSpec(backends=4, sim_args=list(DEFAULT_SIM_ARGS)))
    workload: MixedSpec = field(default_factory=chaos_spec)
    quiet: bool = False
    router_settings: dict[str, Any] = field(default_factory=dict)
    """Extra ``router:`` settings for every router started."""
    router_tuning: dict[str, Any] = field(default_factory=dict)
    """The lab's knobs for every router started (router/tuning.py: the soak bounds its hash cache)."""


DEFAULT_SIM_ARGS = ("--max-num-seqs", "4", "--step-overhead-ms", "100", "--num-blocks", "2048")
"""Engines that saturate at a request rate 2 cores can drive through the router (the engines,
not the CPU, set the capacity: measured ~27 req/engine-s at speedup 1 and 2 alike): at most
4 sequences a step, 100 ms steps, a pool small enough that caches evict (and emit removes)."""


@dataclass(slots=True)
class Marks:
    """When things happened in a scenario (seconds on the traffic clock)."""

    fault_t: float = 0.0
    recover_t: float | None = None
    """When the faulted component was back (resumed, restarted, stream restored)."""
    faulted_engine: str | None = None
    faulted_router: int | None = None
    notes: list[str] = field(default_factory=list)


def fleet_spec(opt: ChaosOptions) -> FleetSpec:
    """The options' fleet with the engines' clock at the traffic's speedup (both must agree)."""
    return replace(opt.spec, speedup=opt.speedup)


class Sampler:
    """Polls each router's ``/debug/backends`` from a thread: health and load over time."""

    def __init__(self, routers: list[RouterChild], clock: Callable[[], float], interval_s: float) -> None:
        self.routers = routers
        self.clock = clock
        self.interval_s = interval_s
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        with httpx.Client(timeout=max(1.0, self.interval_s)) as client:
            while not self._stop.is_set():
                t = self.clock()
                for i, r in enumerate(self.routers):
                    try:
                        backends = client.get(r.url + "/debug/backends").json()["backends"]
                    except (httpx.HTTPError, ValueError, KeyError):
                        continue
                    self.rows.append({"t": t, "router": i, "healthy": {b["name"]: b["healthy"] for b in backends},
                                      "in_flight": {b["name"]: b["load"]["in_flight"] for b in backends}})
                self._stop.wait(self.interval_s)

    def first(self, router: int, engine: str, healthy: bool, after: float) -> float | None:
        for row in self.rows:
            if row["router"] == router and row["t"] >= after and row["healthy"].get(engine) is healthy:
                return row["t"]
        return None


def index_diff(fleet: ChaosFleet, router: RouterChild) -> dict[str, dict[str, int]]:
    """Per engine: blocks the index holds that the engine did not (``wrong``) and blocks the
    engine held throughout that the index lacks (``missed``), bracketed by two truth reads."""
    before = fleet.truth()
    held = router.index_keys(fleet.spec.model)
    after = fleet.truth()
    out = {}
    for name in before.keys() & after.keys():
        index = held.get(name, set())
        out[name] = {"wrong": len(index - (before[name] | after[name])),
                     "missed": len((before[name] & after[name]) - index), "truth": len(after[name]),
                     "index": len(index)}
    return out


def converged(diff: dict[str, dict[str, int]]) -> bool:
    return all(d["wrong"] == 0 and d["missed"] == 0 for d in diff.values())


class Scenario:
    """One fault on a fresh fleet. Subclasses set ``name``, ``routers``, ``redis`` and ``inject``."""

    name = ""
    description = ""
    routers = 1
    redis = False
    relay = False
    """Read the faulted engine's event sockets through relays that can be cut."""

    def __init__(self, opt: ChaosOptions) -> None:
        self.opt = opt
        self.marks = Marks()

    def inject(self, env: Env, traffic: Traffic) -> None:
        raise NotImplementedError

    def engine(self, env: Env) -> Any:
        return next(p for p in env.fleet.procs if p.name == FAULTED_ENGINE)

    def note_divergence(self, env: Env, when: str) -> None:
        """How far the index had drifted from the faulted engine's cache (the fault did bite)."""
        try:
            d = index_diff(env.fleet, env.routers[0]).get(FAULTED_ENGINE, {})
        except (httpx.HTTPError, ValueError, KeyError):
            return
        self.marks.notes.append(f"Index vs {FAULTED_ENGINE} {when}: {d.get('wrong', '?')} blocks wrongly held, "
                                f"{d.get('missed', '?')} missed, of {d.get('truth', '?')}.")

    def busy_engine(self, env: Env, timeout_s: float = 10.0) -> Any:
        """The faulted engine once the router has requests in flight on it (the fault must
        hit streams, not an idle engine); the count at that moment goes into the notes."""
        p = self.engine(env)
        deadline = time.monotonic() + timeout_s
        n = 0
        while time.monotonic() < deadline:
            try:
                n = next(b["load"]["in_flight"] for b in env.routers[0].backends() if b["name"] == p.name)
            except (httpx.HTTPError, ValueError, KeyError, StopIteration):
                n = 0
            if n >= 2:
                break
            time.sleep(0.02)
        self.marks.notes.append(f"{n} requests in flight on {p.name} when the fault hit.")
        self.marks.faulted_engine = p.name
        return p


@dataclass(slots=True)
class Env:
    fleet: ChaosFleet
    routers: list[RouterChild]
    redis: RedisChild | None
    indexer: IndexerChild | None
    workdir: Path
    relays: dict[str, tuple[TcpRelay, TcpRelay]] = field(default_factory=dict)
    """Engine name -> (events relay, replay relay) the routers read that engine through."""


@contextmanager
def environment(opt: ChaosOptions, workdir: Path, routers: int, redis: bool, relay: str | None = None) -> Iterator[Env]:
    """Fleet, Redis and indexer (``redis``), ``routers`` routers, engine ``relay``'s event
    sockets read through :class:`TcpRelay` s; all stopped on exit."""
    with ExitStack() as stack:
        workdir.mkdir(parents=True, exist_ok=True)
        fleet = ChaosFleet(fleet_spec(opt), workdir)
        stack.callback(fleet.stop)
        fleet.start()
        settings = {"host": "127.0.0.1", "policy": "kv_aware", "health_interval_s": opt.health_interval_s,
                    "request_timeout_s": opt.hang_s * 2, **opt.router_settings}
        model = fleet.model_config()
        relays: dict[str, tuple[TcpRelay, TcpRelay]] = {}
        for b in model["backends"]:
            if b["name"] == relay:
                pair = (TcpRelay(_port(b["kv_events"])), TcpRelay(_port(b["kv_replay"])))
                for r in pair:
                    stack.callback(r.close)
                relays[b["name"]] = pair
                b["kv_events"], b["kv_replay"] = pair[0].endpoint, pair[1].endpoint
        config: dict[str, Any] = {"models": [model], "router": settings, "index": "memory"}
        redis_child = indexer = None
        if redis:
            redis_child = RedisChild(workdir).start()
            stack.callback(redis_child.stop)
            config["index"] = redis_child.url
            path = workdir / "indexer.yaml"
            path.write_text(yaml.safe_dump(config))
            indexer = IndexerChild(path, workdir)
            stack.callback(indexer.stop)
        started = []
        for i in range(routers):
            r = RouterChild(f"router-{i}", config, workdir, opt.router_tuning)
            stack.callback(r.stop)
            started.append(r.start())
        if not redis:
            for r in started:
                r.wait_streams()
        yield Env(fleet, started, redis_child, indexer, workdir, relays)


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


# -- the scenarios -----------------------------------------------------------------------------


class EngineKill(Scenario):
    name = "engine_kill"
    description = "engine-1 SIGKILLed mid-stream, restarted (empty) after the down time"

    def inject(self, env: Env, traffic: Traffic) -> None:
        p = self.busy_engine(env)
        self.marks.fault_t = traffic.now()
        p.signal(signal.SIGKILL)
        time.sleep(self.opt.down_s)
        p.start()
        self.marks.recover_t = traffic.now()


class EnginePause(Scenario):
    name = "engine_pause"
    description = "engine-1 SIGSTOPped, SIGCONT after the pause"

    def inject(self, env: Env, traffic: Traffic) -> None:
        p = self.busy_engine(env)
        self.marks.fault_t = traffic.now()
        p.signal(signal.SIGSTOP)
        time.sleep(self.opt.pause_s)
        p.signal(signal.SIGCONT)
        self.marks.recover_t = traffic.now()


class EventCut(Scenario):
    name = "event_cut"
    description = ("engine-1's event and replay sockets cut (TCP relays reset and refusing) while it keeps "
                   "serving, then restored")
    relay = True

    def inject(self, env: Env, traffic: Traffic) -> None:
        p = self.engine(env)
        self.marks.faulted_engine = p.name
        events, replay = env.relays[p.name]
        self.marks.fault_t = traffic.now()
        events.cut()
        replay.cut()
        time.sleep(self.opt.cut_s)
        self.note_divergence(env, "at the end of the cut")
        events.restore()
        replay.restore()
        self.marks.recover_t = traffic.now()


class EngineRestart(Scenario):
    name = "engine_restart"
    description = "engine-1 killed and started again at once: seq back to 0, cache empty"

    def inject(self, env: Env, traffic: Traffic) -> None:
        p = self.busy_engine(env)
        self.marks.fault_t = traffic.now()
        p.restart()
        self.marks.recover_t = traffic.now()


class EventDrop(Scenario):
    name = "event_drop"
    description = "engine-1 drops a share of its PUB messages (simulator fault injection)"

    def inject(self, env: Env, traffic: Traffic) -> None:
        p = self.engine(env)
        self.marks.faulted_engine = p.name
        self.marks.fault_t = traffic.now()
        p.fault(drop_event_fraction=self.opt.drop_fraction)
        time.sleep(self.opt.drop_s)
        self.note_divergence(env, "as the drops stopped")
        p.fault(drop_event_fraction=0.0)
        self.marks.recover_t = traffic.now()


class RedisRestart(Scenario):
    name = "redis_restart"
    description = "Redis killed and restarted empty under 2 routers and kvrouter indexer"
    routers = 2
    redis = True

    def inject(self, env: Env, traffic: Traffic) -> None:
        assert env.redis is not None
        self.marks.fault_t = traffic.now()
        env.redis.kill()
        time.sleep(self.opt.down_s)
        env.redis.start()
        self.marks.recover_t = traffic.now()


class ReplicaKill(Scenario):
    name = "replica_kill"
    description = "router-1 of 2 SIGKILLed; clients fail over to router-0; router-1 restarted later"
    routers = 2

    def inject(self, env: Env, traffic: Traffic) -> None:
        self.marks.faulted_router = 1
        self.marks.fault_t = traffic.now()
        env.routers[1].kill()
        time.sleep(self.opt.down_s)
        env.routers[1].start()
        env.routers[1].wait_streams()
        self.marks.recover_t = traffic.now()


SCENARIO_TYPES: dict[str, type[Scenario]] = {
    s.name: s for s in (EngineKill, EnginePause, EventCut, EngineRestart, EventDrop, RedisRestart, ReplicaKill)
}


# -- running one scenario --------------------------------------------------------------------


def expected_failure(rec: Record, marks: Marks) -> bool:
    """A failure the fault may cause: in flight on the faulted component when it was hit.

    An engine fault may take the requests sent before it to that engine and still open
    (``x-kvrouter-backend`` names it); a router fault, those sent to that router. Either
    must have ended cleanly (:data:`loadtest.chaos_traffic.CLEAN_FAILURES`)."""
    if rec.outcome not in CLEAN_FAILURES or rec.sent_t > marks.fault_t or rec.done_t < marks.fault_t:
        return False
    if marks.faulted_router is not None:
        return rec.router == marks.faulted_router
    return marks.faulted_engine is not None and rec.backend == marks.faulted_engine


def run_scenario(opt: ChaosOptions, scenario: Scenario, rate_scale: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Fleet up, warm-up traffic, the fault, more traffic, stop, settle, measure."""
    workdir = opt.out / "work" / scenario.name
    relay = FAULTED_ENGINE if scenario.relay else None
    with environment(opt, workdir, scenario.routers, scenario.redis, relay) as env:
        sessions = session_stream(opt.workload, opt.seed)
        traffic = Traffic([r.url for r in env.routers], opt.spec.model, sessions, speedup=opt.speedup,
                          rate_scale=rate_scale, hang_s=opt.hang_s)
        usage_before: list[tuple[int, int]] = []
        convergence: dict[str, Any] = {}
        errors: list[BaseException] = []

        def driver() -> None:
            try:
                time.sleep(opt.warmup_s)
                usage_before.extend(r.usage() for r in env.routers)
                log(f"{scenario.name}: fault at {traffic.now():.1f}s ({traffic.in_flight} requests in flight)")
                scenario.inject(env, traffic)
                log(f"{scenario.name}: recovered at {traffic.now():.1f}s")
                convergence.update(watch_convergence(env, traffic, scenario.marks, opt.after_s))
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                errors.append(e)
            finally:
                traffic.stop()

        with Sampler(env.routers, traffic.now, min(0.25, opt.health_interval_s / 4)) as sampler:
            thread = threading.Thread(target=driver, name="chaos-driver", daemon=True)
            thread.start()
            asyncio.run(traffic.run())
            thread.join()
        if errors:
            raise errors[0]
        stopped_t = traffic.now()
        final, settle_s = settle(env, opt.settle_s)
        loads = load_counters(env)
        usage_after = [r.usage() for r in env.routers]
        return summarize(opt, scenario, traffic.records, sampler, convergence, final, settle_s, loads,
                         usage_before, usage_after, stopped_t)


def watch_convergence(env: Env, traffic: Traffic, marks: Marks, window_s: float) -> dict[str, Any]:
    """Traffic goes on for ``window_s`` after recovery; meanwhile, the first time the index
    equalled the engines' caches (judged on the router clients reach first)."""
    assert marks.recover_t is not None
    end = time.monotonic() + window_s
    found: float | None = None
    history: list[tuple[float, int, int]] = []
    last: dict[str, Any] = {}
    while time.monotonic() < end:
        t = traffic.now()
        try:
            last = index_diff(env.fleet, env.routers[0])
        except (httpx.HTTPError, ValueError, KeyError):
            time.sleep(0.5)
            continue
        history.append((t, sum(d["wrong"] for d in last.values()), sum(d["missed"] for d in last.values())))
        if found is None and converged(last):
            found = t
        time.sleep(0.25 if found is None else 2.0)
    return {"converged_t": found, "checks": len(history), "live_diffs": history, "last_live_diff": last}


def settle(env: Env, timeout_s: float) -> tuple[dict[str, Any], float | None]:
    """After traffic: wait until every router's index equals the engines' caches; the last
    diff and how long it took (None: not within ``timeout_s``)."""
    t0 = time.monotonic()
    diffs: dict[str, Any] = {}
    while True:
        diffs = {}
        for i, r in enumerate(env.routers):
            try:
                diffs[f"router-{i}"] = index_diff(env.fleet, r)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                diffs[f"router-{i}"] = {"error": str(e)[:200]}
        if all(isinstance(d, dict) and "error" not in d and converged(d) for d in diffs.values()):
            return diffs, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return diffs, None
        time.sleep(0.5)


def load_counters(env: Env) -> dict[str, dict[str, int]]:
    """Each router's load counters summed over its backends, after every request ended."""
    out = {}
    for i, r in enumerate(env.routers):
        totals = dict.fromkeys(LOAD_FIELDS, 0)
        for b in r.backends():
            for k in LOAD_FIELDS:
                totals[k] += int(b["load"].get(k) or 0)
        out[f"router-{i}"] = totals
    return out


def summarize(opt: ChaosOptions, scenario: Scenario, records: list[Record], sampler: Sampler,
              convergence: dict[str, Any], final: dict[str, Any], settle_s: float | None,
              loads: dict[str, dict[str, int]], before: list[tuple[int, int]], after: list[tuple[int, int]],
              stopped_t: float) -> dict[str, Any]:
    m = scenario.marks
    failed = [r for r in records if r.outcome != "ok"]
    unexpected = [r for r in failed if not expected_failure(r, m)]
    eject = readmit = None
    if m.faulted_engine is not None:
        eject = sampler.first(0, m.faulted_engine, False, m.fault_t)
        if eject is not None:
            readmit = sampler.first(0, m.faulted_engine, True, max(eject, m.recover_t or 0.0))
    wrong = sum(d.get("wrong", 0) for diff in final.values() for d in diff.values() if isinstance(d, dict))
    missed = sum(d.get("missed", 0) for diff in final.values() for d in diff.values() if isinstance(d, dict))
    conv_t = convergence.get("converged_t")
    since = readmit if readmit is not None else m.recover_t
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[r.outcome] = kinds.get(r.outcome, 0) + 1
    result = {
        "scenario": scenario.name,
        "description": scenario.description,
        "routers": scenario.routers,
        "requests": len(records),
        "ok": len(records) - len(failed),
        "failed": len(failed),
        "failed_kinds": kinds,
        "unexpected_failures": len(unexpected),
        "unexpected_examples": [asdict(r) for r in unexpected[:5]],
        "failed_examples": [asdict(r) for r in failed[:5]],
        "retried_on_other_router": sum(1 for r in records if r.retried),
        "fault_t": m.fault_t,
        "recover_t": m.recover_t,
        "stopped_t": stopped_t,
        "health_interval_s": opt.health_interval_s,
        "eject_s": None if eject is None else eject - m.fault_t,
        "readmit_s": None if readmit is None or m.recover_t is None else readmit - m.recover_t,
        "converge_s": None if conv_t is None or since is None else max(0.0, conv_t - since),
        "settle_s": settle_s,
        "final_wrong_blocks": wrong,
        "final_missed_blocks": missed,
        "final_index_diff": final,
        "load_counters": loads,
        "load_counters_zero": all(v == 0 for c in loads.values() for v in c.values()),
        "rss_before": [b[0] for b in before],
        "rss_after": [a[0] for a in after],
        "fds_before": [b[1] for b in before],
        "fds_after": [a[1] for a in after],
        "live_diffs": convergence.get("live_diffs", []),
        "live_wrong_max": max((w for _, w, _ in convergence.get("live_diffs", [])), default=None),
        "timeline": {"health": [{"t": row["t"], "router": row["router"], "healthy": row["healthy"].get(m.faulted_engine or "", True)}
                                for row in sampler.rows],
                     "failures": [(r.sent_t, r.done_t, r.outcome) for r in failed]},
        "notes": m.notes,
    }
    result["acceptance"] = acceptance(result)
    return result


def acceptance(r: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's bars for one scenario (None where a bar does not apply)."""
    hi = r["health_interval_s"]
    engine_down = r["scenario"] in ("engine_kill", "engine_pause")
    return {
        "only_faulted_in_flight_failed": r["unexpected_failures"] == 0,
        "ejected_within_2_intervals": (r["eject_s"] is not None and r["eject_s"] <= 2 * hi) if engine_down else None,
        "index_converged": r["final_wrong_blocks"] == 0 and r["final_missed_blocks"] == 0 and r["settle_s"] is not None,
        "converged_within_bound": None if r["converge_s"] is None else r["converge_s"] <= max(hi, 5.0),
        "load_counters_zero": r["load_counters_zero"],
    }


# -- whole run -------------------------------------------------------------------------------


def rate_scale_for(opt: ChaosOptions, given: float | None, log: Callable[[str], None], meta: dict[str, Any]) -> float:
    """``given``, or the arrival-rate multiplier for ``opt.target_load`` of the capacity
    ``kvrouter bench`` measures (recorded in ``meta`` with the scale)."""
    from loadtest.bench import measure_capacity

    scale = given
    if scale is None:
        wl = mixed(opt.workload, seed=opt.seed, max_requests=400)
        log("measuring fleet capacity (closed-loop saturation, round_robin) ...")
        cap = measure_capacity(wl, fleet_spec(opt), opt.out / "work" / "capacity")
        # The traffic (loadtest/chaos_traffic.py) compresses session starts only, keeping think
        # times: a stream of sessions for a set time, not one trace replayed faster, so its scale
        # is taken against the requests per second of session starts.
        starts = wl.sessions[-1].start_s - wl.sessions[0].start_s
        scale = opt.target_load * cap.requests_per_s / (wl.num_requests / starts)
        log(f"capacity {cap.requests_per_s:.2f} req/engine-s -> rate scale {scale:.3f} at load {opt.target_load}")
        meta.update({"capacity_req_per_engine_s": cap.requests_per_s, "target_load": opt.target_load})
    meta["rate_scale"] = scale
    return scale


def run_chaos(opt: ChaosOptions) -> dict[str, Any]:
    from rich.console import Console

    console = Console(quiet=opt.quiet)
    opt.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"speedup": opt.speedup, "health_interval_s": opt.health_interval_s,
                            "backends": opt.spec.backends, "sim_args": opt.spec.sim_args}
    rate_scale = rate_scale_for(opt, opt.rate_scale, console.print, meta)
    results = []
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("chaos scenarios", total=len(opt.scenarios))
        for name in opt.scenarios:
            bar.update(task, description=f"chaos: {name}")
            results.append(run_scenario(opt, SCENARIO_TYPES[name](opt), rate_scale, console.print))
            bar.advance(task)
    doc = {"meta": meta, "scenarios": results}
    (opt.out / "chaos.json").write_text(json.dumps(doc, indent=1, default=str))
    from loadtest.chaos_report import write_report

    write_report(doc, opt.out)
    return doc


# -- command line ----------------------------------------------------------------------------


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="chaos-out", help="directory for chaos_report.md, chaos.json and the PNG")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--speedup", type=float, default=None, help="simulator speedup (default 1)")
    p.add_argument("--target-load", type=float, default=None, help="share of measured capacity (default 0.7; soak 0.8)")
    p.add_argument("--rate-scale", type=float, default=None, help="fixed arrival-rate multiplier (skips the capacity run)")
    p.add_argument("--health-interval", type=float, default=2.0, help="router health_interval_s")
    p.add_argument("--short", action="store_true", help="every timing scaled down (a quick check, not the report)")
    p.add_argument("--soak", type=float, default=None, metavar="SECONDS", help="soak run of this many seconds instead")
    p.add_argument("--sample-s", type=float, default=10.0, help="soak sampling interval")
    p.add_argument("--warmup-s", type=float, default=None, help="soak: samples before this are left out of the fits")
    p.add_argument("--hash-cache-blocks", type=int, default=None,
                   help="soak: the router's hash_cache_blocks (default 32768, filled within the warm-up; 0: the router's default)")
    p.add_argument("--eject-every", type=float, default=None, metavar="SECONDS",
                   help="soak: pause an engine (SIGSTOP, the engines in turn) this often, long enough to be ejected")
    p.add_argument("--chat", action="store_true", help="soak: the workload as chat messages in text (default: token ids)")
    p.add_argument("--replicas", action="store_true", help="1 vs 3 routers on a Redis index instead (issue 17 §5)")
    p.add_argument("--max-requests", type=int, default=600, help="--replicas: requests per run")
    p.add_argument("--repeats", type=int, default=3, help="--replicas: interleaved rounds (medians reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")


def short_options(opt: ChaosOptions) -> ChaosOptions:
    """Every timing cut so a scenario takes well under a minute (tests, ``--short``). The pause
    outlasts a health interval plus a check's timeout (1.5 + 1.125 s), so some check always
    times out inside it whatever the health loop's phase (at 2 s only one started in its first
    0.875 s did, and the outcome hung on when the router had started)."""
    return replace(opt, speedup=8.0, health_interval_s=1.5, warmup_s=3.0, after_s=4.0, pause_s=3.0, cut_s=3.0,
                   drop_s=4.0, down_s=1.5, settle_s=20.0, hang_s=30.0)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.soak is not None:
        from loadtest.chaos_soak import SoakOptions, run_soak

        soak = SoakOptions(out=out, seconds=args.soak, sample_s=args.sample_s, seed=args.seed, quiet=args.quiet,
                           speedup=args.speedup or 1.0, target_load=args.target_load or 0.8,
                           rate_scale=args.rate_scale, warmup_s=args.warmup_s, eject_every_s=args.eject_every)
        if args.chat:
            soak.workload = replace(soak.workload, form="chat")
        if args.hash_cache_blocks is not None:
            soak.hash_cache_blocks = args.hash_cache_blocks or None
        run_soak(soak)
        return 0
    if args.replicas:
        from loadtest.chaos_replicas import ReplicaOptions, run_replicas

        run_replicas(ReplicaOptions(out=out, speedup=args.speedup or 1.0, target_load=args.target_load or 0.7,
                                    rate_scale=args.rate_scale, max_requests=args.max_requests, repeats=args.repeats, seed=args.seed,
                                    quiet=args.quiet))
        return 0
    names = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = [n for n in names if n not in SCENARIO_TYPES]
    if unknown:
        print(f"kvrouter chaos: unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
        return 2
    opt = ChaosOptions(out=out, scenarios=names, speedup=args.speedup or 1.0, rate_scale=args.rate_scale,
                       target_load=args.target_load or 0.7, health_interval_s=args.health_interval, seed=args.seed,
                       quiet=args.quiet)
    if args.short:
        opt = short_options(opt)
    doc = run_chaos(opt)
    bad = [r["scenario"] for r in doc["scenarios"] if not all(v is not False for v in r["acceptance"].values())]
    print(f"wrote {out / 'chaos_report.md'}" + (f"; failing acceptance: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0
