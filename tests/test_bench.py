"""kvrouter bench end to end on a Mooncake slice: calibrated load, contract outputs, kv_aware vs round_robin."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from loadtest.report import imbalance
from support import KVROUTER, REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    r = subprocess.run(
        [*KVROUTER, "bench", "--out", str(out), "--workload", "mooncake", "--backends", "4",
         "--policies", "round_robin,kv_aware", "--max-requests", "400", "--speedup", "5", "--target-load", "0.8",
         "--length-scale", "0.125", "--output-scale", "0.05", "--quiet"],
        capture_output=True, text=True, timeout=420, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kv_aware" in r.stdout and "report:" in r.stdout
    return out


def test_results_json_has_the_contract_shape(bench_out: Path) -> None:
    results = json.loads((bench_out / "results.json").read_text())
    runs = results["runs"]
    assert [r["policy"] for r in runs] == ["round_robin", "kv_aware"]
    for r in runs:
        for key in ("requests", "errors", "output_tokens_per_s", "prompt_tokens", "cached_tokens"):
            assert key in r
        for key in ("ttft_s", "e2e_s"):
            assert set(r[key]) >= {"p50", "p90", "p99", "mean"}
        assert r["requests"] == 400 and r["errors"] == 0
        assert set(r["backend_requests"]) == {f"engine-{i}" for i in range(4)}
        assert sum(r["backend_requests"].values()) == 400
        # CPU per request of the three processes sharing the machine, each measured, not zero.
        cpu = r["cpu_ms_per_request"]
        assert set(cpu) == {"router", "engines", "client"} and all(v > 0 for v in cpu.values()), cpu
        # Every decision has a reason, counted by the router (the warm-up probe adds its own).
        assert sum(r["decision_reasons"].values()) >= 400
    assert set(runs[0]["decision_reasons"]) == {"round_robin"}
    assert "cache_hit" in runs[1]["decision_reasons"]
    # The harness starts replaying once the router follows every engine's event stream.
    assert "no_events" not in runs[1]["decision_reasons"]
    meta = results["meta"]
    assert meta["target_load"] == 0.8 and meta["capacity_req_per_s"] > 0
    assert meta["offered_rate_per_s"] == pytest.approx(0.8 * meta["capacity_req_per_s"], rel=0.01)


def test_report_and_plots_are_written(bench_out: Path) -> None:
    md = (bench_out / "report.md").read_text()
    assert "| round_robin |" in md and "| kv_aware |" in md and "TTFT p90" in md
    assert "Routing decisions by reason" in md and "- kv_aware: " in md and "cache_hit " in md
    for png in ("ttft_cdf.png", "backend_load.png", "cached_ratio.png"):
        data = (bench_out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_kv_aware_beats_round_robin_on_the_mooncake_slice(bench_out: Path) -> None:
    """More cache reuse than round_robin, never more than the infinite-cache ideal, and no pile-up on one engine.

    TTFT is reported (client and engine side) but not asserted: on a shared two-core
    machine the client-side TTFT is dominated by the harness's own CPU queueing,
    multiplied by the speedup, and the gap between policies on a 400-request slice
    is within the run-to-run noise (see the bench report in docs/).
    """
    runs = {r["policy"]: r for r in json.loads((bench_out / "results.json").read_text())["runs"]}
    rr, kv = runs["round_robin"], runs["kv_aware"]
    assert kv["cached_ratio"] > rr["cached_ratio"]
    assert kv["cached_ratio"] <= kv["ideal_cached_ratio"]
    # No pile-up (all on one engine is 4.0). Not request-count balance: kv_aware balances queued
    # prefill tokens, and sessions follow their cache, so counts spread unevenly (1.29 here once).
    assert imbalance(kv["backend_requests"]) <= 1.5
    for r in (rr, kv):
        assert r["engine_ttft_s"]["p90"] is not None and r["engine_ttft_mean_s"] > 0
        # Every request's TTFT is at least its floor (ideal cache, idle engine), so every quantile is too.
        assert 0 < r["ttft_floor_s"]["p90"] <= r["ttft_s"]["p90"]
    assert "no router can beat" in (bench_out / "report.md").read_text()


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    from loadtest.fleet import histogram_quantile

    buckets = {0.1: 0.0, 0.5: 50.0, 1.0: 100.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.9)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.99, {1.0: 1.0, float("inf"): 10.0}) == 1.0
    assert histogram_quantile(0.5, {}) is None


def test_kv_weights_from_the_command_line_are_validated() -> None:
    from loadtest.bench import parse_weights
    from loadtest.workloads import WorkloadError

    assert parse_weights([]) is None
    assert parse_weights(["decode=0", " prefill = 0.8"]) == {"decode": 0.0, "prefill": 0.8}
    for bad in (["nope=1"], ["decode=x"], ["decode"], ["prefill=-1"], ["share_cap=1.2"]):
        with pytest.raises(WorkloadError, match="--kv-weight"):
            parse_weights(bad)


def test_repeats_fold_into_medians() -> None:
    from loadtest.report import median_run

    reps = [
        {"policy": "kv_aware", "requests": 10, "completed": 10, "errors": 0, "cached_ratio": 0.5,
         "ttft_s": {"p90": 0.3}, "engine_ttft_s": {"p90": None}, "load_imbalance": 1.1, "decision_reasons": {"a": 4}},
        {"policy": "kv_aware", "requests": 10, "completed": 9, "errors": 1, "cached_ratio": 0.9,
         "ttft_s": {"p90": 0.1}, "engine_ttft_s": {"p90": 0.2}, "load_imbalance": 1.3, "decision_reasons": {"a": 6}},
        {"policy": "kv_aware", "requests": 10, "completed": 10, "errors": 0, "cached_ratio": 0.6,
         "ttft_s": {"p90": 9.0}, "engine_ttft_s": {"p90": 0.4}, "load_imbalance": 1.2, "decision_reasons": {"a": 5}},
    ]
    m = median_run(reps)
    # One slow repeat (p90 9 s) does not move the median; a repeat that could not measure is left out.
    assert m["ttft_s"]["p90"] == 0.3 and m["engine_ttft_s"]["p90"] == pytest.approx(0.3)
    assert m["cached_ratio"] == 0.6 and m["load_imbalance"] == 1.2 and m["decision_reasons"] == {"a": 5}
    assert (m["requests"], m["completed"], m["errors"]) == (30, 29, 1)
    assert m["policy"] == "kv_aware" and m["repeats"]["ttft_p90"] == [0.3, 0.1, 9.0]
    assert median_run(reps[:1]) is reps[0]


def test_repeats_run_interleaved_and_report_medians(tmp_path: Path) -> None:
    r = subprocess.run(
        [*KVROUTER, "bench", "--out", str(tmp_path), "--workload", "synthetic", "--backends", "2",
         "--policies", "round_robin,kv_aware", "--max-requests", "30", "--speedup", "5", "--repeats", "2", "--quiet"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [x["policy"] for x in results["runs"]] == ["round_robin", "kv_aware"]
    for run in results["runs"]:
        assert run["requests"] == 60 and len(run["repeats"]["ttft_p90"]) == 2
        assert run["ttft_s"]["p90"] == pytest.approx(sum(run["repeats"]["ttft_p90"]) / 2)
    for rep in ("rep1", "rep2"):
        records = [json.loads(line) for line in (tmp_path / "logs" / rep / "records-kv_aware.jsonl").read_text().splitlines()]
        # Each record names its request's access-log line in the router's log, exactly.
        logged = {json.loads(line)["request_id"] for line in (tmp_path / "logs" / rep / "kv_aware" / "router-kv_aware.log").read_text().splitlines()
                  if line.startswith("{") and '"/v1/' in line}
        assert len(records) == 30 and all(r["request_id"] in logged for r in records)
    assert "median of its repeats" in (tmp_path / "report.md").read_text()
