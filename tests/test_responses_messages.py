"""``/v1/responses`` and ``/v1/messages`` through the router, on a real router and simulator.

vLLM keeps stored responses in the memory of the engine that made them (router/http/responses.py
cites its code), and so does ``kvrouter sim``: a follow-up naming ``previous_response_id`` must
reach that engine, or it gets 404. The router remembers where each response was made and
sends follow-ups, retrieves and cancels there; what it does not remember it searches for.
``/v1/messages`` is routed least loaded. Both stream in their own API's shapes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.http.responses import ResponseMemory, created_id
from router.http.sse import ANTHROPIC, RESPONSES, EventCut
from support import RouterProc, access_lines, metric_sum, openai_error, wait_for
from test_request_observability import sim_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "qwen3"
BALLAST = {"model": MODEL, "max_output_tokens": 2000, "ignore_eos": True, "stream": True}
"""A follow-up that keeps its engine busy for seconds: least loaded would then pick another."""


def _events(raw: bytes) -> list[tuple[str, dict[str, Any] | str]]:
    """(event name, decoded data) of each event of an SSE body (data ``[DONE]`` stays a string)."""
    out: list[tuple[str, dict[str, Any] | str]] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = "", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        text = "\n".join(data)
        out.append((name, text if text == "[DONE]" else json.loads(text)))
    return out


def _turn(c: httpx.Client, previous: str | None, text: str, stream: bool, request_id: str = "") -> tuple[str, str, dict[str, Any]]:
    """One turn through the router: (its response id, the backend that answered, its usage)."""
    body: dict[str, Any] = {"model": MODEL, "input": text, "max_output_tokens": 6, "ignore_eos": True, "stream": stream}
    if previous is not None:
        body["previous_response_id"] = previous
    r = c.post("/v1/responses", json=body, headers={"x-request-id": request_id} if request_id else None)
    assert r.status_code == 200, r.text
    if not stream:
        answer = r.json()
        assert answer["previous_response_id"] == previous
        return answer["id"], r.headers["x-kvrouter-backend"], answer["usage"]
    events = _events(r.content)
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed", events[-2:]
    assert not any(isinstance(d, dict) and "error" in d for _, d in events), "the router cut the stream"
    completed = events[-1][1]
    assert isinstance(completed, dict)
    return completed["response"]["id"], r.headers["x-kvrouter-backend"], completed["response"]["usage"]


def test_a_chain_of_follow_ups_stays_on_the_engine_that_holds_it(sim_fleet: Any, tmp_path: Path) -> None:
    """Five chained turns over three engines, streamed and not, each sent while another request
    keeps the chain's engine the busiest: least loaded would send each turn elsewhere, where the
    engine answers 404. Every turn lands where its previous response is, and finds its prefix cached."""
    sim = sim_fleet(instances=3)
    router = RouterProc("chain", sim_config(sim), tmp_path)
    try:
        with httpx.Client(base_url=router.url, timeout=60) as c:
            head, home, _ = _turn(c, None, "You are a terse assistant. Tell me about KV caches in vLLM. " * 3, False, "turn-0")
            for i in range(1, 5):
                with c.stream("POST", "/v1/responses", json={**BALLAST, "input": "keep busy", "previous_response_id": head}) as busy:
                    assert busy.status_code == 200 and busy.headers["x-kvrouter-backend"] == home
                    chunks = busy.iter_bytes()  # kept: a dropped iterator closes the connection
                    next(chunks)  # under way: its load counts on the chain's engine
                    fresh = c.post("/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
                    assert fresh.status_code == 200 and fresh.headers["x-kvrouter-backend"] != home  # least loaded
                    for other in range(3):
                        if f"engine-{other}" != home:  # where least loaded would have sent the turn
                            direct = httpx.post(sim.http(other) + "/v1/responses", timeout=30,
                                                json={"model": MODEL, "input": "x", "previous_response_id": head})
                            assert direct.status_code == 404 and "not found" in openai_error(direct.content)["message"]
                    head, backend, usage = _turn(c, head, f"And turn {i}? Say more.", i % 2 == 0, f"turn-{i}")
                assert backend == home
                assert usage["input_tokens_details"]["cached_tokens"] > 0  # the chain's prefix is cached there
            metrics = c.get("/metrics").text
        endpoint = {"model": MODEL, "endpoint": "/v1/responses"}
        assert metric_sum(metrics, "kvrouter_passthrough_decisions_total", reason="response_engine", **endpoint) == 8
        assert metric_sum(metrics, "kvrouter_passthrough_decisions_total", reason="least_loaded", **endpoint) == 1
        assert metric_sum(metrics, "kvrouter_upstream_failures_total") == 0  # no stream was taken for cut short
        lines = access_lines(router.log_path, 9, "/v1/responses")
        turns = [line for line in lines if line["request_id"].startswith("turn-")]
        assert [line["reason"] for line in turns] == ["least_loaded"] + ["response_engine"] * 4
        assert all(line["status"] == 200 and line["completion_tokens"] == 6 for line in turns)
        assert all(line["backend"] == home and line["model"] == MODEL and line["prompt_tokens"] > 0 for line in turns)
        assert all(line["cached_tokens"] > 0 for line in turns[1:])
        assert [("ttft_ms" in line) for line in turns] == [False, False, True, False, True]
    finally:
        router.stop()


def test_a_response_the_router_does_not_know_is_searched_for(sim_fleet: Any, tmp_path: Path) -> None:
    """A response made on the last engine behind the router's back (as another router replica
    would): its follow-up tries the engines in turn, past their 404s, to the one that holds it,
    and the next one goes there at once. Retrieve and cancel go there too; an id no engine
    holds gets the engines' own 404."""
    sim = sim_fleet(instances=3)
    made = httpx.post(sim.http(2) + "/v1/responses", timeout=30, json={"model": MODEL, "input": "hello", "max_output_tokens": 3})
    assert made.status_code == 200
    unknown = made.json()["id"]
    router = RouterProc("search", sim_config(sim), tmp_path)
    try:
        with httpx.Client(base_url=router.url, timeout=60) as c:
            second, backend, _ = _turn(c, unknown, "and then?", False)
            assert backend == "engine-2"
            third, backend, _ = _turn(c, second, "and then?", True)
            assert backend == "engine-2"
            got = c.get(f"/v1/responses/{third}")
            assert got.status_code == 200 and got.json()["id"] == third and got.headers["x-kvrouter-backend"] == "engine-2"
            cancel = c.post(f"/v1/responses/{third}/cancel")  # the engine that holds it refuses: it is finished
            assert cancel.status_code == 400 and "synchronous" in openai_error(cancel.content)["message"]
            assert cancel.headers["x-kvrouter-backend"] == "engine-2"
            never = c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_never"})
            assert never.status_code == 404 and openai_error(never.content)["message"] == "Response with id 'resp_never' not found."
            assert c.get("/v1/responses/resp_never").status_code == 404
            metrics = c.get("/metrics").text
        count = lambda reason, endpoint="/v1/responses": metric_sum(  # noqa: E731
            metrics, "kvrouter_passthrough_decisions_total", endpoint=endpoint, reason=reason)
        assert count("response_unknown") == 2 and count("response_engine") == 1
        assert count("fallback") == 2 + 2  # the first follow-up's search, then resp_never's
        assert count("response_engine", "/v1/responses/{id}") == 1 and count("response_engine", "/v1/responses/{id}/cancel") == 1
        assert count("response_unknown", "/v1/responses/{id}") == 1
        assert metric_sum(metrics, "kvrouter_upstream_retries_total", reason="status_404") == 2 + 2 + 2
        reasons = [line["reason"] for line in access_lines(router.log_path, 6, "/v1/responses")]
        assert reasons[:4] == ["fallback", "response_engine", "response_engine", "response_engine"]
    finally:
        router.stop()


def test_follow_ups_across_router_workers(sim_fleet: Any, tmp_path: Path) -> None:
    """``serve --workers 2``: each worker remembers only the responses it relayed. A chain whose
    turns alternate between the workers still lands every turn on the engine that holds it."""
    sim = sim_fleet(instances=3)
    made = httpx.post(sim.http(2) + "/v1/responses", timeout=30, json={"model": MODEL, "input": "hello", "max_output_tokens": 3})
    head = made.json()["id"]
    router = RouterProc("workers", sim_config(sim), tmp_path, extra_args=["--workers", "2"])
    clients: dict[int, httpx.Client] = {}
    try:
        deadline = time.monotonic() + 60
        while len(clients) < 2 and time.monotonic() < deadline:  # one kept connection on each worker
            c = httpx.Client(base_url=router.url, timeout=60)
            worker = c.get("/debug/backends").json().get("worker", 0)
            if worker in clients:
                c.close()
            else:
                clients[worker] = c
        assert sorted(clients) == [0, 1]
        for i in range(5):
            head, backend, _ = _turn(clients[i % 2], head, f"turn {i}", stream=i % 2 == 1)
            assert backend == "engine-2"
        wait_for(lambda: metric_sum(clients[0].get("/metrics").text, "kvrouter_passthrough_decisions_total",
                                 reason="response_unknown") >= 5, "both workers' decisions in /metrics", timeout=20)
    finally:
        for c in clients.values():
            c.close()
        router.stop()


def test_messages_are_proxied_streamed_and_not(sim_fleet: Any, tmp_path: Path) -> None:
    sim = sim_fleet(instances=2)
    router = RouterProc("messages", sim_config(sim), tmp_path)
    body = {"model": MODEL, "max_tokens": 5, "system": "Be terse.", "messages": [{"role": "user", "content": "What is vLLM?"}]}
    try:
        with httpx.Client(base_url=router.url, timeout=60) as c:
            r = c.post("/v1/messages", json=body)
            assert r.status_code == 200 and r.headers["x-kvrouter-backend"] in ("engine-0", "engine-1")
            answer = r.json()
            assert answer["type"] == "message" and answer["role"] == "assistant" and answer["usage"]["input_tokens"] > 0
            r = c.post("/v1/messages", json={**body, "stream": True})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = _events(r.content)
            names = [name for name, _ in events]
            assert names[0] == "message_start" and names[-2:] == ["message_stop", ""] and events[-1][1] == "[DONE]"
            assert "content_block_delta" in names and "error" not in names
            metrics = c.get("/metrics").text
        assert metric_sum(metrics, "kvrouter_passthrough_decisions_total", endpoint="/v1/messages", reason="least_loaded") == 2
        plain, streamed = access_lines(router.log_path, 2, "/v1/messages")
        for line in (plain, streamed):
            assert line["status"] == 200 and line["reason"] == "least_loaded" and line["model"] == MODEL
            assert line["prompt_tokens"] == answer["usage"]["input_tokens"] and line["completion_tokens"] > 0
        assert "ttft_ms" not in plain and 0 < streamed["ttft_ms"] <= streamed["e2e_ms"]
    finally:
        router.stop()


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_bad_requests_get_openai_errors_from_the_router(sim_fleet: Any, tmp_path: Path, path: str) -> None:
    sim = sim_fleet()
    router = RouterProc("bad", sim_config(sim), tmp_path)
    try:
        with httpx.Client(base_url=router.url, timeout=30) as c:
            cases = [
                (b"{not json", 400),
                (json.dumps({"input": "x", "max_tokens": 2, "messages": []}).encode(), 400),  # no model
                (json.dumps({"model": "nope", "input": "x"}).encode(), 404),
                (b"[1, 2]", 400),
            ]
            if path == "/v1/responses":
                cases.append((json.dumps({"model": MODEL, "input": "x", "previous_response_id": 7}).encode(), 400))
            for raw, status in cases:
                r = c.post(path, content=raw, headers={"content-type": "application/json"})
                assert r.status_code == status, (raw, r.text)
                error = openai_error(r.content)
                assert "Traceback" not in r.text and "x-kvrouter-backend" not in r.headers, error
            if path == "/v1/responses":
                for bad in ("/v1/responses/..", "/v1/responses/a%20b", "/v1/responses/{response_id}"):
                    r = c.get(bad)
                    assert r.status_code in (400, 404) and "x-kvrouter-backend" not in r.headers, (bad, r.text)
                    openai_error(r.content)
    finally:
        router.stop()


def test_a_responses_stream_ends_with_its_last_event_not_done() -> None:
    """vLLM ends a Responses stream with response.completed and no [DONE]; an Anthropic one with [DONE]."""
    completed = b'event: response.completed\ndata: {"response":{"id":"r"},"type":"response.completed"}\n\n'
    cut = EventCut(RESPONSES)
    assert cut.feed(b'event: response.output_text.delta\ndata: {"delta":"a"}\n\n') and not cut.complete
    assert cut.feed(completed[:20]) == b"" and cut.feed(completed[20:]) == completed and cut.complete
    assert cut.error_event("x").startswith(b'data: {"error":')
    cut = EventCut(ANTHROPIC)
    assert cut.feed(b'event: message_stop\ndata: {"type":"message_stop"}\n\n') and not cut.complete
    assert cut.feed(b"data: [DONE]\n\n") and cut.complete
    error = _events(cut.error_event("backend b failed"))
    assert error == [("error", {"type": "error", "error": {"type": "api_error", "message": "backend b failed"}})]


def test_the_created_id_is_read_from_the_first_event_and_memory_is_bounded() -> None:
    created = (b'event: response.created\ndata: {"response":{"id":"resp_1","output":[]},"sequence_number":0,'
               b'"type":"response.created"}\n\nevent: response.in_progress\ndata: {"type":"response.in_progress"}\n\n')
    assert created_id(created) == "resp_1"
    assert created_id(b'event: response.output_text.delta\ndata: {"delta":"x"}\n\n') is None
    memory = ResponseMemory(capacity=2)
    for i in range(3):
        memory.remember(f"r{i}", MODEL, f"b{i}")
    assert memory.where("r0") is None and memory.where("r1") == (MODEL, "b1") and len(memory) == 2
    memory.remember("r3", MODEL, "b3")  # r1 was just used: r2 goes
    assert memory.where("r2") is None and memory.where("r1") is not None
    memory.remember("x" * 1000, MODEL, "b")  # a client's id too long to keep
    assert memory.where("x" * 1000) is None
    route = memory.route("r1", ["b0", "b1", "b2"])
    assert (route.order, route.reason, route.search) == (["b1", "b0", "b2"], "response_engine", False)
    assert memory.route("r1", ["b0", "b2"]).reason == "response_engine_down"
    assert memory.route("gone", ["b0"]).search and memory.route(None, ["b0"]).reason == "least_loaded"
