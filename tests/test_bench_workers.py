"""``kvrouter bench --router-workers`` and ``--router-replicas`` end to end on a tiny synthetic workload.

Real processes: the simulated fleet, ``kvrouter serve`` with 2 workers, or redis-server,
``kvrouter indexer`` and 2 replicas on its index, or 2 replicas each on its own index. Each run must record its router shape in
results.json and report.md, complete every request, and (replicas) send requests through
every replica.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from support import KVROUTER, REPO

pytestmark = pytest.mark.slow

TINY = ["--workload", "synthetic", "--backends", "2", "--policies", "kv_aware", "--max-requests", "20",
        "--speedup", "5", "--quiet"]


def _bench(out: Path, *flags: str) -> dict:
    r = subprocess.run([*KVROUTER, "bench", "--out", str(out), *TINY, *flags],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def _all_completed(results: dict) -> dict:
    [run] = results["runs"]
    assert run["policy"] == "kv_aware"
    assert run["requests"] == 20 and run["completed"] == 20 and run["errors"] == 0
    assert sum(run["engine_requests"].values()) == 20
    return run


def test_two_workers_are_recorded_and_complete_every_request(tmp_path: Path) -> None:
    results = _bench(tmp_path, "--router-workers", "2", "--router-setting", "expose_decision_headers=true",
                     "--router-tuning", "kv_aware.speculative_ttl_s=1.5")
    meta = results["meta"]
    assert (meta["router_workers"], meta["router_replicas"]) == (2, 1)
    assert meta["router_settings"] == {"expose_decision_headers": True}
    assert meta["router_tuning"] == {"kv_aware": {"speculative_ttl_s": 1.5}}
    log = (tmp_path / "logs" / "kv_aware" / "router-kv_aware.log").read_text()
    assert "lab tuning in effect (--tuning, not the config): {'kv_aware': {'speculative_ttl_s': 1.5}}" in log, log[-2000:]
    _all_completed(results)
    cfg = (tmp_path / "logs" / "kv_aware" / "router-kv_aware.yaml").read_text()
    assert "workers: 2" in cfg and "expose_decision_headers: true" in cfg
    md = (tmp_path / "report.md").read_text()
    assert "- router_workers: 2" in md and "- router_replicas: 1" in md


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (make redis)")
@pytest.mark.parametrize("index", ["redis", "memory"])
def test_two_replicas_share_the_requests(tmp_path: Path, index: str) -> None:
    """On one Redis index fed by ``kvrouter indexer`` (the default for replicas), or each on
    its own in-memory index fed by the engines' events (``--router-index memory``), Redis
    then carrying only the fleet-state log."""
    results = _bench(tmp_path, "--router-replicas", "2", *(["--router-index", "memory"] if index == "memory" else []))
    meta = results["meta"]
    assert (meta["router_workers"], meta["router_replicas"]) == (1, 2)
    assert meta["router_index"].startswith("memory per replica" if index == "memory" else "redis")
    run = _all_completed(results)
    # Both replicas routed (sessions round-robin), and between them every request (+ the decision probe's).
    assert len(run["replica_decisions"]) == 2 and all(n > 0 for n in run["replica_decisions"])
    assert sum(run["replica_decisions"]) >= 20
    # Every decision was committed to the replicas' fleet-state log in order,
    # and the time that took is reported by stage.
    sequenced = run["sequenced_decisions"]
    assert sum(sequenced.values()) >= 20 and sequenced.get("failed", 0) == 0, sequenced
    assert set(run["sequence_ms"]) == {"wait", "commit"} and run["sequence_ms"]["commit"] > 0
    # kv_aware found cache through the index the engines' events fed.
    assert run["cached_tokens"] > 0
    assert "- router_replicas: 2" in (tmp_path / "report.md").read_text()
    logs = tmp_path / "logs" / "kv_aware"
    configs = [yaml.safe_load((logs / f"router-kv_aware-{i}.yaml").read_text()) for i in range(2)]
    if index == "memory":
        assert not (logs / "indexer.yaml").exists()
        assert all(c["index"] == "memory" and c["router"]["fleet_state"].startswith("redis://") for c in configs)
    else:
        assert (logs / "indexer.yaml").exists()
        assert all(c["index"].startswith("redis://") for c in configs)


def test_router_flags_are_checked() -> None:
    from loadtest.bench_replicas import parse_settings
    from loadtest.workloads import WorkloadError

    assert parse_settings([]) == {}
    assert parse_settings(["expose_decision_headers=true", "health_interval_s=0.5"]) == {
        "expose_decision_headers": True, "health_interval_s": 0.5}
    for bad, msg in ((["nope=1"], "nope"), (["expose_decision_headers=maybe"], "expose_decision_headers"),
                     (["workers=2"], "--router-workers"), (["x"], "KEY=VALUE")):
        with pytest.raises(WorkloadError, match=msg):
            parse_settings(bad)


def test_tuning_flags_nest_and_are_checked() -> None:
    from loadtest.bench_replicas import parse_tuning
    from loadtest.workloads import WorkloadError

    assert parse_tuning([]) == {}
    assert parse_tuning(["kv_aware.speculative_ttl_s=1.5", "defer_cold_prompts=false"]) == {
        "kv_aware": {"speculative_ttl_s": 1.5}, "defer_cold_prompts": False}
    for bad, msg in ((["nope=1"], "nope"), (["kv_aware.cpu_tier=2"], "kv_aware.cpu_tier"),
                     (["kv_aware.nope=1"], "kv_aware.nope"), (["x"], "KEY=VALUE")):
        with pytest.raises(WorkloadError, match=msg):
            parse_tuning(bad)
