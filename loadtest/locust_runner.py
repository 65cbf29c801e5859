"""``kvrouter loadtest``: Locust once per policy, identical settings, one comparison table.

For every policy it starts a fresh simulated fleet and the router, runs Locust
headless against the router (``loadtest/locustfile.py``, same users, spawn rate, run
time and options for each), and reads Locust's ``<prefix>_stats.csv``. The comparison
(``comparison.csv``, ``comparison.md`` and a printed table) takes, per policy, the
end-to-end row (``POST``) and the ``TTFT`` row of the chosen endpoint.

A fixed user count measures each policy at one load, most often one where routing cannot
matter (an unloaded fleet gives every policy the same TTFT, give or take noise). With
``--slo-ttft-p90-ms`` each policy instead gets a step ramp (``loadtest/locust_step.py``):
``--step-users`` more users every ``--step-time`` seconds (after half a step of warm-up)
until a step's TTFT p90 crosses the SLO or ``--max-users`` is reached. The comparison then reports the req/s each policy
sustained within the SLO (interpolated between the steps around the crossing, as the
bench's capacity at SLO is; ``>=`` when it never crossed), and ``ramp.png`` shows the ramp.
Locust's times are wall milliseconds, as in its own tables, so the SLO is too.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import capacity, report
from loadtest.fleet import Fleet, FleetError, FleetSpec, Router
from loadtest.workloads import DEFAULT_TOKENIZER

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
STEP_SHAPE = Path(__file__).with_name("locust_step.py")
USER_CLASSES = ("MultiTurnChatUser", "SharedPrefixUser", "TraceUser")
DEFAULT_POLICIES = "round_robin,least_loaded,prefix_approx,kv_aware"


@dataclass(frozen=True, slots=True)
class LocustStats:
    """One row of Locust's ``_stats.csv`` (times in ms, as Locust writes them)."""

    requests: int
    failures: int
    median_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    rps: float


def read_stats(path: Path) -> dict[tuple[str, str], LocustStats]:
    """``{(type, name): stats}`` from a Locust ``_stats.csv`` (the Aggregated row is ``("", "Aggregated")``)."""

    def num(v: str) -> float | None:
        try:
            return float(v)
        except (TypeError, ValueError):
            return None

    out: dict[tuple[str, str], LocustStats] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            out[(row["Type"], row["Name"])] = LocustStats(
                int(row["Request Count"]), int(row["Failure Count"]), num(row["50%"]), num(row["90%"]),
                num(row["99%"]), num(row["Average Response Time"]), num(row["Requests/s"]) or 0.0,
            )
    return out


def locust_command(host: str, csv_prefix: Path, args: argparse.Namespace) -> list[str]:
    if args.slo_ttft_p90_ms is None:
        load = ["-f", str(LOCUSTFILE), "-u", str(args.users), "-r", str(args.spawn_rate), "-t", args.run_time]
    else:
        load = ["-f", f"{LOCUSTFILE},{STEP_SHAPE}", "--slo-ttft-p90-ms", str(args.slo_ttft_p90_ms),
                "--step-users", str(args.step_users), "--step-time", str(args.step_time),
                "--max-users", str(args.max_users), "--step-log", f"{csv_prefix}_steps.jsonl"]
    cmd = [sys.executable, "-m", "locust", *load, "--headless", "--host", host, "--csv", str(csv_prefix),
           "--only-summary", "--stop-timeout", f"{int(args.stop_timeout)}s", "--loglevel", "WARNING",
           "--model", args.model, "--speedup", str(args.speedup), "--think-time", str(args.think_time),
           "--length-scale", str(args.length_scale), "--output-scale", str(args.output_scale),
           "--max-output-tokens", str(args.max_output_tokens), "--workload-seed", str(args.seed)]
    if args.trace:
        cmd += ["--trace", args.trace]
    if args.synthetic_spec:
        cmd += ["--synthetic-spec", args.synthetic_spec]
    cmd += args.locust_arg
    return cmd + list(args.user_classes)


def comparison_rows(per_policy: dict[str, dict[tuple[str, str], LocustStats]], endpoint: str) -> list[dict[str, Any]]:
    rows = []
    for policy, stats in per_policy.items():
        e2e = stats.get(("POST", endpoint))
        ttft = stats.get(("TTFT", endpoint))
        if e2e is None or ttft is None:
            rows.append({"policy": policy, "requests": 0, "failures": 0})
            continue
        rows.append({
            "policy": policy, "requests": e2e.requests, "failures": e2e.failures, "rps": e2e.rps,
            "ttft_p50_ms": ttft.median_ms, "ttft_p90_ms": ttft.p90_ms, "ttft_p99_ms": ttft.p99_ms,
            "e2e_p50_ms": e2e.median_ms, "e2e_p90_ms": e2e.p90_ms, "e2e_p99_ms": e2e.p99_ms,
        })
    return rows


COLUMNS = ("policy", "requests", "failures", "rps", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
           "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms")
RAMP_COLUMNS = ("sustained_rps_at_slo", "lower_bound", "max_users")
"""Added by a ramp: the req/s sustained within the SLO, whether the ramp ended before crossing it
(the figure is then a lower bound), and the users of its last step."""


def read_steps(path: Path) -> list[capacity.Step]:
    """The steps a ramp logged (:mod:`loadtest.locust_step`), in order; none when it logged nothing."""
    if not path.exists():
        return []
    return [capacity.Step(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def ramp_fields(steps: list[capacity.Step], slo_ms: float) -> dict[str, Any]:
    """A policy's :data:`RAMP_COLUMNS` from its steps (the same crossing rule as the bench's capacity)."""
    sustained = capacity.crossing([s.as_dict() for s in steps], slo_ms, rate="req_per_s")
    return {"sustained_rps_at_slo": round(sustained.req_per_s, 3), "lower_bound": sustained.lower_bound,
            "max_users": steps[-1].users if steps else 0}


def write_comparison(out: Path, rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> None:
    with open(out / "comparison.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in columns})
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] * len(columns)) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in columns) + " |" for r in rows]
    (out / "comparison.md").write_text("\n".join(lines) + "\n")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return str(v)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for Locust CSVs, logs and the comparison")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    p.add_argument("--backends", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--users", type=int, default=None, help="Locust users (default 16; not with a ramp)")
    p.add_argument("--spawn-rate", type=float, default=8.0, help="users started per second (default 8)")
    p.add_argument("--run-time", default=None, help="Locust run time per policy, e.g. 30s, 2m (default 60s; not with a ramp)")
    p.add_argument("--slo-ttft-p90-ms", type=float, default=None, metavar="MS",
                   help="ramp users step by step until TTFT p90 (wall ms, as Locust measures it) crosses MS, and "
                        "report the req/s each policy sustained within it")
    p.add_argument("--step-users", type=int, default=None, help="ramp: users added per step (default 4)")
    p.add_argument("--step-time", type=float, default=None, help="ramp: seconds per step (default 20)")
    p.add_argument("--max-users", type=int, default=None, help="ramp: users of the last step (default 64)")
    p.add_argument("--stop-timeout", type=int, default=5, help="seconds users get to finish at the end")
    p.add_argument("--user-classes", nargs="+", choices=USER_CLASSES, default=["MultiTurnChatUser"],
                   help="Locust user classes (default MultiTurnChatUser)")
    p.add_argument("--endpoint", default=None,
                   help="endpoint row to compare (default: /v1/completions for TraceUser alone, else chat)")
    p.add_argument("--model", default="qwen3-sim", help="served model name")
    p.add_argument("--speedup", type=float, default=1.0, help="engines run X times faster; think times / X")
    p.add_argument("--think-time", type=float, default=5.0, help="mean think time between chat turns (s)")
    p.add_argument("--trace", default=None, help="TraceUser: trace file (default: shipped Mooncake sample)")
    p.add_argument("--synthetic-spec", default=None, help="SharedPrefixUser: JSON spec")
    p.add_argument("--length-scale", type=float, default=1.0, help="TraceUser (mooncake): block/input scale")
    p.add_argument("--output-scale", type=float, default=1.0, help="TraceUser (mooncake): output scale")
    p.add_argument("--max-output-tokens", type=int, default=512, help="cap of max_tokens for chat users")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per engine (default: the simulator's)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--locust-arg", action="append", default=[], help="extra argument for locust (repeatable)")


RAMP_DEFAULTS = {"step_users": 4, "step_time": 20.0, "max_users": 64}
FIXED_DEFAULTS = {"users": 16, "run_time": "60s"}


def check_load_args(args: argparse.Namespace) -> None:
    """Fill the defaults of the chosen load (a ramp with ``--slo-ttft-p90-ms``, else fixed users);
    a flag of the other kind is refused in one line rather than silently ignored."""
    ramp = args.slo_ttft_p90_ms is not None
    mine, other = (RAMP_DEFAULTS, FIXED_DEFAULTS) if ramp else (FIXED_DEFAULTS, RAMP_DEFAULTS)
    wrong = [k for k in other if getattr(args, k) is not None]
    if wrong:
        flags = ", ".join("--" + k.replace("_", "-") for k in wrong)
        raise ValueError(f"{flags}: not with a ramp (it sets users step by step)" if ramp else
                         f"{flags}: ramp flags, which need --slo-ttft-p90-ms")
    for k, v in mine.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if ramp and not (math.isfinite(args.slo_ttft_p90_ms) and args.slo_ttft_p90_ms > 0 and args.step_users >= 1
                     and args.step_time > 0 and args.max_users >= args.step_users):
        raise ValueError("a ramp needs --slo-ttft-p90-ms > 0, --step-users >= 1, --step-time > 0 and "
                         "--max-users >= --step-users")


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    console = report.console()
    try:
        check_load_args(args)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    ramp = args.slo_ttft_p90_ms is not None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    endpoint = args.endpoint or ("/v1/completions" if list(args.user_classes) == ["TraceUser"]
                                 else "/v1/chat/completions")
    spec = FleetSpec(backends=args.backends, model=args.model, tokenizer=str(DEFAULT_TOKENIZER), speedup=args.speedup,
                     num_blocks=args.num_blocks)
    per_policy: dict[str, dict[tuple[str, str], LocustStats]] = {}
    steps: dict[str, list[capacity.Step]] = {}
    load = (f"{args.step_users} more users every {args.step_time:g} s up to {args.max_users}, until TTFT p90 > "
            f"{args.slo_ttft_p90_ms:g} ms" if ramp else f"{args.users} users for {args.run_time}")
    for policy in policies:
        console.print(f"[bold]{policy}[/bold]: fleet of {args.backends}, Locust {load}")
        try:
            with Fleet(spec, out / "logs" / policy) as fleet, Router(fleet, policy, out / "logs" / policy) as router:
                prefix = out / policy
                Path(f"{prefix}_steps.jsonl").unlink(missing_ok=True)  # the ramp appends: a rerun starts afresh
                log = out / "logs" / policy / "locust.log"
                with open(log, "wb") as fh:
                    rc = subprocess.run(locust_command(router.url, prefix, args), stdout=fh, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL).returncode
        except FleetError as e:
            console.print(f"[red]error:[/red] {e}")
            return 2
        stats_path = Path(f"{prefix}_stats.csv")
        if not stats_path.exists():
            console.print(f"[red]error:[/red] Locust wrote no stats for {policy} (exit {rc}); see {log}")
            return 1
        per_policy[policy] = read_stats(stats_path)
        if ramp:
            steps[policy] = read_steps(Path(f"{prefix}_steps.jsonl"))
    rows = comparison_rows(per_policy, endpoint)
    columns = COLUMNS + RAMP_COLUMNS if ramp else COLUMNS
    if ramp:
        for r in rows:
            r.update(ramp_fields(steps[r["policy"]], args.slo_ttft_p90_ms))
        report.plot_ramp(steps, args.slo_ttft_p90_ms, out / "ramp.png", f"Locust {endpoint}, {args.backends} engines")
    write_comparison(out, rows, columns)
    t = Table(title=f"Locust {endpoint}: {load}, {args.backends} engines")
    for c in columns:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for r in rows:
        t.add_row(*(_cell(r.get(c)) for c in columns))
    console.print(t)
    console.print(f"comparison: {out / 'comparison.md'}  Locust CSVs: {out}/<policy>_stats.csv"
                  + (f"  ramp: {out / 'ramp.png'}" if ramp else ""))
    return 0 if all(r["requests"] for r in rows) else 1
