"""The router's admission queue (router/admission.py) on real processes: a ``kvrouter serve``
in front of one simulated engine (``kvrouter sim --speedup 1``), on loopback.

``queue_busy_tokens: 1`` makes the backend busy while any request is before its first
token, so the queue lets one request through per first token: with ``max_tokens: 1``
the order in which the answers come back is the order the queue let them through.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.fleet import scrape_labelled
from support import KVROUTER, Proc, access_lines, free_port, wait_http
from test_workers import MODEL, model, sim_backend

pytestmark = pytest.mark.slow

LONG = "a long document to prefill first " * 500
"""About 3,500 tokens: at speedup 1 the engine takes ~0.28 s to prefill it, ~1.1 s at speedup 0.25."""


def serve(sim: Any, tmp: Path, env: dict[str, str] | None = None, backends: int = 1,
          tuning: dict[str, Any] | None = None, **queue: Any) -> tuple[Proc, str]:
    port = free_port()
    config = {"models": [model(*(sim_backend(sim, i) for i in range(backends)))],
              "router": {"queue_busy_tokens": 1, "health_interval_s": 0.5, **queue}}
    path = tmp / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    extra = ["--tuning", json.dumps(tuning)] if tuning else []
    proc = Proc([*KVROUTER, "serve", "--config", str(path), "--port", str(port), "--workers", "1", *extra],
                tmp / "router.log", env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", timeout=120, proc=proc.popen)
    return proc, url


async def complete(c: httpx.AsyncClient, url: str, prompt: str, **fields: Any) -> httpx.Response:
    return await c.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **fields})


def outcomes(url: str) -> dict[str, float]:
    return scrape_labelled(url + "/metrics", "kvrouter_queue_outcomes_total", "outcome")


def test_the_queue_lets_requests_through_by_priority_then_tenant_in_turn_then_arrival(sim_fleet: Any,
                                                                                      tmp_path: Path) -> None:
    sim = sim_fleet("--speedup", "0.25")  # the blocker's prefill (~1.1 s) outlasts the arrivals (0.2 s)
    proc, url = serve(sim, tmp_path)
    try:
        async def run() -> list[str]:
            done: list[str] = []
            async with httpx.AsyncClient(timeout=60) as c:
                async def one(name: str, prompt: str = "", **fields: Any) -> None:
                    r = await complete(c, url, prompt or f"question {name} " * 20, **fields)
                    assert r.status_code == 200, r.text
                    done.append(name)

                # The blocker's long prompt keeps the backend busy while the six arrive.
                blocker = asyncio.ensure_future(one("blocker", LONG))
                await asyncio.sleep(0.1)  # the blocker is in prefill: the backend is busy
                waiting = []
                for name, fields in [("a1", {"user": "a"}), ("a2", {"user": "a"}), ("a3", {"user": "a"}),
                                     ("b1", {"user": "b"}), ("b2", {"user": "b"}), ("urgent", {"user": "c", "priority": -1})]:
                    waiting.append(asyncio.ensure_future(one(name, **fields)))
                    await asyncio.sleep(0.02)  # arrival order
                await asyncio.gather(blocker, *waiting)
            return done

        order = asyncio.run(run())
        assert order[0] == "blocker", order
        # Priority first; then tenants a and b in turn, each in arrival order.
        assert order[1:] == ["urgent", "a1", "b1", "a2", "b2", "a3"], order
        assert outcomes(url).get("dispatched", 0) >= 6
    finally:
        proc.stop()


def test_within_a_tenant_a_short_prefill_goes_before_a_long_one_once_the_queue_has_waited(
        sim_fleet: Any, tmp_path: Path) -> None:
    """A tenant's waiting requests go by deadline: arrival plus the queue's recent wait scaled by
    the request's uncached prompt against the mean. The first round gives the queue a recent
    wait (and shows that, without one, order is arrival); in the second a short question that
    arrives after a fresh 2,500-token prompt goes first."""
    sim = sim_fleet("--speedup", "0.25")
    proc, url = serve(sim, tmp_path)
    try:
        async def run() -> list[list[str]]:
            rounds: list[list[str]] = []
            async with httpx.AsyncClient(timeout=60) as c:
                async def one(done: list[str], name: str, prompt: str) -> None:
                    r = await complete(c, url, prompt, user="a")
                    assert r.status_code == 200, r.text
                    done.append(name)

                for blocker, first, second in [
                    (LONG, ("long-1", "first fresh context " * 400), ("short-1", "question one " * 10)),
                    ("another long text to prefill " * 500, ("long-2", "second fresh context " * 400),
                     ("short-2", "question two " * 10)),
                ]:
                    done: list[str] = []
                    head = asyncio.ensure_future(one(done, "blocker", blocker))
                    await asyncio.sleep(0.1)  # the blocker is in prefill: the backend is busy
                    waiting = [asyncio.ensure_future(one(done, *first))]
                    await asyncio.sleep(0.02)
                    waiting.append(asyncio.ensure_future(one(done, *second)))
                    await asyncio.gather(head, *waiting)
                    rounds.append(done)
            return rounds

        first, second = asyncio.run(run())
        assert first == ["blocker", "long-1", "short-1"], first  # no recent wait yet: arrival
        assert second == ["blocker", "short-2", "long-2"], second
    finally:
        proc.stop()


def test_configured_tenants_take_turns_whatever_user_their_requests_name(sim_fleet: Any, tmp_path: Path) -> None:
    """With ``router.tenants`` the key names the tenant: a client that sends each request
    under a new ``user`` still gets one turn in the rotation, not one per request."""
    sim = sim_fleet("--speedup", "0.25")  # the blocker's prefill (~1.1 s) outlasts the arrivals
    tenants = {"a": {"keys": "env:KVR_TEST_KEY_A"}, "b": {"keys": "env:KVR_TEST_KEY_B"}}
    proc, url = serve(sim, tmp_path, env={"KVR_TEST_KEY_A": "key-a", "KVR_TEST_KEY_B": "key-b"}, tenants=tenants)
    try:
        async def run() -> list[str]:
            done: list[str] = []

            async def one(c: httpx.AsyncClient, name: str, prompt: str = "", **fields: Any) -> None:
                r = await complete(c, url, prompt or f"question {name} " * 20, **fields)
                assert r.status_code == 200, r.text
                done.append(name)

            async with httpx.AsyncClient(timeout=60, headers={"authorization": "Bearer key-a"}) as a, \
                    httpx.AsyncClient(timeout=60, headers={"authorization": "Bearer key-b"}) as b:
                blocker = asyncio.ensure_future(one(a, "blocker", LONG))
                await asyncio.sleep(0.1)
                waiting = []
                for client, name in [(a, "a1"), (a, "a2"), (a, "a3"), (b, "b1"), (b, "b2")]:
                    waiting.append(asyncio.ensure_future(one(client, name, user=f"user-{name}")))
                    await asyncio.sleep(0.02)
                await asyncio.gather(blocker, *waiting)
            return done

        order = asyncio.run(run())
        assert order == ["blocker", "a1", "b1", "a2", "b2", "a3"], order
    finally:
        proc.stop()


def test_a_heavy_tenant_waits_for_headroom_while_another_tenant_goes_through(sim_fleet: Any,
                                                                            tmp_path: Path) -> None:
    """Tenant h sends 10 of the first 12 requests, over twice its fair share of three tenants.
    With its 2,000-token prompt prefilling (under the busy threshold of 3,000, over half of
    it), h's next request waits at the router while x's, sent after it, goes through at once;
    h's goes once the prefill is done. Without the headroom both would go at once."""
    sim = sim_fleet("--speedup", "0.25")  # the 2,000-token prefill takes ~0.6 s
    proc, url = serve(sim, tmp_path, queue_busy_tokens=3000)
    try:
        async def run() -> list[str]:
            done: list[str] = []
            async with httpx.AsyncClient(timeout=60) as c:
                async def one(name: str, user: str, prompt: str = "") -> None:
                    r = await complete(c, url, prompt or f"question {name} " * 20, user=user)
                    assert r.status_code == 200, r.text
                    done.append(name)

                for name, user in [("x0", "x"), ("y0", "y"), *((f"h0-{i}", "h") for i in range(8))]:
                    await one(name, user)  # one at a time on an idle engine: none waits
                done.clear()
                head = asyncio.ensure_future(one("h-long", "h", "a long document to prefill first " * 285))
                await asyncio.sleep(0.1)  # h's prompt is prefilling
                later = [asyncio.ensure_future(one("h1", "h"))]
                await asyncio.sleep(0.02)
                later.append(asyncio.ensure_future(one("x1", "x")))
                await asyncio.gather(head, *later)
            return done

        order = asyncio.run(run())
        assert order.index("x1") < order.index("h1") and order[-1] == "h1", order
        assert outcomes(url).get("dispatched") == 2, outcomes(url)  # h1 waited for headroom, x1 for its turn
        waits = [line["queue_wait_ms"] for line in access_lines(tmp_path / "router.log", 13, "/v1/") if "queue_wait_ms" in line]
        assert len(waits) == 2 and max(waits) > 200, waits  # the access log says who waited, and how long
        held = scrape_labelled(url + "/metrics", "kvrouter_queue_heavy_held_total", "model")
        assert held.get(MODEL) == 1, held
    finally:
        proc.stop()


def test_a_heavy_tenant_is_sent_only_to_a_backend_with_headroom(sim_fleet: Any, tmp_path: Path) -> None:
    """Two backends; tenant h sends 10 of the first 12 requests. Its 2,000-token document is
    prefilling on one backend (over the headroom of 750 tokens) when h asks a question on that
    document: kv_aware alone sends it there, where the document's blocks are being computed,
    but it goes to the idle backend, the one the queue let it through for."""
    sim = sim_fleet("--speedup", "0.25", instances=2)  # the 2,000-token prefill takes ~0.6 s
    proc, url = serve(sim, tmp_path, backends=2, queue_busy_tokens=3000)
    try:
        document = "a long document to prefill first " * 285

        def confined() -> float:
            return scrape_labelled(url + "/metrics", "kvrouter_queue_heavy_confined_total", "model").get(MODEL, 0.0)

        async def warm() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                for name, user in [("x0", "x"), ("y0", "y"), *((f"h0-{i}", "h") for i in range(8))]:
                    r = await complete(c, url, f"question {name} " * 20, user=user)  # one at a time: none waits
                    assert r.status_code == 200, r.text

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                head = asyncio.ensure_future(complete(c, url, document, user="h"))
                await asyncio.sleep(0.1)  # the document is prefilling
                follow = await complete(c, url, document + " and what does it say about headroom?", user="h")
                assert follow.status_code == 200 and (await head).status_code == 200, follow.text

        # While h's share climbs past 3/4, it is heavy with one backend of the two as its own, and
        # its warm-up questions keep to it; from 3/4 on both are its own, and only room confines it.
        asyncio.run(warm())
        before = confined()
        asyncio.run(run())
        sent = {line["prompt_tokens"]: line["backend"] for line in access_lines(tmp_path / "router.log", 12, "/v1/")}
        document_tokens, follow_tokens = sorted(sent)[-2:]
        assert sent[document_tokens] != sent[follow_tokens], sent
        assert confined() - before == 1, (before, confined())
    finally:
        proc.stop()


def test_a_heavy_tenant_keeps_to_its_share_of_the_backends_and_the_others_keep_the_rest(sim_fleet: Any,
                                                                                       tmp_path: Path) -> None:
    """``queue_heavy_subset`` (on by default), four backends; tenant h sends every other request,
    half of the recent arrivals, so once it is heavy its requests go only to 4 x 1/2 = 2 of
    them (the rest serve the other tenants free of its prefill), the same two all along. The
    other tenants' requests, each on a prefix of its own, still go to the others too
    (kv_aware's tie-break by the prefix)."""
    sim = sim_fleet("--speedup", "0.25", instances=4)
    proc, url = serve(sim, tmp_path, backends=4, queue_busy_tokens=3000)
    try:
        names: list[str] = []

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                for i in range(32):
                    user = "h" if i % 2 else f"t{i}"  # one at a time on idle engines: none waits
                    r = await complete(c, url, f"question {i} of {user}, on a prefix of its own " * 20, user=user)
                    assert r.status_code == 200, r.text
                    names.append(user)

        asyncio.run(run())
        lines = access_lines(tmp_path / "router.log", len(names), "/v1/")
        heavy = {line["backend"] for user, line in zip(names[8:], lines[8:]) if user == "h"}  # once h is heavy
        others = {line["backend"] for user, line in zip(names, lines) if user != "h"}
        assert len(heavy) <= 2 and others - heavy, (heavy, others)  # all 12 of h's on 2 of 4 by chance: 1 in 700
        confined = scrape_labelled(url + "/metrics", "kvrouter_queue_heavy_confined_total", "model")
        assert confined.get(MODEL, 0) >= 12, confined  # each of h's from the ninth on
    finally:
        proc.stop()


def test_a_full_queue_and_a_wait_past_the_deadline_get_429_with_retry_after(sim_fleet: Any, tmp_path: Path) -> None:
    """``queue_max_waiting: 1``: with the backend busy and one request waiting, the next
    gets 429 at once; the one waiting gets 429 at ``queue_timeout_s`` if the backend is
    still busy then. Both carry ``Retry-After``, and every request gets an answer."""
    sim = sim_fleet("--speedup", "0.25")  # the blocker's prefill takes ~2 s
    proc, url = serve(sim, tmp_path, queue_max_waiting=1, queue_timeout_s=0.5)
    try:
        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as c:
                blocker = asyncio.ensure_future(complete(c, url, LONG))
                await asyncio.sleep(0.2)
                waiting = asyncio.ensure_future(complete(c, url, "question one " * 20))
                await asyncio.sleep(0.1)
                t0 = time.monotonic()
                over = await complete(c, url, "question two " * 20)
                assert time.monotonic() - t0 < 0.4, "a full queue answers at once"
                return [await blocker, await waiting, over]

        blocker, waiting, over = asyncio.run(run())
        assert blocker.status_code == 200, blocker.text
        for r, code in ((waiting, "queue_timeout"), (over, "queue_full")):
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "rate_limit_error", r.text
            assert int(r.headers["retry-after"]) >= 1
        got = outcomes(url)
        assert got.get("timeout") == 1 and got.get("full") == 1, got
        assert "Traceback" not in (tmp_path / "router.log").read_text()
    finally:
        proc.stop()


def test_a_client_that_disconnects_while_queued_leaves_the_queue(sim_fleet: Any, tmp_path: Path) -> None:
    """A queued client that goes away is taken out (``cancelled``), never sent to the
    engine, and the request after it is served as usual."""
    sim = sim_fleet("--speedup", "0.25")
    proc, url = serve(sim, tmp_path, queue_timeout_s=30)
    try:
        async def run() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as c:
                blocker = asyncio.ensure_future(complete(c, url, LONG))
                await asyncio.sleep(0.2)
                async with httpx.AsyncClient(timeout=0.5) as impatient:
                    with pytest.raises(httpx.ReadTimeout):
                        await complete(impatient, url, "question gone " * 20)
                # The client closed its connection: the router notices and forgets it.
                for _ in range(50):
                    if outcomes(url).get("cancelled"):
                        break
                    await asyncio.sleep(0.05)
                assert (await blocker).status_code == 200
                return await complete(c, url, "question after " * 20)

        after = asyncio.run(run())
        assert after.status_code == 200, after.text
        got = outcomes(url)
        assert got.get("cancelled") == 1, got
        depth = scrape_labelled(url + "/metrics", "kvrouter_queue_depth", "model")
        assert depth.get(MODEL) == 0, depth
        served = scrape_labelled(sim.http(0) + "/metrics", "vllm:request_success_total", "finished_reason")
        assert sum(served.values()) == 2, served  # the blocker and the one after: never the cancelled one
    finally:
        proc.stop()


def test_a_heavy_tenant_gives_way_while_the_rest_of_the_fleet_has_a_backlog(sim_fleet: Any, tmp_path: Path) -> None:
    """Two backends; tenant h sends every other request, half of the recent arrivals, so one of
    the two is its own. Four 2,000-token prompts sent straight to the other engine (another
    client's, which the router sees only in its scrape) queue there, far over the headroom of 750
    tokens: h's next question waits at the router although its own backend is idle, and goes once
    that backlog is down to the headroom. Without giving way it would go at once."""
    sim = sim_fleet("--speedup", "0.25", instances=2)  # each 2,000-token prefill takes ~0.6 s
    proc, url = serve(sim, tmp_path, backends=2, tuning={"metrics_scrape_interval_s": 0.1}, queue_busy_tokens=3000)
    try:
        with httpx.Client(timeout=60) as c:
            for i in range(16):  # one at a time on idle engines: none waits
                r = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": f"question {i} " * 20,
                                                          "max_tokens": 1, "user": "h" if i % 2 else f"t{i}"})
                assert r.status_code == 200, r.text
        lines = access_lines(tmp_path / "router.log", 16, "/v1/")
        own = {line["backend"] for line in lines[9::2]}  # h's, once it is heavy
        assert len(own) == 1, lines
        other = next(i for i in range(2) if f"sim{i}" not in own)

        def backlog(i: int) -> None:
            httpx.post(sim.http(other) + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": f"{i} a long document to prefill first " * 285, "max_tokens": 1})

        direct = [threading.Thread(target=backlog, args=(i,)) for i in range(4)]
        for t in direct:
            t.start()
        deadline = time.monotonic() + 10
        while scrape_labelled(url + "/metrics", "kvrouter_backend_scraped_unseen_requests", "backend").get(f"sim{other}", 0) < 3:
            assert time.monotonic() < deadline, "the router's scrape never saw the backlog"
            time.sleep(0.02)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "a question of h " * 20, "max_tokens": 1, "user": "h"})
        assert r.status_code == 200, r.text
        for t in direct:
            t.join(60)
        line = access_lines(tmp_path / "router.log", 17, "/v1/")[-1]
        assert line["backend"] in own and line.get("queue_wait_ms", 0) > 500, line  # ~1.8 s of prefill before it
        yielded = scrape_labelled(url + "/metrics", "kvrouter_queue_heavy_yielded_total", "model")
        assert yielded.get(MODEL) == 1, yielded
    finally:
        proc.stop()
