"""``kvrouter bench --peer vllm-router[:POLICY]``: the Rust vllm-router as more columns of the bench.

vllm-router is in the ``test`` extra (``kvrouter[peers]``), so these tests run in CI;
they are not skipped when it is missing, they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import KVROUTER, REPO

pytestmark = pytest.mark.slow

REQUESTS = 20
TINY = ["--workload", "mooncake", "--backends", "2", "--max-requests", str(REQUESTS), "--speedup", "20",
        "--length-scale", "0.125", "--output-scale", "0.05", "--quiet"]


def test_peer_runs_are_columns_with_backend_counts_from_the_engines(tmp_path: Path) -> None:
    """Each peer policy replays the same workload on its own fleet; vllm-router names no backend,
    so its per-backend counts come from the engines' own request counters and must add up."""
    r = subprocess.run(
        [*KVROUTER, "bench", "--out", str(tmp_path), *TINY, "--policies", "kv_aware",
         "--peer", "vllm-router:cache_aware,vllm-router:kv_aware"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = {x["policy"]: x for x in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert list(runs) == ["kv_aware", "vllm-router:cache_aware", "vllm-router:kv_aware"]
    for label in ("vllm-router:cache_aware", "vllm-router:kv_aware"):
        run = runs[label]
        assert run["requests"] == REQUESTS and run["completed"] == REQUESTS and run["errors"] == 0
        assert set(run["backend_requests"]) == {"engine-0", "engine-1"}
        assert sum(run["backend_requests"].values()) == REQUESTS
        assert run["load_imbalance"] is not None
        assert run["router_overhead_ms"] is None and run["router_decision_probe_ms"] is None
        assert run["router_metrics"] == {}
        assert f"| {label} |" in (tmp_path / "report.md").read_text()
    assert runs["kv_aware"]["router_overhead_ms"] is not None
    assert "vllm-router:cache_aware" in r.stdout


def _venv_without_vllm_router(root: Path) -> Path:
    """This venv's interpreter and packages under another prefix whose bin/ holds no vllm-router."""
    venv = Path(sys.prefix)
    assert (venv / "pyvenv.cfg").exists(), "run the tests in a venv (make test does)"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(venv / "bin" / "python")
    shutil.copy(venv / "pyvenv.cfg", root / "pyvenv.cfg")
    (root / "lib").symlink_to(venv / "lib")
    return root / "bin" / "python"


def test_peer_without_vllm_router_installed_names_the_extra_and_exits_2(tmp_path: Path) -> None:
    python = _venv_without_vllm_router(tmp_path / "venv")
    r = subprocess.run(
        [str(python), "-m", "router.cli", "bench", "--out", str(tmp_path / "out"), *TINY, "--peer", "vllm-router"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "pip install 'kvrouter[peers]'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "results.json").exists()


def test_unknown_peer_policy_is_a_usage_error() -> None:
    r = subprocess.run([*KVROUTER, "bench", "--out", "/nonexistent", *TINY, "--peer", "vllm-router:least_loaded"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "cache_aware, kv_aware" in r.stderr and "Traceback" not in r.stderr
