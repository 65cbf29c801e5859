"""Request-level observability at the router (router/http/observe.py), on a real router and simulator.

Each request gets an id (the client's, else a new one) that the engine and the client see;
streams get a TTFT; usage feeds token counters; one JSON access-log line per request on
stdout, with the decision's reason and the cached tokens the router predicted next to the
ones the engine reported."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import QWEN3_DIR, RouterProc, access_lines, metric_sum

MODEL = "qwen3"
ACCESS_FIELDS = {"request_id", "method", "path", "status", "e2e_ms", "model", "backend", "reason", "ttft_ms",
                 "prompt_tokens", "completion_tokens", "cached_tokens", "predicted_cached_tokens"}


def sim_config(sim: Any) -> dict[str, Any]:
    backends = [{"name": f"engine-{i}", "url": sim.http(i), "kv_events": sim.kv(i), "kv_replay": sim.replay(i)}
                for i in range(sim.instances)]
    return {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_seed": "0",
                        "backends": backends}],
            "router": {"policy": "kv_aware", "health_interval_s": 0.5}}


def test_ids_ttft_tokens_and_the_access_log(sim_fleet: Any, tmp_path: Path) -> None:
    sim = sim_fleet(instances=2)
    router = RouterProc("observed", sim_config(sim), tmp_path)
    try:
        prompt = "The quick brown fox jumps over the lazy dog. " * 20
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=router.url, timeout=30) as c:
            # 1. A stream with the client's id, twice: the second finds the first's prefix cached.
            usages = []
            for i in range(2):
                r = c.post("/v1/chat/completions", json=chat, headers={"x-request-id": f"client-id-{i}"})
                assert r.status_code == 200 and r.headers["x-request-id"] == f"client-id-{i}"
                usage = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")][-1]["usage"]
                usages.append(usage)
                time.sleep(0.3)  # the engine's events reach the index
            # 2. No id, not streamed: a new id, no TTFT.
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 4})
            assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
            generated = r.headers["x-request-id"]
            # 3. The router's own error, and an id it will not take (too long): a new one.
            r = c.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"x-request-id": "x" * 200})
            assert r.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
            refused = r.headers["x-request-id"]
            assert c.get("/health").headers["x-request-id"]  # probes get an id, and no log line
            metrics = c.get("/metrics").text

        lines = access_lines(router.log_path, 4)
        assert [line["request_id"] for line in lines] == ["client-id-0", "client-id-1", generated, refused]
        first, second, plain, error = lines
        assert set(second) == ACCESS_FIELDS
        for line, usage in zip((first, second), usages):
            assert line["model"] == MODEL and line["backend"] in ("engine-0", "engine-1") and line["status"] == 200
            assert line["path"] == "/v1/chat/completions" and line["method"] == "POST"
            assert 0 < line["ttft_ms"] <= line["e2e_ms"]
            assert (line["prompt_tokens"], line["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
            assert line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert second["reason"] == "cache_hit" and second["backend"] == first["backend"]
        assert second["cached_tokens"] > 0 and second["predicted_cached_tokens"] == second["cached_tokens"]
        assert "ttft_ms" not in plain and plain["completion_tokens"] == 4 and plain["path"] == "/v1/completions"
        assert error["status"] == 404 and "backend" not in error and "model" not in error

        backend = first["backend"]
        assert metric_sum(metrics, "kvrouter_request_ttft_seconds_count", model=MODEL, backend=backend) == 2
        assert metric_sum(metrics, "kvrouter_request_duration_seconds_count", model=MODEL) == 3
        assert metric_sum(metrics, "kvrouter_tokens_total", model=MODEL, kind="prompt") == (
            usages[0]["prompt_tokens"] + usages[1]["prompt_tokens"] + plain["prompt_tokens"])
        assert metric_sum(metrics, "kvrouter_tokens_total", model=MODEL, kind="cached") == second["cached_tokens"]
        # Fidelity: every prediction so far was exact (the index is fresh between these requests).
        assert metric_sum(metrics, "kvrouter_cache_predictions_total", outcome="exact") == 3
        assert metric_sum(metrics, "kvrouter_cache_predictions_total", outcome="over") == 0
        assert metric_sum(metrics, "kvrouter_cache_prediction_agreement", backend=backend) == 1.0
    finally:
        router.stop()


@pytest.mark.parametrize("switch", [["--no-access-log"], []])
def test_the_access_log_can_be_switched_off(sim_fleet: Any, tmp_path: Path, switch: list[str], monkeypatch: Any) -> None:
    """``--no-access-log`` (here through ``KVROUTER_ACCESS_LOG=0``, what the flag sets for workers):
    no lines, the metrics stay."""
    sim = sim_fleet()
    env = {"KVROUTER_ACCESS_LOG": "0"} if switch else None
    router = RouterProc("switch", sim_config(sim), tmp_path, env=env)
    try:
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        assert metric_sum(metrics, "kvrouter_request_duration_seconds_count", model=MODEL) == 1
        if switch:
            time.sleep(1.0)  # long enough for a line the router wrote after the answer
            assert access_lines(router.log_path) == []
        else:
            assert len(access_lines(router.log_path, 1)) == 1
    finally:
        router.stop()


def test_json_logs_are_one_object_per_line(sim_fleet: Any, tmp_path: Path) -> None:
    """``--log-format json`` with 2 workers: every line the router writes parses as JSON; the
    log's lines name level, logger and worker, the access log's are the request lines."""
    sim = sim_fleet()
    cfg = sim_config(sim)
    router = RouterProc("json", cfg, tmp_path, extra_args=["--log-format", "json", "--workers", "2"])
    try:
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        assert access_lines(router.log_path, 1)
        deadline = time.monotonic() + 20
        while True:
            lines = [line for line in router.log().splitlines() if line.strip()]
            parsed = [json.loads(line) for line in lines]  # raises on any line that is not JSON
            logged = [p for p in parsed if "request_id" not in p]
            if {p.get("worker") for p in logged} >= {0, 1} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert logged and all({"ts", "level", "logger", "message"} <= set(p) for p in logged)
        assert {p.get("worker") for p in logged} >= {0, 1}, [p for p in logged if p.get("worker") is None][:3]
    finally:
        router.stop()


def test_a_backend_whose_cache_the_router_mispredicts_is_flagged_once(sim_fleet: Any, tmp_path: Path) -> None:
    """An engine whose KV events never arrive (the simulator drops them all) and no speculative
    memory: the router predicts nothing cached while the engine reports its hits. The agreement
    rate falls, one warning names the backend, and ``/debug/backends`` shows it."""
    sim = sim_fleet("--fault-drop-events", "1.0")
    cfg = sim_config(sim)
    router = RouterProc("mispredicted", cfg, tmp_path, tuning={"kv_aware": {"speculative_ttl_s": 0}})
    try:
        body = {"model": MODEL, "prompt": "All work and no play makes Jack a dull boy. " * 30, "max_tokens": 1}
        with httpx.Client(base_url=router.url, timeout=30) as c:
            for _ in range(70):
                assert c.post("/v1/completions", json=body).status_code == 200
            metrics = c.get("/metrics").text
            (backend,) = c.get("/debug/backends").json()["backends"]
        assert metric_sum(metrics, "kvrouter_cache_predictions_total", outcome="under") >= 69
        assert backend["cache_agreement"] < 0.5 and backend["cache_agreement_low"] is True
        assert backend["cache_predictions"] == 70
        warnings = [line for line in router.log().splitlines() if "agree with the engine's on" in line]
        assert len(warnings) == 1 and "engine-0" in warnings[0]
        lines = [line for line in access_lines(router.log_path, 71) if line["path"] == "/v1/completions"]
        predicted = [line["predicted_cached_tokens"] for line in lines if "predicted_cached_tokens" in line]
        assert len(predicted) >= 69 and set(predicted) == {0} and lines[-1]["cached_tokens"] > 0
    finally:
        router.stop()
