"""Locust headless against real processes: CSVs with TTFT as its own metric, and the policy comparison."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest

from loadtest.locust_runner import read_stats
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
