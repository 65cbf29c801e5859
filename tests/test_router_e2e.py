"""The router end to end: real simulated vLLM engines and a real router on loopback.

One fleet of four simulated engines (``kvrouter sim``, a separate process) serves the
whole module. The main router is a separate ``kvrouter serve`` process with an API key;
per-policy routers run in-process (uvicorn on a free port) so that each policy does not
pay a tokenizer load. Clients are the official ``openai`` SDK and httpx.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
import yaml
from prometheus_client import REGISTRY

from router.http.app import create_app
from router.tuning import Tuning
from kvconfig import parse_config
from support import GOLDEN, KVROUTER, QWEN3_DIR, Proc, free_port, free_ports, wait_http

pytestmark = pytest.mark.slow

MODEL = "qwen3-0.6b"
GOLDEN_MODEL = "qwen3-0.6b-tok"
API_KEY = "sk-router-test"
N_ENGINES = 4
MAX_MODEL_LEN = 32768
MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    http = free_ports(N_ENGINES)
    events = free_ports(N_ENGINES)
    replay = free_ports(N_ENGINES)
    d = tmp_path_factory.mktemp("fleet")
    args = KVROUTER + [
        "sim", "--instances", str(N_ENGINES), "--port", str(http), "--kv-events-port", str(events),
        "--replay-port", str(replay), "--model", MODEL, "--tokenizer", str(QWEN3_DIR), "--hash-seed", "0",
        "--speedup", "20", "--max-model-len", str(MAX_MODEL_LEN * 2), "--mean-output-tokens", "16",
    ]
    with Proc(args, d / "sim.log") as proc:
        for i in range(N_ENGINES):
            wait_http(f"http://127.0.0.1:{http + i}/health", timeout=120, proc=proc.popen)
        yield {"http": http, "events": events, "replay": replay, "dir": d, "proc": proc}


def fleet_config(fleet: dict[str, Any], **router: Any) -> dict[str, Any]:
    backends = [
        {
            "name": f"sim-{i}",
            "url": f"http://127.0.0.1:{fleet['http'] + i}",
            "kv_events": f"tcp://127.0.0.1:{fleet['events'] + i}",
            "kv_replay": f"tcp://127.0.0.1:{fleet['replay'] + i}",
        }
        for i in range(N_ENGINES)
    ]
    common = {"tokenizer": str(QWEN3_DIR), "block_size": 16, "hash_algo": "sha256", "hash_seed": "0", "vllm_version": "0.33.0"}
    return {
        "models": [
            {"name": MODEL, **common, "max_model_len": MAX_MODEL_LEN, "backends": backends,
             "lora_adapters": [{"name": "sql-adapter", "path": "/adapters/sql", "id": 7}]},
            # The golden renderings' model name; the same engines, their events feed the first model.
            {"name": GOLDEN_MODEL, **common, "backends": [{"name": b["name"], "url": b["url"]} for b in backends]},
        ],
        "router": {"health_interval_s": 0.5, "max_body_bytes": MAX_BODY, "expose_decision_headers": True, **router},
    }


@pytest.fixture(scope="module")
def router_url(fleet: dict[str, Any]) -> Iterator[str]:
    port = free_port()
    path = Path(fleet["dir"]) / "router.yaml"
    # One key for both: these tests read /debug/* with the client's key (the keys' separation: test_hardening.py).
    path.write_text(yaml.safe_dump(fleet_config(fleet, api_key=API_KEY, admin_api_key=API_KEY)))
    with Proc(KVROUTER + ["serve", "--config", str(path), "--port", str(port)], Path(fleet["dir"]) / "router.log") as proc:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120, proc=proc.popen)
        yield f"http://127.0.0.1:{port}"
        assert proc.popen.poll() is None, proc.log()


class InProcessRouter:
    """The router app served by uvicorn on a thread (same code path as ``kvrouter serve``)."""

    def __init__(self, config: dict[str, Any], tuning: Tuning | None = None, **app_options: Any) -> None:
        self.port = free_port()
        app = create_app(parse_config(config), tuning=tuning, **app_options)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", loop="asyncio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "InProcessRouter":
        self.thread.start()
        wait_http(self.url + "/health", timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def headers(key: str = API_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def unique_text(n_words: int) -> str:
    tag = uuid.uuid4().hex
    return " ".join(f"{tag[i % 32]}word{i}" for i in range(n_words))


def wait_idle(url: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Poll /debug/backends until the router's load counters are all zero."""
    deadline = time.monotonic() + timeout
    while True:
        backends = httpx.get(url + "/debug/backends", headers=headers(), timeout=5).json()["backends"]
        loads = [b["load"] for b in backends]
        if all(l["in_flight"] == 0 and l["prefill_tokens"] == 0 and l["decode_seqs"] == 0 and l["active_blocks"] == 0 for l in loads):
            return backends
        if time.monotonic() > deadline:
            raise AssertionError(f"load did not return to zero: {loads}")
        time.sleep(0.2)


# -- OpenAI surface through the SDK ---------------------------------------------------


def test_chat_completion_through_the_sdk(router_url: str) -> None:
    raw = client(router_url).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert raw.headers["x-kvrouter-backend"].startswith("sim-")
    reply = raw.parse()
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == 5


def test_completion_through_the_sdk(router_url: str) -> None:
    reply = client(router_url).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
    assert reply.choices[0].text


def test_streaming_chat_through_the_sdk(router_url: str) -> None:
    stream = client(router_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens == 8


def test_streaming_arrives_chunk_by_chunk(router_url: str) -> None:
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 300, "stream": True, "ignore_eos": True}
    arrivals = []
    with httpx.stream("POST", router_url + "/v1/completions", json=body, headers=headers(), timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 301  # 300 tokens + [DONE]
    # ~0.3 s of decoding at the fleet's speed: a buffering router delivers it all at once.
    assert arrivals[-1] - arrivals[0] > 0.05, "the stream was buffered and delivered at once"


def test_models_lists_every_model_and_adapter(router_url: str) -> None:
    ids = {m.id for m in client(router_url).models.list()}
    assert ids == {MODEL, GOLDEN_MODEL, "sql-adapter"}


def test_tokenize_and_embeddings_pass_through(router_url: str) -> None:
    r = httpx.post(router_url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}, headers=headers())
    assert r.status_code == 200 and r.json()["tokens"]
    assert r.headers["x-kvrouter-backend"].startswith("sim-")
    r = httpx.post(router_url + "/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=headers())
    assert "x-kvrouter-backend" in r.headers  # whatever the engine answers, it came from one


def test_lora_adapter_routes_to_the_base_pool_and_hashes_differently(router_url: str) -> None:
    text = unique_text(200)
    base = httpx.post(router_url + "/debug/route", json={"model": MODEL, "prompt": text}, headers=headers()).json()
    lora = httpx.post(router_url + "/debug/route", json={"model": "sql-adapter", "prompt": text}, headers=headers()).json()
    assert base["model"] == lora["model"] == MODEL
    assert base["num_tokens"] == lora["num_tokens"]


# -- errors ---------------------------------------------------------------------------


def error_of(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["message"]
    return err


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b'{"model": "qwen3-0.6b", "prompt": ', 400, "invalid_json"),
        (b'{"model": "qwen3-0.6b", "prompt": "caf\xe9"}', 400, "invalid_encoding"),
        (b'["not an object"]', 400, "invalid_json"),
        (b'{"prompt": "hi"}', 400, "missing_model"),
        (b'{"model": "qwen3-0.6b"}', 400, "missing_prompt"),
        (b'{"model": "no-such-model", "prompt": "hi"}', 404, "model_not_found"),
        (b'{"model": "qwen3-0.6b", "prompt": "hi", "stream": "yes"}', 400, "invalid_request"),
    ],
)
def test_bad_requests_get_openai_errors(router_url: str, content: bytes, status: int, code: str) -> None:
    r = httpx.post(router_url + "/v1/completions", content=content, headers={**headers(), "content-type": "application/json"})
    assert r.status_code == status, r.text
    assert error_of(r)["code"] == code


def test_chat_without_messages_is_400(router_url: str) -> None:
    r = httpx.post(router_url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=headers())
    assert r.status_code == 400 and error_of(r)["code"] == "missing_messages"


def test_prompt_over_max_model_len_is_400(router_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(router_url).completions.create(model=MODEL, prompt=[7] * (MAX_MODEL_LEN + 1), max_tokens=1)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    r = httpx.post(router_url + "/v1/completions", json={"model": MODEL, "prompt": [7] * 100, "max_tokens": MAX_MODEL_LEN}, headers=headers())
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"


def test_body_over_the_limit_is_413(router_url: str) -> None:
    r = httpx.post(router_url + "/v1/completions", json={"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}, headers=headers())
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_wrong_api_key_is_401_also_for_debug(router_url: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(router_url, key="sk-wrong").completions.create(model=MODEL, prompt="hi", max_tokens=1)
    for method, path in (("POST", "/debug/route"), ("GET", "/debug/backends"), ("GET", "/v1/models")):
        r = httpx.request(method, router_url + path, json={"model": MODEL, "prompt": "hi"}, headers=headers("nope"))
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert httpx.get(router_url + "/health").status_code == 200


def test_engine_errors_pass_through_in_openai_shape(router_url: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client(router_url).completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"min_tokens": -1})


# -- /debug -----------------------------------------------------------------------------


def test_debug_route_predicts_what_the_engine_reports_cached(router_url: str) -> None:
    text = unique_text(300)
    first = client(router_url).completions.with_raw_response.create(model=MODEL, prompt=text, max_tokens=1)
    backend = first.headers["x-kvrouter-backend"]
    body = {"model": MODEL, "prompt": text + " and more", "max_tokens": 1}
    deadline = time.monotonic() + 10
    while True:
        d = httpx.post(router_url + "/debug/route", json=body, headers=headers()).json()
        mine = next(c for c in d["candidates"] if c["backend"] == backend)
        if mine["matched_blocks"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [c["backend"] for c in d["candidates"]] == [f"sim-{i}" for i in range(N_ENGINES)]
    assert d["backend"] == backend and d["reason"] == "cache_hit"
    n, bs = d["num_tokens"], d["block_size"]
    assert mine["predicted_cached_tokens"] == min(mine["matched_blocks"], (n - 1) // bs) * bs
    second = client(router_url).completions.create(**body)
    assert second.usage.prompt_tokens == n
    assert second.usage.prompt_tokens_details.cached_tokens == mine["predicted_cached_tokens"]


def test_debug_backends_shows_load_and_event_streams(router_url: str) -> None:
    deadline = time.monotonic() + 15  # run alone, this test may come before the streams connect
    while True:
        backends = httpx.get(router_url + "/debug/backends", headers=headers()).json()["backends"]
        if all(b["connected"] for b in backends) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [b["name"] for b in backends] == [f"sim-{i}" for i in range(N_ENGINES)]
    for b in backends:
        assert b["healthy"] is True and b["url"].startswith("http://127.0.0.1:")
        assert b["connected"] is True
        for key in ("last_seq", "gaps", "replays", "blocks", "rehash_mode"):
            assert key in b
        assert {"in_flight", "prefill_tokens", "decode_seqs"} <= set(b["load"])
    # The engines' own gauges, scraped from their /metrics every second, are there too.
    deadline = time.monotonic() + 10
    while any(b["load"]["scraped_running"] is None for b in backends) and time.monotonic() < deadline:
        time.sleep(0.2)
        backends = httpx.get(router_url + "/debug/backends", headers=headers()).json()["backends"]
    for b in backends:
        assert b["load"]["scraped_running"] is not None and b["load"]["scraped_waiting"] is not None
        assert 0.0 <= b["load"]["scraped_kv_cache_usage"] <= 1.0


def test_metrics_expose_router_series(router_url: str) -> None:
    # Over a block (16 tokens): a shorter prompt has no block to look up, and no lookup time.
    client(router_url).completions.create(model=MODEL, prompt=unique_text(40), max_tokens=1)
    text = httpx.get(router_url + "/metrics", headers={"authorization": f"Bearer {API_KEY}"}).text
    for name in (
        "kvrouter_requests_total", "kvrouter_routing_decisions_total", "kvrouter_matched_blocks_bucket",
        "kvrouter_predicted_hit_ratio_bucket", "kvrouter_tokenize_seconds_bucket", "kvrouter_hash_seconds_bucket",
        "kvrouter_lookup_seconds_bucket", "kvrouter_overhead_seconds_bucket", "kvrouter_backend_in_flight_requests",
        "kvrouter_backend_healthy", "kvrouter_event_stream_last_seq", "kvrouter_kv_stream_connected",
        "kvrouter_tokenizer_segment_cache_tokens", "kvrouter_backend_scraped_unseen_requests",
    ):
        assert name in text, name


def golden_cases() -> list[dict[str, Any]]:
    path = GOLDEN / "render_vectors_vllm-0.33.0_qwen3-0.6b-tok.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_golden_render_vectors_through_debug_route(router_url: str) -> None:
    cases = golden_cases()
    assert len(cases) == 86
    failures = []
    with httpx.Client(base_url=router_url, headers=headers(), timeout=30) as http:
        for case in cases:
            r = http.post("/debug/route?include_tokens=true", json=case["request"])
            want = case["prompt_token_ids"]
            if want is None:
                if r.status_code != 400:
                    failures.append((case["id"], "expected 400", r.status_code))
                continue
            if r.status_code != 200:
                failures.append((case["id"], r.status_code, r.text[:200]))
                continue
            first = want[0] if want and isinstance(want[0], list) else want
            if r.json()["token_ids"] != first:
                failures.append((case["id"], "token ids differ"))
    assert not failures, failures


# -- every policy -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded", "power_of_two", "session", "prefix_approx", "kv_aware"])
def test_every_policy_routes_real_requests(fleet: dict[str, Any], policy: str) -> None:
    with InProcessRouter(fleet_config(fleet, policy=policy)) as r:
        c = client(r.url, key="unused")
        seen = Counter()
        for i in range(12):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=2,
                extra_headers={"x-session-id": "alice"},
            )
            assert raw.parse().choices[0].message.content is not None
            seen[raw.headers["x-kvrouter-backend"]] += 1
        route = httpx.post(r.url + "/debug/route", json={"model": MODEL, "prompt": "x"}).json()
        assert route["policy"] == policy and route["reason"]
        if policy == "round_robin":
            assert set(seen.values()) == {3}
        if policy == "session":
            assert len(seen) == 1
        wait_idle(r.url)


def test_segment_cache_stays_within_its_configured_bound(fleet: dict[str, Any]) -> None:
    """``Tuning.segment_cache_tokens`` bounds what the tokenizer's segment cache keeps (the chat
    soak's RSS grows toward the default bound for hours); prompts stay right above it."""
    bound = 300
    with InProcessRouter(fleet_config(fleet), Tuning(segment_cache_tokens=bound)) as r:
        c = client(r.url, key="unused")
        for i in range(4):
            text = unique_text(150)
            out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1)
            assert out.usage.prompt_tokens > 150
        page = httpx.get(r.url + "/metrics").text
        fill = [float(line.rsplit(" ", 1)[1]) for line in page.splitlines()  # labelled by tokenizer path
                if line.startswith("kvrouter_tokenizer_segment_cache_tokens{") and str(QWEN3_DIR) in line]
        assert fill and 0 < fill[0] <= bound, fill
        wait_idle(r.url)


def test_prefix_approx_keeps_a_conversation_on_one_backend(fleet: dict[str, Any]) -> None:
    with InProcessRouter(fleet_config(fleet, policy="prefix_approx")) as r:
        c = client(r.url, key="unused")
        history = [{"role": "system", "content": unique_text(400)}]
        backends = set()
        for turn in range(4):
            history.append({"role": "user", "content": f"turn {turn}"})
            raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=history, max_tokens=4)
            backends.add(raw.headers["x-kvrouter-backend"])
            history.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        assert len(backends) == 1


# -- the burst: a new 4k-token prefix over four backends -----------------------------


def test_burst_sharing_a_new_prefix_follows_the_first_request(fleet: dict[str, Any]) -> None:
    # Speculative insertion: every follower saves ~4k tokens on the leader's backend, far more
    # than the few uncached tokens queued there, so none is sent elsewhere.
    with InProcessRouter(fleet_config(fleet, policy="kv_aware")) as r:
        system = unique_text(800)
        probe = httpx.post(r.url + "/debug/route", json={"model": MODEL, "messages": [{"role": "system", "content": system}]}).json()
        assert 3900 <= probe["num_tokens"] <= 4800, probe["num_tokens"]  # a 4k-token prefix

        def body(i: int) -> dict[str, Any]:
            return {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"follower {i}"}], "max_tokens": 2}

        async def burst() -> tuple[str, list[tuple[str, str]]]:
            async with httpx.AsyncClient(base_url=r.url, timeout=60) as http:
                async with http.stream("POST", "/v1/chat/completions", json={**body(-1), "stream": True}) as first:
                    leader = first.headers["x-kvrouter-backend"]
                    sem = asyncio.Semaphore(32)

                    async def follower(i: int) -> tuple[str, str]:
                        async with sem:
                            resp = await http.post("/v1/chat/completions", json=body(i))
                            assert resp.status_code == 200, resp.text
                            return resp.headers["x-kvrouter-backend"], resp.headers["x-kvrouter-reason"]

                    results = await asyncio.gather(*(follower(i) for i in range(199)))
                    await first.aread()
                return leader, results

        leader, results = asyncio.run(burst())
        on_leader = sum(1 for b, _ in results if b == leader)
        reasons = Counter(reason for _, reason in results)
        assert on_leader >= 0.9 * len(results), (leader, Counter(b for b, _ in results), reasons)
        assert all(reason in ("cache_hit", "speculative_hit", "load_balance") for _, reason in results), reasons
        explained = httpx.post(r.url + "/debug/route", json=body(1000)).json()
        assert explained["backend"] == leader and explained["reason"] in ("cache_hit", "speculative_hit")
        lead = next(c for c in explained["candidates"] if c["backend"] == leader)
        assert max(lead["matched_blocks"], lead["speculative_blocks"]) >= probe["num_tokens"] // 16 - 1
        wait_idle(r.url)


# -- cold prompts: sent on their first block, tokenized in the background ------------------


def _cold(outcome: str) -> float:
    return REGISTRY.get_sample_value("kvrouter_cold_path_total", {"model": MODEL, "outcome": outcome}) or 0.0


def test_cold_prompt_is_sent_before_its_full_tokenization_then_settled(fleet: dict[str, Any]) -> None:
    # History memo off: it would route the re-sent prompt on remembered keys (tested below).
    with InProcessRouter(fleet_config(fleet, policy="kv_aware"), Tuning(history_memo=False)) as r:
        body = {"model": MODEL, "messages": [{"role": "user", "content": unique_text(600)}], "max_tokens": 3000, "min_tokens": 3000, "stream": True}
        checks = REGISTRY.get_sample_value("kvrouter_cold_head_checks_total", {"model": MODEL}) or 0.0
        backend, _ = _deferred_then_settled(r.url, body, "deferred")
        assert (REGISTRY.get_sample_value("kvrouter_cold_head_checks_total", {"model": MODEL}) or 0.0) == checks + 1
        assert not REGISTRY.get_sample_value("kvrouter_cold_head_mismatches_total", {"model": MODEL})
        wait_idle(r.url)
        # Sent again, the segment cache has seen it: the full path runs (inline), and the
        # request follows the first one (speculative insertion of the full keys, then events).
        seen = _cold("seen")
        again = httpx.post(r.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
        assert again.status_code == 200 and again.headers["x-kvrouter-backend"] == backend
        assert again.headers["x-kvrouter-reason"] in ("cache_hit", "speculative_hit")
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * (_num_blocks(r.url, body) - 1)
        assert _cold("seen") == seen + 1
        wait_idle(r.url)


def _deferred_then_settled(url: str, body: dict[str, Any], outcome: str) -> tuple[str, str]:
    """Stream ``body`` (a long generation), check it was sent with ``outcome`` before its first
    chunk, and that while it streams the background job replaces the estimate on its ticket by
    the exact keys; the backend and the reason."""
    before = _cold(outcome)
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        backend, reason = resp.headers["x-kvrouter-backend"], resp.headers["x-kvrouter-reason"]
        chunks = resp.iter_raw()  # kept referenced: a dropped generator closes the stream
        next(chunks)
        assert _cold(outcome) == before + 1
        expected = _num_blocks(url, body)
        deadline = time.monotonic() + 10
        while True:
            load = next(b["load"] for b in httpx.get(url + "/debug/backends").json()["backends"] if b["name"] == backend)
            if load["active_blocks"] == expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert load["active_blocks"] == expected, (load, expected)
        for _ in chunks:
            pass
    return backend, reason


def _num_blocks(url: str, body: dict[str, Any]) -> int:
    return int(httpx.post(url + "/debug/route", json=body).json()["num_blocks"])


def test_new_turn_of_a_seen_history_is_routed_on_the_history_then_settled(fleet: dict[str, Any]) -> None:
    """A chat whose history the router tokenized before, plus a new turn: it is routed on
    the history's exact blocks (a cache hit on the history's backend) before the new turn
    is tokenized, and the ticket then settles to the whole prompt's blocks. (With the
    history memo off: it would route this request before rendering anything, below.)"""
    with InProcessRouter(fleet_config(fleet, policy="kv_aware"), Tuning(history_memo=False)) as r:
        history = [{"role": "system", "content": unique_text(300)}, {"role": "user", "content": unique_text(400)}]
        first = httpx.post(r.url + "/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 2}, timeout=60)
        assert first.status_code == 200
        backend = first.headers["x-kvrouter-backend"]
        wait_idle(r.url)
        history += [{"role": "assistant", "content": "a short answer"}, {"role": "user", "content": "and " + unique_text(30)}]
        body = {"model": MODEL, "messages": history, "max_tokens": 3000, "min_tokens": 3000, "stream": True}
        assert _deferred_then_settled(r.url, body, "tail") in ((backend, "cache_hit"), (backend, "speculative_hit"))
        wait_idle(r.url)


@pytest.mark.parametrize("limit", [True, False], ids=["configured-limit", "engine-limit"])
def test_next_turns_of_a_conversation_are_routed_on_remembered_keys_then_checked(fleet: dict[str, Any], limit: bool) -> None:
    """Each turn of a conversation teaches the router its messages' keys (in the
    background); the next turn is routed on them to the backend holding the history, and
    its real keys are then checked against them. Without a configured max_model_len
    (the engines enforce theirs) nothing is rendered before routing; with one, the
    template is rendered to bound the length, and a turn over the limit gets its 400."""

    model = MODEL

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"model": model}) or 0.0

    def outcome(name: str) -> float:
        return REGISTRY.get_sample_value("kvrouter_cold_path_total", {"model": model, "outcome": name}) or 0.0

    config = fleet_config(fleet, policy="kv_aware")
    if not limit:
        del config["models"][0]["max_model_len"]
    with InProcessRouter(config) as r:
        messages = [{"role": "system", "content": unique_text(300)}, {"role": "user", "content": unique_text(400)}]
        first = httpx.post(r.url + "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2}, timeout=60)
        assert first.status_code == 200
        backend = first.headers["x-kvrouter-backend"]
        memo = r.server.config.app.state.router.models[model].history
        deadline = time.monotonic() + 10
        while len(memo) < 2 and time.monotonic() < deadline:  # learned once the answer is back
            time.sleep(0.02)
        assert len(memo) == 2
        wait_idle(r.url)
        checks, mismatches = sample("kvrouter_history_checks_total"), sample("kvrouter_history_mismatches_total")
        for turn in range(2):
            messages += [{"role": "assistant", "content": "an answer " + unique_text(20)}, {"role": "user", "content": "and " + unique_text(30)}]
            body = {"model": model, "messages": messages, "max_tokens": 3000, "min_tokens": 3000, "stream": True}
            assert _deferred_then_settled(r.url, body, "history") in ((backend, "cache_hit"), (backend, "speculative_hit"))
            deadline = time.monotonic() + 10
            while sample("kvrouter_history_checks_total") < checks + turn + 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert sample("kvrouter_history_checks_total") == checks + turn + 1
            wait_idle(r.url)
        assert sample("kvrouter_history_mismatches_total") == mismatches
        # The same history with another last question finds the entry for all but the last message.
        other = {"model": model, "messages": [*messages[:-1], {"role": "user", "content": "something else " + unique_text(20)}], "max_tokens": 2}
        before = outcome("history")
        again = httpx.post(r.url + "/v1/chat/completions", json=other, timeout=60)
        assert again.status_code == 200 and again.headers["x-kvrouter-backend"] == backend
        assert outcome("history") == before + 1
        if limit:
            huge = {"model": model, "messages": [*messages, {"role": "assistant", "content": "ok"},
                                                  {"role": "user", "content": unique_text(MAX_MODEL_LEN)}], "max_tokens": 2}
            before = outcome("history")
            over = httpx.post(r.url + "/v1/chat/completions", json=huge, timeout=60)
            # Its length bound fails the configured limit: tokenized in full and refused here
            # (deferred, it would have reached the engines, whose limit is twice as high).
            assert over.status_code == 400 and error_of(over)["code"] == "context_length_exceeded"
            assert outcome("history") == before
        wait_idle(r.url)


def _routing_counters() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every kvrouter counter and histogram sample but the event streams' (engines publish
    on their own clock), the upload clock (it times every body received) and the
    tokenizer's segment-cache counters (tokenizing warms that cache, like any lookup)."""
    ignored = ("kvrouter_kv_", "kvrouter_request_body_seconds", "kvrouter_tokenizer_segment")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in REGISTRY.collect()
        if fam.type in ("counter", "histogram") and fam.name.startswith("kvrouter_") and not fam.name.startswith(ignored)
        for s in fam.samples
    }


def test_debug_route_changes_nothing(fleet: dict[str, Any]) -> None:
    """/debug/route runs only the deciding stages: explaining a request, even one that would
    be deferred or routed on a remembered history, changes no counter, no load, no policy
    memory, no history memo entry or its order, and starts no background work."""
    with InProcessRouter(fleet_config(fleet, policy="kv_aware")) as r:
        router = r.server.config.app.state.router
        memo = router.models[MODEL].history
        messages = [{"role": "system", "content": unique_text(300)}, {"role": "user", "content": unique_text(400)}]
        sent = httpx.post(r.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}, timeout=60)
        assert sent.status_code == 200
        deadline = time.monotonic() + 10
        while (len(memo) < 2 or router.background.tasks or router.background.queued) and time.monotonic() < deadline:
            time.sleep(0.02)
        wait_idle(r.url)
        next_turn = {"model": MODEL, "max_tokens": 2, "messages": [
            *messages, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": unique_text(40)}]}
        cold = {"model": MODEL, "messages": [{"role": "user", "content": unique_text(600)}], "max_tokens": 2}

        def state() -> Any:
            return (_routing_counters(), list(memo._entries), dict(router.settler._pending),
                    router.background.queued, router.background.tasks)

        before = state()
        answers = [httpx.post(r.url + "/debug/route", json=b, timeout=60).json() for b in (next_turn, cold, cold)]
        assert state() == before
        assert answers[1]["candidates"] == answers[2]["candidates"], "the policy remembered nothing of the first"
        assert all(c["speculative_blocks"] == 0 and c["matched_blocks"] == 0 for c in answers[2]["candidates"])
        wait_idle(r.url, timeout=1)


def test_a_backlogged_background_thread_sends_prompts_down_the_full_path(fleet: dict[str, Any]) -> None:
    from router.background import MAX_SETTLING

    with InProcessRouter(fleet_config(fleet, policy="kv_aware")) as r:
        router = r.server.config.app.state.router
        router.background.queued = MAX_SETTLING  # as if that many deferred requests were queued
        busy, deferred = _cold("busy"), _cold("deferred")
        body = {"model": MODEL, "messages": [{"role": "user", "content": unique_text(600)}], "max_tokens": 2}
        assert httpx.post(r.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert (_cold("busy"), _cold("deferred")) == (busy + 1, deferred)
        router.background.queued = 0
        assert httpx.post(r.url + "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": unique_text(600)}]},
                          timeout=60).status_code == 200
        assert _cold("deferred") == deferred + 1
        wait_idle(r.url)


def test_cold_deferral_can_be_switched_off(fleet: dict[str, Any]) -> None:
    with InProcessRouter(fleet_config(fleet, policy="kv_aware"), Tuning(defer_cold_prompts=False)) as r:
        before = _cold("deferred")
        body = {"model": MODEL, "messages": [{"role": "user", "content": unique_text(600)}], "max_tokens": 2}
        assert httpx.post(r.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert _cold("deferred") == before
        wait_idle(r.url)


# -- chaos: load counters return to zero on every path ------------------------------------


def fault(fleet: dict[str, Any], i: int, **update: Any) -> None:
    r = httpx.post(f"http://127.0.0.1:{fleet['http'] + i}/debug/fault", json=update, timeout=5)
    assert r.status_code == 200, r.text


def engines_running(fleet: dict[str, Any]) -> float:
    from router.fleet.scrape import parse_vllm_metrics

    total = 0.0
    for i in range(N_ENGINES):
        text = httpx.get(f"http://127.0.0.1:{fleet['http'] + i}/metrics", timeout=5).text
        total += parse_vllm_metrics(text).get("vllm:num_requests_running", 0.0)
    return total


def test_load_returns_to_zero_after_chaos(fleet: dict[str, Any], router_url: str) -> None:
    async def disconnecting_client(http: httpx.AsyncClient, i: int) -> str | None:
        """The backend of a stream this client left mid-way, or None if it ended first."""
        body = {"model": MODEL, "prompt": f"disconnect {i} " + unique_text(50), "max_tokens": 30000, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            n = 0
            async for _ in resp.aiter_raw():
                n += 1
                if n >= 3:
                    return resp.headers["x-kvrouter-backend"]  # leave mid-stream: the router must cancel upstream
        return None

    async def long_stream(http: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": f"survive {i}", "max_tokens": 400, "stream": True, "ignore_eos": True}
        try:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                backend = resp.headers.get("x-kvrouter-backend", "")
                async for _ in resp.aiter_raw():
                    pass
                return backend
        except httpx.HTTPError:
            return "cut"

    async def plain(http: httpx.AsyncClient, i: int) -> int:
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": f"plain {i}", "max_tokens": 3})
        return resp.status_code

    async def chaos() -> tuple[Counter, int]:
        async with httpx.AsyncClient(base_url=router_url, headers=headers(), timeout=60) as http:
            streams = [asyncio.create_task(long_stream(http, i)) for i in range(16)]
            disconnects = [asyncio.create_task(disconnecting_client(http, i)) for i in range(16)]
            await asyncio.sleep(0.3)
            fault(fleet, 1, error_rate=1.0)  # answers 500 from now on (the breaker opens)
            fault(fleet, 2, down_s=2.0)  # killed with streams in flight; restarts empty
            statuses = await asyncio.gather(*(plain(http, i) for i in range(40)))
            left = [b for b in await asyncio.gather(*disconnects) if b is not None]
            await asyncio.gather(*streams)
            fault(fleet, 1, error_rate=0.0)
            return Counter(statuses), left

    statuses, left = asyncio.run(chaos())
    assert len(left) >= 8, "too few streams were left mid-way to test disconnects"
    assert statuses[200] > 0 and set(statuses) <= {200, 500, 502}, statuses
    wait_idle(router_url)
    for i in range(N_ENGINES):
        wait_http(f"http://127.0.0.1:{fleet['http'] + i}/health", timeout=30)
    # The abandoned 30k-token streams were cancelled upstream, not left generating.
    deadline = time.monotonic() + 10
    while (running := engines_running(fleet)) > 0:
        assert time.monotonic() < deadline, f"{running} requests still running on the engines"
        time.sleep(0.2)
    metrics = httpx.get(router_url + "/metrics", headers={"authorization": f"Bearer {API_KEY}"}).text
    def total(prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix))

    # A stream on the killed engine may be ended by the engine's death (a reset, a stream
    # without [DONE], or the health check finding it down) before the router sees its client
    # leave; every abandoned stream on the other engines is a disconnect.
    elsewhere = sum(1 for backend in left if backend != "sim-2")
    assert total("kvrouter_client_disconnects_total{") >= elsewhere, "clients that left mid-stream were not seen as disconnects"


# -- tokenizer modes, backend failure handling ---------------------------------------------


def test_remote_tokenizer_mode_routes_on_the_engines_token_ids(fleet: dict[str, Any], router_url: str) -> None:
    cfg = fleet_config(fleet)
    cfg["models"][0]["tokenizer_mode"] = "remote"
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": unique_text(40)}]}
    local = httpx.post(router_url + "/debug/route?include_tokens=true", json=body, headers=headers()).json()["token_ids"]
    with InProcessRouter(cfg) as r:
        remote = httpx.post(r.url + "/debug/route?include_tokens=true", json=body).json()
        assert remote["token_ids"] == local
        reply = client(r.url, key="unused").chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=2)
        assert reply.usage.prompt_tokens == len(local)


def test_a_dead_backend_is_retried_ejected_and_readmitted(fleet: dict[str, Any]) -> None:
    with InProcessRouter(fleet_config(fleet, policy="round_robin", health_interval_s=1.0)) as r:
        fault(fleet, 3, down_s=4.0)
        time.sleep(0.2)
        reasons = []
        for i in range(8):
            resp = httpx.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": f"retry {i}", "max_tokens": 2}, timeout=30)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvrouter-backend"] != "sim-3"
            reasons.append(resp.headers["x-kvrouter-reason"])
        states = {b["name"]: b for b in httpx.get(r.url + "/debug/backends").json()["backends"]}
        assert states["sim-3"]["healthy"] is False and states["sim-3"]["ejections"] >= 1
        deadline = time.monotonic() + 20
        while not httpx.get(r.url + "/debug/backends").json()["backends"][3]["healthy"]:
            assert time.monotonic() < deadline, "sim-3 was not re-admitted after it came back"
            time.sleep(0.3)
        seen = {httpx.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": f"back {i}", "max_tokens": 1}).headers["x-kvrouter-backend"] for i in range(8)}
        assert "sim-3" in seen
        wait_idle(r.url)


def test_circuit_breaker_opens_on_repeated_5xx_and_closes_after_cooldown(fleet: dict[str, Any]) -> None:
    # A cooldown far longer than the 24 requests take: the circuit must still be open when they end.
    cfg = fleet_config(fleet, policy="round_robin")
    with InProcessRouter(cfg, Tuning(breaker_failures=3)) as r:
        fault(fleet, 1, error_rate=1.0)
        try:
            statuses = Counter(
                httpx.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": f"cb {i}", "max_tokens": 1}).status_code
                for i in range(24)
            )
            states = {b["name"]: b for b in httpx.get(r.url + "/debug/backends").json()["backends"]}
            assert states["sim-1"]["circuit_open"] is True and states["sim-1"]["healthy"] is False
            assert statuses[500] <= 4, statuses  # the breaker stopped sending to sim-1 after 3 failures
        finally:
            fault(fleet, 1, error_rate=0.0)
        time.sleep(5.2)
        seen = {httpx.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": f"ok {i}", "max_tokens": 1}).headers["x-kvrouter-backend"] for i in range(8)}
        assert "sim-1" in seen
        wait_idle(r.url)


def test_redis_index_serves_cache_hits(fleet: dict[str, Any], redis_url: str) -> None:
    cfg = fleet_config(fleet)
    cfg["index"] = redis_url
    with InProcessRouter(cfg, Tuning(subscribe_events=True)) as r:
        text = unique_text(300)
        backend = httpx.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}).headers["x-kvrouter-backend"]
        deadline = time.monotonic() + 15
        while True:
            d = httpx.post(r.url + "/debug/route", json={"model": MODEL, "prompt": text + " again"}).json()
            mine = next(c for c in d["candidates"] if c["backend"] == backend)
            if mine["matched_blocks"] >= d["num_tokens"] // 16 - 1:
                break
            assert time.monotonic() < deadline, d
            time.sleep(0.2)
        assert d["backend"] == backend and d["reason"] == "cache_hit"


def test_serve_flags_override_the_config_file(fleet: dict[str, Any]) -> None:
    port = free_port()
    path = Path(fleet["dir"]) / "override.yaml"
    path.write_text(yaml.safe_dump(fleet_config(fleet, policy="kv_aware", port=1)))
    args = KVROUTER + ["serve", "--config", str(path), "--port", str(port), "--policy", "round_robin"]
    with Proc(args, Path(fleet["dir"]) / "override.log") as proc:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120, proc=proc.popen)
        assert httpx.post(f"http://127.0.0.1:{port}/debug/route", json={"model": MODEL, "prompt": "x"}).json()["policy"] == "round_robin"


def test_serve_rejects_an_unknown_config_key_by_name(tmp_path: Path, fleet: dict[str, Any]) -> None:
    cfg = fleet_config(fleet)
    cfg["router"]["polcy"] = "kv_aware"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(KVROUTER + ["serve", "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "router.polcy" in out.stderr
