"""Capacity at SLO: the sweep's contract keys, how capacity is read off the curve, and one real sweep."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from loadtest import capacity
from loadtest.capacity import SWEEP_KEYS
from support import KVROUTER, REPO


def point(policy: str, offered: float, p90_ms: float | None, errors: int = 0, load: float = 1.0) -> dict[str, Any]:
    return {"policy": policy, "target_load": load, "offered_req_per_s": offered, "throughput_req_per_s": offered,
            "ttft_p50_ms": p90_ms, "ttft_p90_ms": p90_ms, "ttft_p99_ms": p90_ms, "engine_ttft_p90_ms": p90_ms,
            "cached_ratio": 0.5, "errors": errors}


def test_a_sweep_point_has_exactly_the_contract_keys_in_engine_ms() -> None:
    run = {"policy": "kv_aware", "requests_per_s": 3.5, "ttft_s": {"p50": 0.1, "p90": 0.25, "p99": 0.5, "mean": 0.2},
           "engine_ttft_s": {"p50": 0.05, "p90": 0.2, "p99": 0.4}, "cached_ratio": 0.6, "errors": 2, "requests": 90}
    p = capacity.sweep_point(run, 1.6, 4.0)
    assert tuple(p) == SWEEP_KEYS
    assert p == {"policy": "kv_aware", "target_load": 1.6, "offered_req_per_s": 4.0, "throughput_req_per_s": 3.5,
                 "ttft_p50_ms": 100.0, "ttft_p90_ms": 250.0, "ttft_p99_ms": 500.0, "engine_ttft_p90_ms": 200.0,
                 "cached_ratio": 0.6, "errors": 2}


def test_capacity_interpolates_linearly_between_the_points_around_the_crossing() -> None:
    pts = [point("rr", 2.0, 400), point("rr", 4.0, 800), point("rr", 6.0, 2000), point("rr", 8.0, 9000)]
    # 1000 ms lies a sixth of the way from 800 ms (4 req/s) to 2000 ms (6 req/s).
    c = capacity.capacity(list(reversed(pts)), 1000)
    assert c.req_per_s == pytest.approx(4.0 + 2.0 / 6) and not c.lower_bound
    # Exactly on the SLO counts as within it.
    assert capacity.capacity(pts, 800).req_per_s == pytest.approx(4.0)


def test_capacity_is_read_at_the_highest_load_within_the_slo() -> None:
    """A dip over the SLO and back (noise) does not cut the curve short: the highest rate within it counts."""
    pts = [point("rr", 1.0, 300), point("rr", 2.0, 1200), point("rr", 3.0, 900), point("rr", 4.0, 1900)]
    assert capacity.capacity(pts, 1000).req_per_s == pytest.approx(3.0 + 100 / 1000)


def test_meeting_the_slo_at_every_load_gives_the_last_rate_as_a_lower_bound() -> None:
    c = capacity.capacity([point("kv", 2.0, 100), point("kv", 6.0, 300), point("kv", 4.0, 200)], 1000)
    assert c == capacity.Capacity(6.0, True)


def test_meeting_the_slo_at_no_load_gives_zero() -> None:
    assert capacity.capacity([point("rr", 2.0, 1500), point("rr", 4.0, 3000)], 1000) == capacity.Capacity(0.0, False)
    assert capacity.capacity([point("rr", 2.0, None, errors=30), point("rr", 4.0, None, errors=30)], 1000).req_per_s == 0


def test_a_point_that_lost_requests_does_not_meet_the_slo() -> None:
    pts = [point("rr", 2.0, 400), point("rr", 4.0, 500, errors=1)]
    # Within the SLO by latency, but a request never got its first token: capacity stops at 2 req/s,
    # with no latency crossing to interpolate towards.
    assert capacity.capacity(pts, 1000) == capacity.Capacity(2.0, False)
    assert not capacity.meets_slo(pts[1], 1000) and capacity.meets_slo(pts[0], 1000)


def test_capacity_at_slo_keys_each_policy_and_peer_with_its_ratio_to_round_robin() -> None:
    sweep = [point("round_robin", 2.0, 500), point("kv_aware", 2.0, 200), point("vllm-router:kv_aware", 2.0, 300),
             point("round_robin", 4.0, 1500), point("kv_aware", 4.0, 400), point("vllm-router:kv_aware", 4.0, 1100)]
    cap = capacity.capacity_at_slo(sweep, 1000.0)
    assert list(cap) == ["slo_ttft_p90_ms", "round_robin", "kv_aware", "vllm-router:kv_aware"]
    assert cap["slo_ttft_p90_ms"] == 1000.0
    assert cap["round_robin"] == {"req_per_s": 3.0, "lower_bound": False, "vs_round_robin": 1.0}
    assert cap["kv_aware"] == {"req_per_s": 4.0, "lower_bound": True, "vs_round_robin": pytest.approx(4 / 3, abs=1e-4)}
    assert cap["vllm-router:kv_aware"] == {"req_per_s": 3.75, "lower_bound": False, "vs_round_robin": 1.25}
    # No ratio to a baseline that served nothing within the SLO, nor without one.
    none = capacity.capacity_at_slo([point("round_robin", 2.0, 5000), point("kv_aware", 2.0, 100)], 1000.0)
    assert none["kv_aware"]["vs_round_robin"] is None
    assert capacity.capacity_at_slo([point("kv_aware", 2.0, 100)], 1000.0)["kv_aware"]["vs_round_robin"] is None


def test_the_demo_sentence_states_both_capacities_and_their_ratio() -> None:
    cap = {"slo_ttft_p90_ms": 1500.0, "round_robin": {"req_per_s": 4.0, "lower_bound": False, "vs_round_robin": 1.0},
           "kv_aware": {"req_per_s": 9.0, "lower_bound": False, "vs_round_robin": 2.25}}
    assert capacity.headline(cap) == ("kv_aware serves 9.00 req/s within TTFT p90 ≤ 1500 ms; "
                                      "round_robin serves 4.00 (2.25×)")
    cap["kv_aware"]["lower_bound"] = True
    assert "serves at least 9.00 req/s" in capacity.headline(cap) and "(at least 2.25×)" in capacity.headline(cap)
    cap["round_robin"]["req_per_s"] = 0.0
    assert capacity.headline(cap).endswith("round_robin serves 0.00 (round_robin meets the SLO at no load of the sweep)")
    assert capacity.headline({"slo_ttft_p90_ms": 1.0}) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--sweep", "1,x", "--slo-ttft-p90-ms", "500"], "comma-separated numbers"),
    (["--sweep", "2,1", "--slo-ttft-p90-ms", "500"], "strictly increasing"),
    (["--sweep", "1.5", "--slo-ttft-p90-ms", "500"], "at least two loads"),
    (["--sweep", "0,1", "--slo-ttft-p90-ms", "500"], "> 0"),
    (["--slo-ttft-p90-ms", "500"], "give --sweep too"),
    (["--sweep", "1,2"], "needs --slo-ttft-p90-ms"),
    (["--sweep", "1,2", "--slo-ttft-p90-ms", "-5"], "> 0"),
    (["--sweep", "1,2", "--slo-ttft-p90-ms", "500", "--target-load", "0.8"], "drop --target-load"),
])
def test_bad_sweep_arguments_are_refused_before_anything_starts(tmp_path: Path, argv: list[str], message: str) -> None:
    from loadtest import bench

    p = argparse.ArgumentParser()
    bench.configure(p)
    with pytest.raises(ValueError, match=message):
        bench.options_from_args(p.parse_args(["--out", str(tmp_path), "--max-requests", "5", *argv]))


def test_a_bad_sweep_is_one_line_on_the_command_line(tmp_path: Path) -> None:
    r = subprocess.run([*KVROUTER, "bench", "--out", str(tmp_path), "--sweep", "1,two", "--slo-ttft-p90-ms", "500"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --sweep wants comma-separated numbers such as 0.8,1.2,2, got '1,two'"]
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_a_sweep_writes_the_capacity_contract_report_and_plot(tmp_path: Path) -> None:
    """Two loads, two policies, 2 engines. The SLO is far above any TTFT so the outcome is known
    on a loaded machine too: both policies meet it everywhere, so each capacity is the highest
    load's offered rate, as a lower bound."""
    out = tmp_path / "sweep"
    r = subprocess.run(
        [*KVROUTER, "bench", "--out", str(out), "--workload", "synthetic", "--backends", "2", "--max-requests", "16",
         "--policies", "round_robin,kv_aware", "--speedup", "8", "--rate-scale", "2", "--sweep", "1,3",
         "--slo-ttft-p90-ms", "1e9", "--quiet"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    meta, sweep, cap = results["meta"], results["sweep"], results["capacity_at_slo"]
    assert [(p["policy"], p["target_load"]) for p in sweep] == [
        ("round_robin", 1.0), ("kv_aware", 1.0), ("round_robin", 3.0), ("kv_aware", 3.0)]
    for p in sweep:
        assert tuple(p) == SWEEP_KEYS and p["errors"] == 0
        # Loads are multiples of --rate-scale: the trace's rate x 2 x load, the same for every policy.
        assert p["offered_req_per_s"] == pytest.approx(meta["trace_rate_per_s"] * 2 * p["target_load"], rel=0.01)
        assert p["ttft_p50_ms"] <= p["ttft_p90_ms"] <= p["ttft_p99_ms"] and p["throughput_req_per_s"] > 0
    assert cap == capacity.capacity_at_slo(sweep, 1e9)
    last = sweep[-1]["offered_req_per_s"]
    for policy in ("round_robin", "kv_aware"):
        assert cap[policy] == {"req_per_s": last, "lower_bound": True, "vs_round_robin": 1.0}
    # The single-load contract still holds: every policy at every load is a run, labelled with its load.
    assert [(x["policy"], x["target_load"]) for x in results["runs"]] == [(p["policy"], p["target_load"]) for p in sweep]
    assert all(x["requests"] == 16 and "backend_requests" in x for x in results["runs"])
    md = (out / "report.md").read_text()
    assert "## Capacity at SLO" in md and "| kv_aware | ≥ " in md and "![capacity.png](capacity.png)" in md
    png = (out / "capacity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
