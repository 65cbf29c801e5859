"""The oracle: the simulator predicts its own first token, the oracle routes by it, real engines are refused.

The forward run (loadtest/sim/state.py) is checked against the engine it reads: the
same engine, stepped by its own scheduler, must produce the first token when predicted.
The policies run in a real ``kvrouter serve`` against a real ``kvrouter sim
--debug-state``; the bench runs the oracle like any other policy.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from indexer.hashing import BlockHasher
from loadtest.fleet import LAB_POLICIES
from loadtest.sim.engine import Engine, EngineConfig
from loadtest.sim.generation import PlannedOutput
from loadtest.sim.state import Prompt, snapshot
from loadtest.sim.world_clock import WorldClock
from support import KVROUTER, QWEN3_DIR, REPO, Proc, free_port, wait_http

MODEL = "qwen3"
HASHER = BlockHasher("sha256", 16, "0", "0.33.0")


# -- the forward run, in process -------------------------------------------------------------


def _request(engine: Engine, ids: list[int], n_out: int) -> Any:
    return engine.make_request(ids, PlannedOutput([7] * n_out, "length"), asyncio.Queue())


def _step(engine: Engine) -> bool:
    """One step as Engine.run chains them (engine time only: the config's speedup makes wall time vanish)."""
    work, duration = engine.schedule(engine.clock)
    engine.clock += duration
    engine.complete(work, engine.clock)
    return bool(work)


def _prompt(ids: list[int], n_out: int) -> Prompt:
    return Prompt(len(ids), HASHER.hash_blocks(ids), n_out)


@pytest.mark.parametrize(
    ("num_blocks", "max_batched", "max_seqs", "cpu_blocks"),
    [(20_000, 2048, 256, 0), (20_000, 512, 4, 0), (600, 1024, 64, 0), (300, 4096, 8, 0), (400, 1024, 16, 2000)],
    ids=["roomy", "few-seqs", "tight-pool", "tighter-pool", "cpu-tier"],
)
def test_forward_run_predicts_the_engines_own_first_token(num_blocks: int, max_batched: int, max_seqs: int,
                                                          cpu_blocks: int) -> None:
    """Random traffic with shared prefixes, chunked prefill, full batches and a full KV pool:
    asked between steps or during one, the prediction is the engine's own first token."""
    rng = random.Random(num_blocks + max_batched + max_seqs)
    cfg = EngineConfig(num_blocks=num_blocks, max_num_batched_tokens=max_batched, max_num_seqs=max_seqs,
                       cpu_offload_blocks=cpu_blocks, speedup=1e-9)
    engine = Engine(cfg, HASHER)
    prefixes = [[rng.randrange(1000, 50_000) for _ in range(n)] for n in (64, 200, 512, 512)]

    def prompt() -> list[int]:
        return rng.choice(prefixes) + [rng.randrange(1000, 50_000) for _ in range(rng.randrange(1, 600))]

    checked = 0
    for _ in range(40):
        for _ in range(rng.randrange(3)):
            engine.add(_request(engine, prompt(), rng.randrange(1, 200)))
        for _ in range(rng.randrange(4)):
            _step(engine)
        ids, n_out = prompt(), rng.randrange(1, 100)
        mid_step = rng.random() < 0.5 and bool(engine.waiting or engine.running)
        if mid_step:
            work, duration = engine.schedule(engine.clock)
            engine.in_step = (work, engine.clock + duration)
        answer = snapshot(engine, _prompt(ids, n_out), [])
        asked_at = engine.now()
        target = _request(engine, ids, n_out)
        engine.add(target)
        if mid_step:
            engine.in_step = None
            engine.clock += duration
            engine.complete(work, engine.clock)
        while target.first_token_at is None and _step(engine):
            pass
        assert target.first_token_at is not None
        assert answer["predicted_ttft_s"] == pytest.approx(target.first_token_at - asked_at, abs=1e-6)
        checked += 1
    assert checked == 40


def test_prompts_in_transit_queue_ahead_of_the_prompt() -> None:
    engine = Engine(EngineConfig(speedup=1e-9), HASHER)
    ids = list(range(1000, 3000))
    alone = snapshot(engine, _prompt(ids, 10), [])
    behind = snapshot(engine, _prompt(ids, 10), [_prompt(list(range(5000, 13_000)), 10)])
    # 8,000 tokens ahead, 8,192 per step: about their prefill longer (74.1 us per token).
    assert behind["predicted_ttft_s"] - alone["predicted_ttft_s"] == pytest.approx(8000 * 74.1e-6, rel=0.1)
    assert behind["load"]["prefill_tokens"] == 8000 and alone["load"]["in_flight"] == 0


def test_a_prefix_queued_ahead_counts_once() -> None:
    """Requests queued behind one with the same prefix will find it computed: the exact load
    charges it once, and a prompt sharing it sees it as queued (kv_aware's speculative hit, exact)."""
    engine = Engine(EngineConfig(speedup=1e-9), HASHER)
    shared = list(range(5000, 13_000))
    ahead = [_prompt(shared, 10), _prompt(shared + list(range(100, 900)), 10)]
    answer = snapshot(engine, _prompt(shared + list(range(900, 1300)), 10), ahead)
    assert answer["load"]["prefill_tokens"] == 8000 + 800
    assert answer["load"]["context_blocks"] == 500 + 550
    assert answer["queued_blocks"] == 500 and answer["cached_blocks"] == {"gpu": 0, "cpu": 0}


def test_the_forward_run_leaves_the_engine_as_it_was() -> None:
    engine = Engine(EngineConfig(num_blocks=400, speedup=1e-9), HASHER)
    for i in range(6):
        engine.add(_request(engine, list(range(i * 1000, i * 1000 + 700)), 50))
    _step(engine)
    before = (engine.bm.pool.num_free_blocks, engine.bm.reserved, len(engine.running), len(engine.waiting),
              sorted(engine.bm.pool.cached_hashes()), [r.num_computed_tokens for r in engine.running])
    snapshot(engine, _prompt(list(range(100, 900)), 20), [_prompt(list(range(9000, 9900)), 5)])
    after = (engine.bm.pool.num_free_blocks, engine.bm.reserved, len(engine.running), len(engine.waiting),
             sorted(engine.bm.pool.cached_hashes()), [r.num_computed_tokens for r in engine.running])
    assert after == before
    assert engine.bm.pool.take_events() == []


# -- the side channel over HTTP ----------------------------------------------------------------


def _ask(url: str, ids: list[int], ahead: list[tuple[int, list[int]]] = (), max_tokens: int = 8) -> dict[str, Any]:
    def prompt(p: list[int]) -> dict[str, Any]:
        return {"request": {"max_tokens": max_tokens, "ignore_eos": True}, "kind": "completion", "token_ids": p}

    body = {"prompt": prompt(ids), "ahead": [{"n": n, "prompt": prompt(p)} for n, p in ahead]}
    r = httpx.post(url + "/debug/state", json=body, timeout=30)
    assert r.status_code == 200, r.text
    (answer,) = r.json()["engines"]
    return answer


def test_the_side_channel_is_served_only_with_debug_state(sim_fleet) -> None:
    plain = sim_fleet()
    assert httpx.get(plain.http() + "/debug/state").status_code == 404
    sim = sim_fleet("--debug-state")
    info = httpx.get(sim.http() + "/debug/state").json()
    assert info["side_channel"] == "kvrouter-sim" and info["received"] == 0 and info["index"] == 0
    ids = list(range(1000, 3000))
    answer = _ask(sim.http(), ids)
    assert answer["received"] == 0 and answer["predicted_ttft_s"] > 0
    assert answer["cached_blocks"] == {"gpu": 0, "cpu": 0} and answer["queued_blocks"] == 0
    # A prompt the client counts as its 1st to this engine is in transit until the engine has
    # received one request: it queues ahead; as the 0th it arrived long ago and is ignored.
    later = _ask(sim.http(), ids, ahead=[(1, list(range(5000, 9000)))])
    assert later["predicted_ttft_s"] > answer["predicted_ttft_s"] + 0.2
    assert later["queued_blocks"] == 0 and later["load"]["in_flight"] == 1
    assert _ask(sim.http(), ids, ahead=[(0, list(range(5000, 9000)))])["load"]["in_flight"] == 0
    r = httpx.post(sim.http() + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200
    after = _ask(sim.http(), ids + list(range(200, 264)))
    assert after["received"] == 1 and after["cached_blocks"]["gpu"] == len(ids) // 16
    assert after["predicted_ttft_s"] < answer["predicted_ttft_s"] / 3


def test_the_side_channel_has_its_own_port_off_the_event_loop(sim_fleet) -> None:
    """``GET /debug/state`` names a ``state_url`` on another port (a thread of the simulator, so a
    question does not wait behind the process's token streams); it answers what the engine's
    port answers, and a bad question there gets a 400 in vLLM's error shape."""
    sim = sim_fleet("--debug-state")
    state_url = httpx.get(sim.http() + "/debug/state").json()["state_url"]
    assert state_url.endswith("/debug/state") and not state_url.startswith(sim.http())
    ids = list(range(1000, 3000))
    r = httpx.post(sim.http() + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200
    on_loop = _ask(sim.http(), ids + [7] * 40)
    off_loop = _ask(state_url.removesuffix("/debug/state"), ids + [7] * 40)
    assert off_loop["cached_blocks"] == on_loop["cached_blocks"] == {"gpu": len(ids) // 16, "cpu": 0}
    assert off_loop["received"] == on_loop["received"] == 1 and off_loop["load"] == on_loop["load"]
    bad = httpx.post(state_url, content=b'{"prompt": 5}', headers={"content-type": "application/json"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    assert httpx.post(state_url.replace("/debug/state", "/nope"), json={}, timeout=30).status_code == 404


def test_one_request_asks_every_engine_of_a_process(sim_fleet) -> None:
    sim = sim_fleet("--debug-state", instances=2)
    infos = [httpx.get(sim.http(i) + "/debug/state").json() for i in range(2)]
    assert infos[0]["process"] == infos[1]["process"] and [i["index"] for i in infos] == [0, 1]
    ids = list(range(1000, 2000))
    r = httpx.post(sim.http(1) + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200
    prompt = {"request": {"max_tokens": 4}, "kind": "completion", "token_ids": ids + [7] * 32}
    body = {"prompt": prompt, "engines": [{"index": 1, "ahead": []}, {"index": 0, "ahead": []}, {"index": 5, "ahead": []}]}
    one, zero, missing = httpx.post(sim.http(0) + "/debug/state", json=body, timeout=30).json()["engines"]
    assert (one["received"], zero["received"], missing) == (1, 0, None)
    assert one["cached_blocks"]["gpu"] == len(ids) // 16 and zero["cached_blocks"]["gpu"] == 0


def test_concurrent_questions_see_each_other_in_transit(sim_fleet) -> None:
    """Two decisions arriving within one round trip: the second question must carry the first
    prompt, sent by then, as in transit (the router sends right after ``ask`` returns, with no
    await between). Asked in parallel, both saw an idle engine and piled onto it."""
    from loadtest.policies.engine_state import SideChannel

    sim = sim_fleet("--debug-state")

    async def decide(channel: SideChannel, key: int, ids: list[int]) -> int:
        states = await channel.ask(key, ids, {"max_tokens": 8, "ignore_eos": True}, "completion")
        channel.sent(key, "e0")  # what the router does next, before any await
        return states["e0"].load.in_flight

    async def main() -> list[int]:
        channel = SideChannel({"e0": sim.http()})
        await channel.start("oracle")
        try:
            return list(await asyncio.gather(*(decide(channel, k, list(range(1000 + 97 * k, 3000 + 97 * k)))
                                                for k in range(3))))
        finally:
            await channel.aclose()

    # Nothing reaches the engine (only asked about), so each later question sees every earlier prompt.
    assert sorted(asyncio.run(main())) == [0, 1, 2]
    # In transit by id: the simulator knew every prompt from its own question.
    metrics = httpx.get(sim.http() + "/metrics").text
    (unknown,) = [line for line in metrics.splitlines() if line.startswith("kvrouter_sim:debug_state_unknown_ahead_total")]
    assert unknown.endswith(" 0.0"), unknown


# -- the policies in a real router ---------------------------------------------------------------


def _router_config(sim: Any, policy: str) -> dict[str, Any]:
    backends = [{"name": f"engine-{i}", "url": sim.http(i), "kv_events": sim.kv(i), "kv_replay": sim.replay(i)}
                for i in range(sim.instances)]
    return {"models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256",
                        "hash_seed": None, "vllm_version": "0.33.0", "backends": backends}],
            "router": {"policy": policy, "health_interval_s": 0.5}}


def _serve(sim: Any, policy: str, tmp_path: Path) -> Proc:
    path = tmp_path / f"router-{policy}.yaml"
    path.write_text(yaml.safe_dump(_router_config(sim, policy)))
    port = free_port()
    proc = Proc(KVROUTER + ["serve", "--config", str(path), "--port", str(port)], tmp_path / f"router-{policy}.log",
                LAB_POLICIES)
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


@pytest.fixture
def two_engines(sim_fleet) -> Any:
    return sim_fleet("--debug-state", "--speedup", "1", instances=2)


@pytest.fixture
def oracle_url(two_engines: Any, tmp_path: Path) -> Iterator[str]:
    with _serve(two_engines, "oracle", tmp_path) as proc:
        wait_http(proc.url + "/health", timeout=120, proc=proc.popen)
        yield proc.url


def _route(router: str, ids: list[int]) -> dict[str, Any]:
    r = httpx.post(router + "/debug/route", json={"model": MODEL, "prompt": ids, "max_tokens": 8, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _keep_busy(url: str, n: int) -> list[threading.Thread]:
    """``n`` long prompts sent straight to one engine (the router never sees them)."""
    def send(i: int) -> None:
        ids = [1 + (i * 7919 + j) % 30_000 for j in range(8000)]
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 200, "ignore_eos": True},
                   timeout=120)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _wait_received(url: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(url + "/debug/state").json()["received"] < n:
        assert time.monotonic() < deadline, f"{url} did not receive {n} requests"
        time.sleep(0.05)


def test_the_oracle_routes_to_the_earliest_predicted_first_token(two_engines: Any, oracle_url: str) -> None:
    """A cached prefix wins on idle engines; a long queue outweighs it; the choice is always
    the lowest of the engines' own predictions."""
    prompt = [1 + (j * 31) % 40_000 for j in range(3000)]
    r = httpx.post(two_engines.http(0) + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 200
    turn = prompt + list(range(100, 164))
    cached = _route(oracle_url, turn)
    assert cached["policy"] == "oracle" and cached["reason"] == "oracle"
    assert cached["backend"] == "engine-0"
    by = {c["backend"]: c for c in cached["candidates"]}
    assert by["engine-0"]["matched_blocks"] == len(prompt) // 16 and by["engine-1"]["matched_blocks"] == 0
    assert by["engine-0"]["score"] < by["engine-1"]["score"] / 3

    busy = _keep_busy(two_engines.http(0), 4)
    _wait_received(two_engines.http(0), 5)
    queued = _route(oracle_url, turn)
    by = {c["backend"]: c for c in queued["candidates"]}
    assert queued["backend"] == "engine-1", by
    assert by["engine-0"]["score"] > by["engine-1"]["score"]
    # The scores are the engines' own predictions (asked again a moment later).
    direct = _ask(two_engines.http(1), turn)["predicted_ttft_s"]
    assert by["engine-1"]["score"] == pytest.approx(direct, abs=0.05)
    assert queued["detail"]["predicted_ttft_ms"] == pytest.approx(by["engine-1"]["score"] * 1000, abs=0.01)
    r = httpx.post(oracle_url + "/v1/completions", json={"model": MODEL, "prompt": turn, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.headers["x-kvrouter-backend"] == "engine-1"
    for t in busy:
        t.join(120)


def test_the_oracles_questions_stop_the_world_clock(sim_fleet, tmp_path: Path) -> None:
    """On a simulator that keeps a world clock, the oracle stops it for each whole question:
    the clock stood still at least as long as the simulator spent answering, less than the
    decisions took, and moves again once they are made."""
    path = tmp_path / "world-clock"
    world = WorldClock(path)
    sim = sim_fleet("--debug-state", "--world-clock", str(path), "--speedup", "1", instances=2)
    assert httpx.get(sim.http() + "/debug/state").json()["world_clock"] == str(path)
    with _serve(sim, "oracle", tmp_path) as proc:
        wait_http(proc.url + "/health", timeout=120, proc=proc.popen)
        assert world.paused_s() == 0.0
        t0 = time.monotonic()
        for i in range(8):
            assert _route(proc.url, [1 + (i * 977 + j) % 30_000 for j in range(3000)])["reason"] == "oracle"
        elapsed = time.monotonic() - t0
    paused = world.paused_s()
    answering = _metric(sim.http(), "kvrouter_sim:debug_state_seconds_sum")
    assert 0 < answering <= paused < elapsed
    t = world.now()
    time.sleep(0.05)
    assert world.now() - t >= 0.045


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def test_kv_aware_with_exact_state_sees_load_the_router_did_not_send(two_engines: Any, tmp_path: Path) -> None:
    with _serve(two_engines, "kv_aware+exact", tmp_path) as proc:
        wait_http(proc.url + "/health", timeout=120, proc=proc.popen)
        busy = _keep_busy(two_engines.http(0), 3)
        _wait_received(two_engines.http(0), 3)
        d = _route(proc.url, list(range(2000, 2800)))
        by = {c["backend"]: c for c in d["candidates"]}
        assert d["policy"] == "kv_aware+exact" and d["backend"] == "engine-1"
        assert by["engine-0"]["load"]["in_flight"] == 3 and by["engine-0"]["load"]["context_blocks"] == 3 * 500
        assert by["engine-1"]["load"]["in_flight"] == 0
        for t in busy:
            t.join(120)


def test_exact_state_policies_refuse_engines_without_the_side_channel(sim_fleet, tmp_path: Path) -> None:
    sim = sim_fleet(instances=2)
    with _serve(sim, "oracle", tmp_path) as proc:
        assert proc.popen.wait(120) != 0
        log = proc.log()
    assert "runs only against simulated engines started with `kvrouter sim --debug-state`" in log
    assert "engine-0" in log and "answered 404" in log


# -- the bench ---------------------------------------------------------------------------------------


def test_the_oracle_is_a_default_policy_of_simulated_benches(tmp_path: Path) -> None:
    import argparse

    from loadtest import bench

    p = argparse.ArgumentParser()
    bench.configure(p)
    opt = bench.options_from_args(p.parse_args(["--out", str(tmp_path), "--max-requests", "5"]))
    assert opt.policies == ["round_robin", "least_loaded", "kv_aware", "oracle"]


@pytest.mark.slow
def test_bench_runs_the_oracle_and_reports_each_policys_share_of_its_gain(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    r = subprocess.run(
        [*KVROUTER, "bench", "--out", str(out), "--workload", "mixed", "--seed", "1001", "--backends", "2",
         "--policies", "round_robin,oracle", "--max-requests", "40", "--speedup", "4", "--rate-scale", "2",
         "--mix", "context_tokens=2048", "--quiet"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    runs = {run["policy"]: run for run in results["runs"]}
    assert list(runs) == ["round_robin", "oracle"]
    oracle = runs["oracle"]
    assert oracle["requests"] == 40 and oracle["errors"] == 0
    assert oracle["decision_reasons"].get("oracle", 0) >= 40 and "no_state" not in oracle["decision_reasons"]
    # Its questions stopped the fleet's and the client's clock (loadtest/sim/world_clock.py).
    assert oracle["side_channel_paused_s"] > 0 and runs["round_robin"]["side_channel_paused_s"] is None
    assert results["meta"]["workload"] == "mixed (seed 1001, held-out)"
    for run in runs.values():
        assert set(run["oracle_gain"]) == {"ttft_p90", "engine_ttft_p90"}
    if oracle["oracle_gain"]["engine_ttft_p90"] is not None:  # None only if the oracle gained nothing
        assert oracle["oracle_gain"]["engine_ttft_p90"] == 1.0 and runs["round_robin"]["oracle_gain"]["engine_ttft_p90"] == 0.0
    md = (out / "report.md").read_text()
    assert "of oracle gain" in md and "| oracle |" in md and "- oracle: oracle " in md


def test_a_production_router_offers_no_exact_state_policy(tmp_path: Path) -> None:
    """``kvrouter serve`` lists only the policies that route real engines; a config naming the
    bench's oracle is refused at start with the key and the policies on offer."""
    out = subprocess.run([*KVROUTER, "serve", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and "kv_aware" in out.stdout, out.stderr
    assert "oracle" not in out.stdout and "exact" not in out.stdout, out.stdout
    path = tmp_path / "oracle.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "tokenizer": str(QWEN3_DIR),
                                                "backends": [{"name": "a", "url": "http://127.0.0.1:9"}]}],
                                    "router": {"policy": "oracle"}}))
    out = subprocess.run([*KVROUTER, "serve", "--config", str(path), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2, out.stderr
    assert "router.policy" in out.stderr and "unknown policy 'oracle'" in out.stderr and "kv_aware" in out.stderr
