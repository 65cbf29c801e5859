"""Locust headless against real processes: CSVs with TTFT as its own metric, and the policy comparison."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest

from loadtest.capacity import Capacity, StepRamp
from loadtest.locust_runner import read_stats, read_steps
from support import KVROUTER, REPO

pytestmark = pytest.mark.slow


def test_loadtest_runs_locust_per_policy_on_a_two_engine_fleet(tmp_path: Path) -> None:
    out = tmp_path / "lt"
    r = subprocess.run(
        [*KVROUTER, "loadtest", "--out", str(out), "--policies", "round_robin,kv_aware", "--backends", "2",
         "--users", "4", "--spawn-rate", "4", "--run-time", "6s", "--speedup", "10", "--think-time", "1",
         "--max-output-tokens", "24", "--user-classes", "MultiTurnChatUser", "SharedPrefixUser"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for policy in ("round_robin", "kv_aware"):
        for suffix in ("stats", "stats_history", "failures"):
            assert (out / f"{policy}_{suffix}.csv").exists()
        stats = read_stats(out / f"{policy}_stats.csv")
        e2e, ttft = stats[("POST", "/v1/chat/completions")], stats[("TTFT", "/v1/chat/completions")]
        assert e2e.requests > 0 and e2e.failures == 0
        assert ttft.requests == e2e.requests
        assert ttft.median_ms is not None and e2e.median_ms is not None and ttft.median_ms <= e2e.median_ms
    with open(out / "comparison.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [row["policy"] for row in rows] == ["round_robin", "kv_aware"]
    assert all(int(row["requests"]) > 0 for row in rows)
    assert "ttft_p90_ms" in r.stdout


def feed(ramp: StepRamp, start: float, end: float, ttfts: list[float | None]) -> None:
    """Requests finishing evenly over ``[start, end)``."""
    for i, ttft in enumerate(ttfts):
        ramp.observe(start + (end - start) * i / len(ttfts), ttft)


def test_a_ramp_adds_users_each_step_and_stops_at_the_step_over_the_slo() -> None:
    ramp = StepRamp(slo_ms=100, step_users=2, step_s=10, max_users=20)
    assert ramp.users_at(0) == 2 and ramp.users_at(9.9) == 2
    feed(ramp, 2.5, 10, [50] * 15)
    assert ramp.users_at(10) == 4
    feed(ramp, 12.5, 20, [80] * 30)
    assert ramp.users_at(20.5) == 6
    feed(ramp, 22.5, 30, [60] * 30 + [180] * 15)
    assert ramp.users_at(30) is None and ramp.done
    s1, s2, s3 = ramp.steps
    assert (s1.users, s2.users, s3.users) == (2, 4, 6)
    assert (s1.req_per_s, s2.req_per_s, s3.req_per_s) == (2.0, 4.0, 6.0)
    assert s2.ttft_p90_ms == 80 and s3.ttft_p90_ms > 100 and s3.errors == 0
    # Sustained: between step 2 (4 req/s at 80 ms) and step 3 (6 req/s at its p90), where the p90 crosses 100 ms.
    sustained = ramp.sustained()
    assert not sustained.lower_bound
    assert sustained.req_per_s == pytest.approx(4.0 + 2.0 * (100 - 80) / (s3.ttft_p90_ms - 80))


def test_a_ramp_leaves_each_steps_first_quarter_out() -> None:
    ramp = StepRamp(slo_ms=100, step_users=1, step_s=8, max_users=4)
    feed(ramp, 0, 2, [5000] * 10)  # the fleet settling to the step's users: not judged
    feed(ramp, 2, 8, [40] * 12)
    assert ramp.users_at(8) == 2
    assert ramp.steps[0].requests == 12 and ramp.steps[0].ttft_p90_ms == 40 and ramp.steps[0].req_per_s == 2.0


def test_a_ramp_warms_a_cold_fleet_up_before_judging_its_first_step() -> None:
    ramp = StepRamp(slo_ms=100, step_users=3, step_s=8, max_users=9, warmup_s=4)
    assert ramp.users_at(0) == 3 and ramp.users_at(11.9) == 3
    feed(ramp, 0, 4, [900] * 8)  # cold caches and connections: not the load's doing
    feed(ramp, 6, 12, [30] * 12)
    assert ramp.users_at(12) == 6
    (step,) = ramp.steps
    assert (step.start_s, step.end_s, step.requests, step.ttft_p90_ms) == (4, 12, 12, 30)


def test_a_failed_request_ends_the_ramp_like_a_slow_step() -> None:
    ramp = StepRamp(slo_ms=100, step_users=1, step_s=4, max_users=8)
    feed(ramp, 1, 4, [10, 10, None])
    assert ramp.users_at(4) is None
    assert ramp.steps[0].errors == 1 and ramp.sustained().req_per_s == 0


def test_a_ramp_that_never_crosses_ends_at_max_users_with_a_lower_bound() -> None:
    ramp = StepRamp(slo_ms=100, step_users=2, step_s=4, max_users=5)
    for k in range(3):
        feed(ramp, 4 * k + 1, 4 * k + 4, [20] * (3 * (k + 1)))
    # A late tick closes every step on its own window; the last step runs max_users, not 6.
    assert ramp.users_at(12.5) is None
    assert [s.users for s in ramp.steps] == [2, 4, 5]
    assert ramp.sustained() == Capacity(3.0, True)


def test_loadtest_ramps_each_policy_until_the_slo_and_reports_the_rate_sustained(tmp_path: Path) -> None:
    """An SLO far above any TTFT: every policy ramps to --max-users, so its figure is the last
    step's req/s, a lower bound, and the steps logged are exactly the ramp's."""
    out = tmp_path / "ramp"
    r = subprocess.run(
        [*KVROUTER, "loadtest", "--out", str(out), "--policies", "round_robin,kv_aware", "--backends", "2",
         "--slo-ttft-p90-ms", "1e9", "--step-users", "2", "--step-time", "4", "--max-users", "4", "--speedup", "10",
         "--think-time", "0.5", "--max-output-tokens", "16", "--user-classes", "MultiTurnChatUser"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(out / "comparison.csv") as fh:
        rows = {row["policy"]: row for row in csv.DictReader(fh)}
    assert list(rows) == ["round_robin", "kv_aware"]
    for policy, row in rows.items():
        steps = read_steps(out / f"{policy}_steps.jsonl")
        assert [s.users for s in steps] == [2, 4]
        assert all(s.requests > 0 and s.errors == 0 for s in steps), steps
        assert row["lower_bound"] == "True" and row["max_users"] == "4"
        assert float(row["sustained_rps_at_slo"]) == pytest.approx(steps[-1].req_per_s, abs=1e-3)
    png = (out / "ramp.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "sustained_rps_at_slo" in r.stdout


def test_ramp_and_fixed_load_flags_do_not_mix(tmp_path: Path) -> None:
    r = subprocess.run([*KVROUTER, "loadtest", "--out", str(tmp_path), "--slo-ttft-p90-ms", "500", "--users", "8"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "--users: not with a ramp" in r.stdout
    r = subprocess.run([*KVROUTER, "loadtest", "--out", str(tmp_path), "--step-users", "8"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "--step-users: ramp flags, which need --slo-ttft-p90-ms" in r.stdout
