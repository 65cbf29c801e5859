"""``kvrouter demo`` (what ``make demo`` runs): capacity at a TTFT SLO, round_robin against kv_aware.

Operators buy a KV-aware router because the same engines then serve more traffic inside a
latency target, so that is what the demo measures. Four simulated engines, a held-out seed
of the mixed agentic and multi-tenant workload (chats, agent loops over long shared contexts,
RAG over shared documents: traffic where routing matters, and a seed no policy was tuned on),
replayed through round_robin, least_loaded and kv_aware at five multiples of round_robin's
measured capacity (:mod:`loadtest.capacity`). It prints the capacity table and one sentence,
and writes ``capacity.png``. Sized to finish in about five minutes on two cores.

The slice is shaped so that a short sweep on one small machine measures the fleet:

* **Shorter sessions and think times** (chats of 2 turns on average, agent loops of 3 steps,
  a quarter of the default think times). A 200-request slice then holds many sessions rather
  than a few long conversations, so its load is spread over the run instead of trailing off
  in the last sessions' thinks (the sweep runs the whole trace faster, thinks included).
* **Short answers** (a tenth of the default output lengths). Every streamed token costs the
  client, router and simulator processes CPU on the same two cores; at 3x with full answers
  they, not the engines, would be the bottleneck. Prompts keep their length, so prefill, where
  a cached prefix saves time, is what loads the engines.
* **Engines at 2x real time**, not 4x: what the client's own CPU queueing adds to TTFT is
  multiplied by the speedup when times are read in engine seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loadtest import bench, capacity, report
from loadtest.fleet import FleetError, FleetSpec
from loadtest.workloads import DEFAULT_TOKENIZER, HELD_OUT_SEEDS, MixedSpec, WorkloadError, mixed


class DEMO:
    """The demo's defaults (chosen to fit about five minutes on two cores), all fixed before any demo run."""

    seed = HELD_OUT_SEEDS[0]
    max_requests = 200
    mix = MixedSpec(chat_turns=2.0, agent_steps=3.0, think_s=2.0, agent_think_s=0.25, answer_tokens=20,
                    agent_output_tokens=12, rag_output_tokens=15, oneoff_output_tokens=20)
    """The mixed workload's defaults but for session lengths, think times and answers (module docstring)."""
    speedup = 2.0
    sweep = "0.25,0.5,1,2,3"
    """round_robin's closed-loop "capacity" is not where it breaks, and with the whole trace run faster
    (thinks included) round_robin crosses the SLO near 1.2x, kv_aware near 1.9x on tuning seed 0: the
    sweep starts at 0.25x so every policy has a point within the SLO, and reaches 3x (4.5 min there)."""
    slo_ttft_p90_ms = 1500.0
    """3.5-3.9x the idle client TTFT p90 of this slice's shape on this fleet, fixed before any demo
    run: round_robin at 0.1x and 0.2x of its capacity, on tuning seed 0 of the mixed workload with
    :attr:`mix`, gave 428 and 387 ms (the engines' own p90: 325 ms)."""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo-out", help="directory for report.md, results.json and capacity.png "
                                                     "(default demo-out)")
    p.add_argument("--policies", default="round_robin,least_loaded,kv_aware", help="comma-separated policies")
    p.add_argument("--backends", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--seed", type=int, default=DEMO.seed,
                   help=f"seed of the mixed workload (default {DEMO.seed}, held out from tuning)")
    p.add_argument("--max-requests", type=int, default=DEMO.max_requests, help="requests replayed at each load")
    p.add_argument("--sweep", default=DEMO.sweep, help=f"loads, multiples of round_robin's measured capacity "
                                                       f"(default {DEMO.sweep})")
    p.add_argument("--slo-ttft-p90-ms", type=float, default=DEMO.slo_ttft_p90_ms,
                   help=f"the TTFT p90 target, engine ms (default {DEMO.slo_ttft_p90_ms:g})")
    p.add_argument("--speedup", type=float, default=DEMO.speedup, help="engine clock speedup")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = report.console()
    t0 = time.monotonic()
    out = Path(args.out)
    try:
        loads = capacity.parse_loads(args.sweep)
        capacity.check_slo(args.slo_ttft_p90_ms, loads)
        policies = [x.strip() for x in args.policies.split(",") if x.strip()]
        wl = mixed(DEMO.mix, seed=args.seed, max_requests=args.max_requests)
        spec = FleetSpec(backends=args.backends, tokenizer=str(DEFAULT_TOKENIZER), speedup=args.speedup)
        console.print(f"kvrouter demo: {wl.num_requests} requests of {wl.name}, {args.backends} simulated engines, "
                      f"loads {', '.join(f'{x:g}x' for x in loads)} of round_robin's measured capacity, "
                      f"policies {', '.join(policies)}")
        results = bench.run_bench(bench.BenchOptions(
            out, wl, spec, policies, args.speedup, None, None, progress=not args.quiet, sweep=loads,
            slo_ttft_p90_ms=args.slo_ttft_p90_ms, title=f"{wl.name}, {args.backends} engines"))
    except (WorkloadError, FleetError, ValueError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        return 2
    cap = results["capacity_at_slo"]
    console.print(report.capacity_table(cap, f"capacity at TTFT p90 ≤ {args.slo_ttft_p90_ms:g} ms "
                                             f"(round_robin's measured capacity {results['meta']['capacity_req_per_s']} "
                                             "req/s = load 1)"))
    line = capacity.headline(cap)
    if line:
        console.print(line + ".")
    console.print(f"report: {out / 'report.md'}  results: {out / 'results.json'}  plot: {out / 'capacity.png'}  "
                  f"({time.monotonic() - t0:.0f} s)")
    return 0 if all(r["completed"] for r in results["runs"]) else 1
