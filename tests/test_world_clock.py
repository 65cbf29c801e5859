"""The world clock the bench's oracle stops while it asks (loadtest/sim/world_clock.py).

A stopped clock must stop everything the client times: the simulated engines' steps, the
load generator's arrivals and the client's TTFT. Each test runs the real pieces (the shared
file, a real ``kvrouter sim`` over HTTP) with pauses of a known length.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from indexer.hashing import BlockHasher
from loadtest.replay import Replayer
from loadtest.sim.engine import Engine, EngineConfig
from loadtest.sim.world_clock import WorldClock
from loadtest.workloads import Session, Turn, Workload

HASHER = BlockHasher("sha256", 16, "0", "0.33.0")


def test_the_clock_stands_still_while_any_asker_pauses(tmp_path: Path) -> None:
    """Two handles on one file (two router processes): overlapping pauses are one pause, and a
    reader on a third handle sees the clock frozen through both and moving after them."""
    path = tmp_path / "clock"
    a, b, reader = WorldClock(path), WorldClock(path), WorldClock(path)
    assert reader.paused_s() == 0.0
    with a.pause():
        frozen = reader.now()
        with b.pause():
            time.sleep(0.1)
        time.sleep(0.1)  # b is done, a still asks: still stopped
        assert reader.now() == pytest.approx(frozen, abs=1e-6)
    assert reader.paused_s() == pytest.approx(0.2, abs=0.05)
    t = reader.now()
    time.sleep(0.05)
    assert reader.now() - t >= 0.045
    assert a.paused_s() == pytest.approx(b.paused_s(), abs=1e-9)


def test_reads_are_never_torn_by_concurrent_pauses(tmp_path: Path) -> None:
    """A reader polling while two threads pause and resume never sees the clock go back."""
    path = tmp_path / "clock"
    writers = [WorldClock(path), WorldClock(path)]
    reader = WorldClock(path)
    stop = threading.Event()

    def churn(clock: WorldClock) -> None:
        while not stop.is_set():
            with clock.pause():
                pass

    threads = [threading.Thread(target=churn, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    last, reads = reader.now(), 0
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        now = reader.now()
        assert now >= last - 1e-9
        last, reads = now, reads + 1
    stop.set()
    for t in threads:
        t.join()
    assert reads > 1000 and reader.paused_s() > 0


def test_an_engine_keeps_time_by_the_world_clock(tmp_path: Path) -> None:
    clock = WorldClock(tmp_path / "clock")
    engine = Engine(EngineConfig(speedup=4.0), HASHER, clock=clock.now)
    time.sleep(0.1)
    with clock.pause():
        time.sleep(0.2)
    time.sleep(0.1)
    assert engine.wall_engine_time() == pytest.approx(0.2 * 4.0, abs=0.1)


def test_the_client_and_the_engines_stand_still_together(sim_fleet, tmp_path: Path) -> None:
    """A simulated engine on the world clock and a client timing by it: a 0.6 s pause during a
    request adds nothing to its TTFT, and the next session, due 0.3 s after the first, is sent
    0.3 s after it on the clock, more than 0.6 s after it on the wall."""
    path = tmp_path / "clock"
    clock = WorldClock(path)
    sim = sim_fleet("--world-clock", str(path), "--speedup", "1")
    prompt = [1 + (j * 31) % 30_000 for j in range(2000)]
    turn = Turn("/v1/completions", {"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
    workload = Workload("w", [Session("s0", 0.0, (turn,)), Session("s1", 0.3, (turn,))])
    wall_sent: list[float] = []
    replayer = Replayer(sim.http(), "qwen3", clock=clock.now)
    real_send = replayer.send

    async def send(*args, **kwargs):  # type: ignore[no-untyped-def]
        wall_sent.append(time.monotonic())
        return await real_send(*args, **kwargs)

    replayer.send = send  # type: ignore[method-assign]

    def stop_the_world() -> None:
        while not wall_sent:
            time.sleep(0.001)
        with clock.pause():
            time.sleep(0.6)

    pauser = threading.Thread(target=stop_the_world)
    pauser.start()
    res = asyncio.run(replayer.run(workload))
    pauser.join()
    assert [r.ok for r in res.records] == [True, True], [r.error for r in res.records]
    first, second = sorted(res.records, key=lambda r: r.sent_s)
    assert second.sent_s - first.sent_s == pytest.approx(0.3, abs=0.1)
    assert wall_sent[1] - wall_sent[0] > 0.85
    # Prefill of 2,000 tokens takes the simulated engine well under 0.3 s: the pause is not in it.
    assert first.ttft_s is not None and first.ttft_s < 0.3
    assert res.wall_s < 0.3 + second.e2e_s + 0.3
