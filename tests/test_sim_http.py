"""The simulator's HTTP surface behaves like ``vllm serve`` 0.33 (a real ``kvrouter sim`` process)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import zmq

from indexer.events import AllBlocksCleared, decode_batch, parse_pub_frames
from support import GOLDEN


@pytest.fixture
def sim(sim_fleet):
    return sim_fleet("--speedup", "20", "--num-blocks", "512")


def _usage(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_completion_and_chat_answer_with_deterministic_length_and_usage(sim) -> None:
    body = {"model": "qwen3", "prompt": "The KV cache stores keys and values", "max_tokens": 7, "ignore_eos": True}
    r = httpx.post(sim.http() + "/v1/completions", json=body, timeout=30).json()
    assert r["object"] == "text_completion" and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["text"]
    chat = {"model": "qwen3", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5, "min_tokens": 5}
    c = httpx.post(sim.http() + "/v1/chat/completions", json=chat, timeout=30).json()
    assert c["object"] == "chat.completion" and c["choices"][0]["message"]["role"] == "assistant"
    assert c["usage"]["prompt_tokens"] == 10 and c["usage"]["completion_tokens"] == 5


def test_stream_sends_one_chunk_per_token_then_usage_then_done(sim) -> None:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", sim.http() + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = [c for c in chunks[1:] if c["choices"]]
    assert len(tokens) == 12 and tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_cached_tokens_follow_vllm_never_the_whole_prompt(sim) -> None:
    ids = list(range(1000, 1000 + 64))  # exactly 4 blocks
    body = {"model": "qwen3", "prompt": ids, "max_tokens": 1}
    assert _usage(httpx.post(sim.http() + "/v1/completions", json=body, timeout=30))["prompt_tokens_details"]["cached_tokens"] == 0
    assert _usage(httpx.post(sim.http() + "/v1/completions", json=body, timeout=30))["prompt_tokens_details"]["cached_tokens"] == 48
    longer = {**body, "prompt": ids + [7, 8, 9]}
    assert _usage(httpx.post(sim.http() + "/v1/completions", json=longer, timeout=30))["prompt_tokens_details"]["cached_tokens"] == 64
    other = {**body, "prompt": ids[:20] + [1] + ids[21:]}
    assert _usage(httpx.post(sim.http() + "/v1/completions", json=other, timeout=30))["prompt_tokens_details"]["cached_tokens"] == 16
    metrics = httpx.get(sim.http() + "/metrics").text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="qwen3"} 128.0' in metrics
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="qwen3"} 259.0' in metrics


def test_errors_are_openai_shaped(sim) -> None:
    url = sim.http() + "/v1/completions"
    bad_json = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == 400
    unknown = httpx.post(url, json={"model": "gpt-9", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
    too_long = httpx.post(url, json={"model": "qwen3", "prompt": list(range(40_000)), "max_tokens": 1}, timeout=30)
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    bad_field = httpx.post(url, json={"model": "qwen3", "prompt": "x", "max_tokens": "many"})
    assert bad_field.status_code == 400 and bad_field.json()["error"]["param"] == "max_tokens"


def test_token_ids_out_of_vocabulary_are_a_400_like_vllm(sim) -> None:
    """vLLM's renderer refuses them; the simulator once crashed into a 500 (found by tests/test_fuzz_http.py)."""
    for ids in ([10**20], [5, 2**63], [1_000_000], [[1, 2], [3, 2**64]]):
        r = httpx.post(sim.http() + "/v1/completions", json={"model": "qwen3", "prompt": ids, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"], r.text
    r = httpx.post(sim.http() + "/detokenize", json={"model": "qwen3", "tokens": [1, 2**70]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def test_unknown_paths_and_methods_are_openai_shaped(sim) -> None:
    missing = httpx.post(sim.http() + "/v1/embeddings", json={"model": "qwen3", "input": "x"})
    assert missing.status_code == 404 and missing.json()["error"] == {"message": "Not Found", "type": "Not Found", "param": None, "code": 404}
    wrong = httpx.get(sim.http() + "/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405 and wrong.headers["allow"] == "POST"


def test_tokenize_and_render_match_vllm_render_vectors(sim) -> None:
    cases = [json.loads(line) for line in (GOLDEN / "render_vectors_vllm-0.33.0_qwen3-0.6b-tok.jsonl").open()]
    checked = 0
    for case in cases:
        if case["prompt_token_ids"] is None or case["request"].get("truncate_prompt_tokens") or checked >= 12:
            continue
        req = {**case["request"], "model": "qwen3"}
        if case["endpoint"] == "chat":
            got = httpx.post(sim.http() + "/v1/chat/completions/render", json=req, timeout=30).json()["token_ids"]
            tok = httpx.post(sim.http() + "/tokenize", json=req, timeout=30).json()
            assert tok["tokens"] == got and tok["count"] == len(got)
        else:
            got = [g["token_ids"] for g in httpx.post(sim.http() + "/v1/completions/render", json=req, timeout=30).json()]
            if not case["request"].get("batch") and not isinstance(case["prompt_token_ids"][0], list):
                got = got[0]
        assert got == case["prompt_token_ids"], case["id"]
        checked += 1
    assert checked >= 10
    text = httpx.post(sim.http() + "/detokenize", json={"model": "qwen3", "tokens": [9707, 0]}).json()["prompt"]
    assert text == "Hello!"


def test_reset_prefix_cache_publishes_all_blocks_cleared(sim) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sim.kv())
    time.sleep(0.3)
    httpx.post(sim.http() + "/v1/completions", json={"model": "qwen3", "prompt": list(range(40)), "max_tokens": 1}, timeout=30)
    assert httpx.get(sim.http() + "/debug/cache").json()["block_hashes_int64"]
    assert httpx.post(sim.http() + "/reset_prefix_cache").status_code == 200
    assert httpx.get(sim.http() + "/debug/cache").json()["block_hashes_int64"] == []
    seen = []
    while sub.poll(2000):
        _, _, payload = parse_pub_frames(sub.recv_multipart())
        seen.extend(type(e) for e in decode_batch(payload).events)
        if AllBlocksCleared in seen:
            break
    sub.close(0)
    assert AllBlocksCleared in seen


def test_fault_injection_errors_and_kill_then_restart(sim) -> None:
    body = {"model": "qwen3", "prompt": "x", "max_tokens": 1}
    assert httpx.post(sim.http() + "/debug/fault", json={"error_rate": 1.0}).status_code == 200
    r = httpx.post(sim.http() + "/v1/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    httpx.post(sim.http() + "/debug/fault", json={"error_rate": 0.0, "down_s": 1.0})
    time.sleep(0.4)
    with pytest.raises(httpx.TransportError):
        httpx.get(sim.http() + "/health", timeout=1)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if httpx.get(sim.http() + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    assert httpx.post(sim.http() + "/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.get(sim.http() + "/debug/fault").json()["seq"] <= 1
    assert httpx.post(sim.http() + "/debug/fault", json={"bogus": 1}).status_code == 400
