"""``kvrouter demo`` (what ``make demo`` runs): the bench on the shipped Mooncake slice.

Four simulated engines, a slice of the Mooncake conversation trace offered at 80% of
the fleet's measured capacity, replayed through round_robin, least_loaded and
kv_aware; prints the comparison table and where the report and plots are. Sized to
finish in about two minutes on two cores: the slice's blocks and outputs are scaled
down (sharing between requests is kept, see :func:`loadtest.workloads.load_mooncake`)
and the engines run faster than real time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loadtest import bench, report
from loadtest.fleet import FleetError, FleetSpec
from loadtest.workloads import DEFAULT_TOKENIZER, WorkloadError, load_mooncake

MOONCAKE = bench.SAMPLE_TRACES["mooncake"]


class DEMO:
    """The demo's defaults (chosen to fit about two minutes on two cores)."""

    max_requests = 600
    speedup = 4.0
    length_scale = 0.25
    output_scale = 0.1
    cpu_offload_blocks = 65536
    """Each engine's CPU KV tier, 8x its GPU pool (vLLM's native offloading / LMCache):
    Mooncake conversations return after so much other traffic that a GPU-only prefix
    cache has evicted them; only a larger tier keeps the reuse a router can exploit."""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo-out", help="directory for report.md, results.json and PNGs (default demo-out)")
    p.add_argument("--policies", default="round_robin,least_loaded,kv_aware", help="comma-separated policies")
    p.add_argument("--backends", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--max-requests", type=int, default=DEMO.max_requests, help="requests of the Mooncake slice")
    p.add_argument("--target-load", type=float, default=0.8, help="fraction of measured capacity (default 0.8)")
    p.add_argument("--speedup", type=float, default=DEMO.speedup, help="engine clock speedup")
    p.add_argument("--length-scale", type=float, default=DEMO.length_scale, help="Mooncake block/input scale")
    p.add_argument("--output-scale", type=float, default=DEMO.output_scale, help="Mooncake output scale")
    p.add_argument("--cpu-offload-blocks", type=int, default=DEMO.cpu_offload_blocks,
                   help="CPU KV tier per engine, blocks (0 = GPU only)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = report.console()
    t0 = time.monotonic()
    out = Path(args.out)
    try:
        wl = load_mooncake(MOONCAKE, seed=args.seed, length_scale=args.length_scale, output_scale=args.output_scale,
                           max_requests=args.max_requests)
        spec = FleetSpec(backends=args.backends, tokenizer=str(DEFAULT_TOKENIZER), speedup=args.speedup,
                         cpu_offload_blocks=args.cpu_offload_blocks)
        policies = [x.strip() for x in args.policies.split(",") if x.strip()]
        console.print(f"kvrouter demo: {wl.num_requests} Mooncake requests, {args.backends} simulated engines, "
                      f"{args.target_load:.0%} of measured capacity, policies {', '.join(policies)}")
        results = bench.run_bench(bench.BenchOptions(out, wl, spec, policies, args.speedup, args.target_load, 1.0,
                                                     progress=not args.quiet, title="Mooncake slice, 4 engines"))
    except (WorkloadError, FleetError, ValueError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}")
        return 2
    meta = results["meta"]
    console.print(report.rich_table(results["runs"], f"Mooncake slice at {args.target_load:.0%} load "
                                                     f"({meta['offered_rate_per_s']} req/s offered, "
                                                     f"capacity {meta.get('capacity_req_per_s')} req/s)"))
    for line in report.comparison(results["runs"]):
        console.print(line)
    console.print(f"report: {out / 'report.md'}\nresults: {out / 'results.json'}\n"
                  f"plots: {', '.join(str(out / p) for p in ('ttft_cdf.png', 'backend_load.png', 'cached_ratio.png'))}\n"
                  f"took {time.monotonic() - t0:.0f} s")
    return 0 if all(r["completed"] for r in results["runs"]) else 1
