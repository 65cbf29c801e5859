"""kvrouter replay against a real simulated engine: streaming metrics, usage, sessions, errors."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import workloads as w
from loadtest.replay import percentiles, replay
from support import KVROUTER, QWEN3_DIR, REPO, Proc, free_port, free_ports, wait_http

MOONCAKE = REPO / "loadtest" / "data" / "traces" / "mooncake_conversation_head1500.jsonl"
SHAREGPT = REPO / "loadtest" / "data" / "traces" / "sharegpt_multiturn_150.json"
MODEL = "sim-model"
SPEEDUP = 20.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One simulated engine, engine clock 20x faster than wall time."""
    d = tmp_path_factory.mktemp("replay-sim")
    http, zmq = free_ports(1), free_port()
    args = [*KVROUTER, "sim", "--port", str(http), "--model", MODEL, "--tokenizer", str(QWEN3_DIR),
            "--kv-events-port", str(zmq), "--speedup", str(SPEEDUP), "--hash-seed", "0"]
    with Proc(args, d / "sim.log") as proc:
        wait_http(f"http://127.0.0.1:{http}/health", timeout=60, proc=proc.popen)
        yield f"http://127.0.0.1:{http}"


def test_percentiles_match_numpy_linear() -> None:
    import numpy as np

    xs = [5.0, 1.0, 3.0, 2.0, 10.0, 7.0]
    got = percentiles(xs)
    for k, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert got[k] == pytest.approx(float(np.percentile(xs, q)))
    assert got["mean"] == pytest.approx(np.mean(xs))
    assert percentiles([])["p50"] is None


def test_mooncake_slice_streams_and_reports_usage(engine: str) -> None:
    wl = w.load_mooncake(MOONCAKE, max_requests=12, length_scale=0.125, output_scale=0.1)
    res = replay(wl, engine, MODEL, speedup=SPEEDUP, time_scale=SPEEDUP)
    s = res.summary()
    assert s["requests"] == 12 and s["errors"] == 0, [r.error for r in res.records]
    for rec, turn in zip(sorted(res.records, key=lambda r: int(r.session_id[3:])), wl.turns()):
        assert rec.prompt_tokens == len(turn.body["prompt"])
        assert rec.output_tokens == turn.body["max_tokens"]
        assert 0 < rec.ttft_s <= rec.e2e_s
        # The simulator's own TTFT (engine seconds) fits inside what the client saw (wall x speedup).
        assert rec.engine_ttft_s is not None and 0 < rec.engine_ttft_s <= rec.ttft_s * SPEEDUP
        assert len(rec.itl_s) == rec.output_tokens - 1 or rec.output_tokens == 1
    # Every request shares hash id 0 (512 tokens at scale 1, 64 here): later ones hit it.
    assert s["cached_tokens"] > 0
    assert s["backend_requests"] == {"-": 12}
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p90"] <= s["ttft_s"]["p99"]
    assert s["output_tokens_per_s"] > 0


def test_open_loop_keeps_the_trace_clock(engine: str) -> None:
    wl = w.load_mooncake(MOONCAKE, max_requests=30, length_scale=0.05, output_scale=0.02)
    res = replay(wl, engine, MODEL, speedup=SPEEDUP * 2)
    t0 = wl.sessions[0].start_s
    want = {s.session_id: (s.start_s - t0) / (SPEEDUP * 2) for s in wl.sessions}
    for r in res.records:
        assert r.sent_s == pytest.approx(want[r.session_id], abs=0.25)


def test_sessions_wait_for_the_previous_answer_closed_loop(engine: str) -> None:
    wl = w.load_sharegpt(SHAREGPT, max_requests=16, think_s=2.0, max_output_tokens=8)
    res = replay(wl, engine, MODEL, speedup=SPEEDUP, concurrency=3)
    assert res.summary()["errors"] == 0
    by: dict[str, list] = {}
    for r in res.records:
        by.setdefault(r.session_id, []).append(r)
    multi = [rs for rs in by.values() if len(rs) > 1]
    assert multi
    for rs in multi:
        rs.sort(key=lambda r: r.turn)
        for a, b in zip(rs, rs[1:]):
            assert b.sent_s >= a.sent_s + a.e2e_s
    # Turn 2 re-sends turn 1 as history: the engine reuses it.
    assert sum(r.cached_tokens for rs in multi for r in rs[1:]) > 0


def test_errors_are_counted_not_raised(engine: str) -> None:
    wl = w.load_mooncake(MOONCAKE, max_requests=3, length_scale=0.05, output_scale=0.02)
    bad_model = replay(wl, engine, "no-such-model", speedup=1000).summary()
    assert bad_model["errors"] == 3 and bad_model["completed"] == 0
    dead = replay(wl, f"http://127.0.0.1:{free_port()}", MODEL, speedup=1000).summary()
    assert dead["errors"] == 3
    assert dead["ttft_s"]["p50"] is None


def test_cli_writes_the_contract_json(engine: str, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    recs = tmp_path / "records.jsonl"
    r = subprocess.run(
        [*KVROUTER, "replay", str(MOONCAKE), "--target", engine, "--model", MODEL, "--max-requests", "6",
         "--speedup", str(SPEEDUP), "--sim-speedup", str(SPEEDUP), "--length-scale", "0.05", "--output-scale", "0.05",
         "--output", str(out), "--records", str(recs), "--quiet"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    for key in ("requests", "errors", "output_tokens_per_s", "prompt_tokens", "cached_tokens", "backend_requests"):
        assert key in s
    for key in ("ttft_s", "e2e_s", "itl_s"):
        assert set(s[key]) == {"p50", "p90", "p99", "mean"}
    assert s["requests"] == 6 and s["errors"] == 0
    assert len(recs.read_text().splitlines()) == 6
    assert "ttft ms" in r.stdout


def test_cli_bad_trace_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    r = subprocess.run([*KVROUTER, "replay", str(bad), "--target", "http://127.0.0.1:1", "--model", MODEL,
                        "--format", "mooncake"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2
    assert "no usable request" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_summary_splits_the_noisy_tenant_from_the_others() -> None:
    """Sessions that name a tenant (the mixed workload's ``noisy_tenant``) are summarised as
    tenant-0 against the others: TTFT p90 of those served, and the 429s each got."""
    from loadtest.replay import RequestRecord, summarize

    def rec(sid: str, ttft: float | None, status: int = 200) -> RequestRecord:
        return RequestRecord(sid, 0, 0.0, ok=status == 200, status=status, ttft_s=ttft)

    records = [rec(f"mx-chat-{i}@tenant-0", 1.0 + i) for i in range(10)] + [rec("mx-rag-90@tenant-0", None, 429)]
    records += [rec(f"mx-agent-{i}@tenant-{1 + i % 3}", 0.1 * (i + 1)) for i in range(10)]
    tenants = summarize(records, wall_s=10.0, time_scale=2.0)["tenants"]
    assert tenants["tenant-0"]["requests"] == 11 and tenants["tenant-0"]["rejected_429"] == 1
    assert tenants["tenant-0"]["completed"] == 10 and tenants["others"]["completed"] == 10
    assert tenants["others"]["ttft_s"]["p90"] == pytest.approx(2 * percentiles([0.1 * (i + 1) for i in range(10)])["p90"])
    assert "tenants" not in summarize([rec("s1", 0.5)], wall_s=1.0)
