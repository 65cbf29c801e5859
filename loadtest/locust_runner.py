"""``kvrouter loadtest``: Locust once per policy, identical settings, one comparison table.

For every policy it starts a fresh simulated fleet and the router, runs Locust
headless against the router (``loadtest/locustfile.py``, same users, spawn rate, run
time and options for each), and reads Locust's ``<prefix>_stats.csv``. The comparison
(``comparison.csv``, ``comparison.md`` and a printed table) takes, per policy, the
end-to-end row (``POST``) and the ``TTFT`` row of the chosen endpoint.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.fleet import Fleet, FleetError, FleetSpec, Router
from loadtest.workloads import DEFAULT_TOKENIZER

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
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
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
           "-u", str(args.users), "-r", str(args.spawn_rate), "-t", args.run_time, "--csv", str(csv_prefix),
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


def write_comparison(out: Path, rows: list[dict[str, Any]]) -> None:
    with open(out / "comparison.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * len(COLUMNS)) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in COLUMNS) + " |" for r in rows]
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
    p.add_argument("--users", type=int, default=16, help="Locust users (default 16)")
    p.add_argument("--spawn-rate", type=float, default=8.0, help="users started per second (default 8)")
    p.add_argument("--run-time", default="60s", help="Locust run time per policy, e.g. 30s, 2m (default 60s)")
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


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    console = report.console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    endpoint = args.endpoint or ("/v1/completions" if list(args.user_classes) == ["TraceUser"]
                                 else "/v1/chat/completions")
    spec = FleetSpec(backends=args.backends, model=args.model, tokenizer=str(DEFAULT_TOKENIZER), speedup=args.speedup,
                     num_blocks=args.num_blocks)
    per_policy: dict[str, dict[tuple[str, str], LocustStats]] = {}
    for policy in policies:
        console.print(f"[bold]{policy}[/bold]: fleet of {args.backends}, Locust {args.users} users for {args.run_time}")
        try:
            with Fleet(spec, out / "logs" / policy) as fleet, Router(fleet, policy, out / "logs" / policy) as router:
                prefix = out / policy
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
    rows = comparison_rows(per_policy, endpoint)
    write_comparison(out, rows)
    t = Table(title=f"Locust {endpoint}: {args.users} users, {args.run_time}, {args.backends} engines")
    for c in COLUMNS:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for r in rows:
        t.add_row(*(_cell(r.get(c)) for c in COLUMNS))
    console.print(t)
    console.print(f"comparison: {out / 'comparison.md'}  Locust CSVs: {out}/<policy>_stats.csv")
    return 0 if all(r["requests"] for r in rows) else 1
