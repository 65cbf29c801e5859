"""HTTP fuzz (issue 17 §3): generated requests against a real ``kvrouter serve`` in front of ``kvrouter sim``.

Every router endpoint (the OpenAI ones, ``/tokenize``, ``/debug/*``, ``/health``,
``/metrics``), unknown paths and methods, get hypothesis-built bodies, headers and
query strings: valid requests with fields mutated (wrong types, huge ``max_tokens``,
negative ``n``, unknown fields, deep nesting), raw bodies (not UTF-8, not JSON,
truncated, nested thousands deep, over ``max_body_bytes``), and odd headers
(wrong keys, content types, spoofed ``x-kvrouter-*``, bytes >= 0x80). Most go through
httpx; a share goes over a raw socket, which can put bytes in the request target and
header values that no client library would send.

Every answer must be: not a 5xx (the simulated fleet is healthy, so nothing may fail
server-side), an OpenAI-shaped error whenever it is an error
(``{"error": {"message", "type", "code"}}``), and for a stream, events that are JSON
objects ending with ``[DONE]`` or an error event. After each test the router is healthy,
its load counters are back to 0 and its log holds no traceback.

The one kind of answer that is not the router's: a request uvicorn's HTTP parser refuses
(a control character in a header, a malformed request line, the body of a request that
asked for an ``Upgrade`` other than websocket) is answered by uvicorn itself,
``400 Invalid HTTP request received.`` in plain text, before any router code runs.
Exactly that answer is accepted (and counted) for any case.

``make test`` runs about 1,000 cases; ``KVROUTER_FUZZ_FULL=1`` runs 12,000.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import (
    KVROUTER,
    QWEN3_DIR,
    Proc,
    RouterProc,
    free_ports,
    FUZZ_FULL,
    fuzz_cases,
    openai_error,
    sse_events,
    wait_http,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "qwen3"
ADAPTER = "qwen3-lora"
CLIENT_KEY = "sk-fuzz-client"
ADMIN_KEY = "sk-fuzz-admin"
MAX_BODY = 64 * 1024
MAX_MODEL_LEN = 1024
PARSER_REJECTION = b"Invalid HTTP request received."
COUNTS = {"bodies": fuzz_cases(450, 6000), "raw": fuzz_cases(200, 2500), "surface": fuzz_cases(250, 2500),
          "wire": fuzz_cases(120, 1200)}


# -- the fleet -----------------------------------------------------------------------------


@dataclass
class Fleet:
    router: RouterProc
    sim: Proc
    client: httpx.Client
    statuses: dict[int, int] = field(default_factory=dict)
    parser_rejections: int = 0
    sent: dict[str, int] = field(default_factory=dict)
    """Cases sent by each suite that ran against this fleet (a name in :data:`SUITES`)."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fuzz-http")
    base = free_ports(6)
    sim = Proc([*KVROUTER, "sim", "--port", str(base), "--model", MODEL, "--tokenizer", str(QWEN3_DIR),
                "--kv-events-port", str(base + 2), "--replay-port", str(base + 4), "--instances", "2",
                "--speedup", "50", "--mean-output-tokens", "3", "--max-model-len", str(MAX_MODEL_LEN)],
               tmp / "sim.log")
    try:
        for i in range(2):
            wait_http(f"http://127.0.0.1:{base + i}/health", timeout=90, proc=sim.popen)
        backends = [{"name": f"sim{i}", "url": f"http://127.0.0.1:{base + i}", "kv_events": f"tcp://127.0.0.1:{base + 2 + i}",
                     "kv_replay": f"tcp://127.0.0.1:{base + 4 + i}"} for i in range(2)]
        config = {
            "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "backends": backends,
                        "lora_adapters": [{"name": ADAPTER, "path": "/adapters/fuzz", "id": 1}]}],
            "router": {"api_key": CLIENT_KEY, "admin_api_key": ADMIN_KEY, "max_body_bytes": MAX_BODY,
                       "request_timeout_s": 60, "health_interval_s": 1.0},
        }
        router = RouterProc("router", config, tmp, log_level="info")
        try:
            with httpx.Client(base_url=router.url, timeout=60) as client:
                yield Fleet(router, sim, client)
        finally:
            router.stop()
    finally:
        sim.stop()


def assert_router_sound(fleet: Fleet) -> None:
    """Alive and healthy, no request left on the load counters, no traceback in the log."""
    assert fleet.router.proc.alive(), fleet.router.log()[-3000:]
    r = httpx.get(fleet.router.url + "/health", timeout=30)
    assert r.status_code == 200, r.text
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    deadline = time.monotonic() + 30
    while True:
        backends = httpx.get(fleet.router.url + "/debug/backends", headers=admin, timeout=30).json()["backends"]
        loads = {b["name"]: b["load"] for b in backends}
        if all(v["in_flight"] == 0 and v["prefill_tokens"] == 0 and v["active_blocks"] == 0 for v in loads.values()):
            break
        assert time.monotonic() < deadline, f"load counters not back to 0: {loads}"
        time.sleep(0.1)
    log = fleet.router.log()
    for marker in ("Traceback", "Exception in ASGI application", " ERROR ", "RecursionError"):
        assert marker not in log, log[log.index(marker) - 2000 : log.index(marker) + 3000]


# -- what an answer must look like -----------------------------------------------------------


@dataclass
class Case:
    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    body: bytes | None = None

    def describe(self) -> str:
        body = self.body if self.body is None or len(self.body) < 600 else self.body[:600] + b"..."
        return f"{self.method} {self.path}?{self.query} headers={self.headers!r} body={body!r}"


def check_answer(fleet: Fleet, case: Case, status: int, headers: httpx.Headers | dict[str, str], body: bytes) -> None:
    fleet.statuses[status] = fleet.statuses.get(status, 0) + 1
    if status == 400 and body == PARSER_REJECTION:
        fleet.parser_rejections += 1  # uvicorn's, before the router saw it (see the module docstring)
        return
    where = f"{case.describe()}\n-> {status} {body[:800]!r}"
    assert status < 500, where
    if case.method == "HEAD":
        return
    content_type = headers.get("content-type", "")
    if status >= 400:
        try:
            openai_error(body)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{where}") from None
    elif content_type.startswith("text/event-stream"):
        events, rest = sse_events(body)
        assert events and not rest.strip(), where
        for data in events[:-1]:
            doc = json.loads(data)
            assert isinstance(doc, dict) and "error" not in doc, where
        last = events[-1]
        assert last == b"[DONE]" or "error" in json.loads(last), where
    elif content_type.startswith("application/json"):
        json.loads(body)


def legal(value: bytes) -> bytes:
    """``value`` less what h11 refuses to send (control characters, surrounding blanks): the wire cases send those."""
    return bytes(c for c in value if c >= 0x20 and c != 0x7F).strip(b" \t")


def send(fleet: Fleet, case: Case) -> None:
    """One request with httpx; a stream is read to its end."""
    url = case.path + ("?" + case.query if case.query else "")
    headers = [(k, legal(v)) for k, v in case.headers]
    request = fleet.client.build_request(case.method, url, headers=headers, content=case.body)
    r = fleet.client.send(request, stream=True)
    try:
        body = r.read()
    finally:
        r.close()
    check_answer(fleet, case, r.status_code, r.headers, body)


def run(name: str, fleet: Fleet) -> None:
    """Suite ``name``: ``one(fleet, example)`` for ``COUNTS[name]`` examples of its strategy
    (:data:`SUITES`), then the soundness checks."""
    strategy, one = SUITES[name]
    sent = fleet.sent
    sent[name] = 0

    @settings(max_examples=COUNTS[name], deadline=None, database=None, derandomize=not FUZZ_FULL,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def fuzz(example: Any) -> None:
        sent[name] += 1
        one(fleet, example)
        if sent[name] % 100 == 0:
            assert fleet.router.proc.alive(), fleet.router.log()[-3000:]

    fuzz()
    assert sent[name] >= COUNTS[name] * 0.9, (sent, COUNTS)
    assert_router_sound(fleet)


# -- strategies ----------------------------------------------------------------------------

KEYS = st.sampled_from([CLIENT_KEY, CLIENT_KEY, CLIENT_KEY, ADMIN_KEY, "wrong", "", CLIENT_KEY + " ", "x" * 5000])
SCHEMES = st.sampled_from(["Bearer ", "Bearer ", "bearer ", "BEARER  ", "Basic ", "", "Bearer\t"])
AUTH = st.one_of(st.builds(lambda s, k: (s + k).encode(), SCHEMES, KEYS), st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\x00", b"")))
CONTENT_TYPES = st.sampled_from([
    b"application/json", b"application/json", b"application/json; charset=utf-8", b"text/plain",
    b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x", b"", b"application/json\xff",
])
TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20)
HEADER_VALUE = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60).map(str.encode),
    st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x80 or 0x20 <= c < 0x7F)),
    st.integers(100, 6000).map(lambda n: b"v" * n),
)
EXTRA_HEADERS = st.lists(st.one_of(
    st.tuples(st.sampled_from(["x-request-id", "x-session-id", "traceparent", "user-agent", "accept", "x-kvrouter-backend",
                               "x-kvrouter-reason", "content-encoding", "accept-encoding", "x-forwarded-for", "cookie",
                               "proxy-authorization", "te", "upgrade", "keep-alive", "range", "if-none-match"]), HEADER_VALUE),
    st.tuples(TOKEN.map(lambda t: "x-" + t), HEADER_VALUE),
    st.tuples(st.just("connection"), st.sampled_from([b"keep-alive", b"keep-alive, x-request-id", b"te, content-type, accept", b"upgrade"])),
), max_size=6)


@st.composite
def headers_for(draw: st.DrawFn, path: str, body: bool) -> list[tuple[str, bytes]]:
    """Mostly the right key (so the fuzz gets past authentication), and odd headers."""
    out: list[tuple[str, bytes]] = []
    right = ADMIN_KEY if path.startswith("/debug") else CLIENT_KEY
    roll = draw(st.integers(0, 9))
    if roll < 7:
        out.append(("authorization", f"Bearer {right}".encode()))
    elif roll < 9:
        out.append(("authorization", draw(AUTH)))
    if body and draw(st.integers(0, 9)) < 8:
        out.append(("content-type", b"application/json" if draw(st.booleans()) else draw(CONTENT_TYPES)))
    out += draw(EXTRA_HEADERS)
    return out


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, -(2**63), 10**30]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30), st.sampled_from(["", "qwen3", "\u0000", "<|im_start|>", "\U0001f600" * 3]),
)
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4), max_leaves=12)


def nested(depth: int, leaf: Any = 1) -> Any:
    out = leaf
    for i in range(depth):
        out = [out] if i % 2 else {"k": out}
    return out


ODD = st.one_of(JSON, st.integers(2, 400).map(nested), st.text(min_size=3000, max_size=3000).map(lambda s: s))
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 151_000), st.integers(0, 151_000), st.sampled_from([-1, 151_936, 2**31, 2**63, 10**20, True, 1.5, "7", None])),
                     min_size=0, max_size=40)
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def long_text(n: int, k: int) -> str:
    """``n`` words, a different text for each ``k``: long enough for the router's cold-prompt and history paths."""
    return " ".join(WORDS[(i * 7 + k * (i // 5)) % len(WORDS)] for i in range(n))


TEXT = st.one_of(st.text(max_size=60), st.sampled_from(["hi", "<|im_start|>user\nhi<|im_end|>", "\u00e9\u6f22\U0001f600", " " * 50, "<think>x</think>"]),
                 st.builds(long_text, st.integers(1, 3000), st.integers(0, 50)))
PROMPT = st.one_of(TEXT, TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3), st.lists(TOKEN_IDS, max_size=3), ODD)
CONTENT = st.one_of(TEXT, TEXT, st.none(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "video_url", "nope", 5])}, optional={"image_url": JSON, "text": JSON}),
    JSON), max_size=3), ODD)
ROLE = st.one_of(st.sampled_from(["user", "user", "system", "assistant", "tool", "developer", "function", ""]), JSON)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLE, "content": CONTENT}, optional={
        "name": JSON, "tool_call_id": JSON, "reasoning_content": st.one_of(TEXT, JSON),
        "tool_calls": st.one_of(JSON, st.lists(st.fixed_dictionaries({"id": TEXT, "type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.one_of(TEXT, JSON), "arguments": st.one_of(st.just('{"a": 1}'), TEXT, JSON)})}), max_size=2)),
    }),
    JSON,
)
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=4), st.lists(MESSAGE, max_size=0), ODD)
INTS = st.one_of(st.integers(0, 8), st.integers(0, 8), st.sampled_from([-1, -5, 0, 2**31, 2**63, 10**30, MAX_MODEL_LEN, True]), JSON)
TOOLS = st.one_of(JSON, st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT}, optional={"description": TEXT, "parameters": st.one_of(st.just({"type": "object"}), JSON)})}), max_size=2))

OPTIONAL_FIELDS = {
    "max_tokens": INTS, "max_completion_tokens": INTS, "n": INTS, "min_tokens": INTS, "seed": INTS, "logprobs": INTS,
    "top_logprobs": INTS, "truncate_prompt_tokens": INTS, "temperature": st.one_of(st.floats(-1, 3), JSON),
    "top_p": st.one_of(st.floats(-1, 2), JSON), "stream": st.one_of(st.booleans(), st.booleans(), JSON),
    "stream_options": st.one_of(st.just({"include_usage": True}), JSON), "cache_salt": st.one_of(TEXT, JSON),
    "user": st.one_of(TEXT, JSON), "ignore_eos": st.one_of(st.booleans(), JSON), "stop": JSON, "echo": JSON,
    "add_special_tokens": st.one_of(st.booleans(), JSON), "prompt_embeds": JSON, "priority": INTS,
    "tools": TOOLS, "tool_choice": JSON, "response_format": JSON, "chat_template": st.one_of(st.just("{{ messages }}"), JSON),
    "chat_template_kwargs": st.one_of(st.just({"enable_thinking": False}), JSON), "add_generation_prompt": st.one_of(st.booleans(), JSON),
    "continue_final_message": st.one_of(st.booleans(), JSON), "documents": JSON, "input": st.one_of(TEXT, JSON),
    "tokens": st.one_of(TOKEN_IDS, JSON), "messages": MESSAGES, "prompt": PROMPT,
}
GENERATION_PATHS = ["/v1/completions", "/v1/chat/completions", "/debug/route", "/tokenize", "/v1/embeddings", "/detokenize"]


VALID_FIELDS = {
    "max_tokens": st.integers(1, 6), "max_completion_tokens": st.integers(1, 6), "n": st.just(1), "min_tokens": st.integers(0, 2),
    "seed": st.integers(0, 2**63 - 1), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}), "cache_salt": st.text(min_size=1, max_size=10), "user": st.text(max_size=10),
    "ignore_eos": st.booleans(), "add_special_tokens": st.booleans(), "logprobs": st.none(),
    "chat_template_kwargs": st.just({"enable_thinking": False}), "add_generation_prompt": st.booleans(),
}
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}), min_size=1, max_size=6)
VALID_PROMPT = st.one_of(TEXT.filter(bool), st.lists(st.integers(0, 151_000), min_size=1, max_size=64))


@st.composite
def openai_bodies(draw: st.DrawFn) -> Case:
    """A request for one of the POST endpoints: half plausible (a few fields, right types),
    half with fields mutated, missing or of the wrong type, and unknown fields."""
    path = draw(st.sampled_from(GENERATION_PATHS + ["/v1/completions", "/v1/chat/completions"] * 2))
    chat = path == "/v1/chat/completions" or (path in ("/debug/route", "/tokenize") and draw(st.booleans()))
    body: dict[str, Any] = {"model": draw(st.sampled_from([MODEL, MODEL, MODEL, ADAPTER]))}
    if chat:
        body["messages"] = draw(VALID_MESSAGES)
    elif path != "/v1/embeddings":
        body["prompt"] = draw(VALID_PROMPT)
    body["max_tokens"] = draw(st.integers(1, 6))
    for name in draw(st.lists(st.sampled_from(sorted(VALID_FIELDS)), max_size=4, unique=True)):
        body[name] = draw(VALID_FIELDS[name])
    if chat and draw(st.integers(0, 4)) == 0:
        body["tools"] = draw(TOOLS.filter(lambda t: isinstance(t, list)))
    if draw(st.booleans()):
        if draw(st.integers(0, 3)) == 0:
            body["model"] = draw(JSON)
        for name in draw(st.lists(st.sampled_from(sorted(OPTIONAL_FIELDS)), min_size=1, max_size=4, unique=True)):
            body[name] = draw(OPTIONAL_FIELDS[name])
        for _ in range(draw(st.integers(0, 2))):
            body[draw(st.text(max_size=12))] = draw(ODD)
        for key in draw(st.lists(st.sampled_from(["model", "prompt", "messages", "max_tokens"]), max_size=1)):
            body.pop(key, None)
    raw = json.dumps(body).encode()
    query = draw(st.sampled_from(["", "", "", "include_tokens=true", "include_tokens=1&x=y", "include_tokens=%ff"]))
    return Case("POST", path, query, draw(headers_for(path, True)), raw)


def deep(depth: int, opener: bytes) -> bytes:
    closer = b"]" if opener == b"[" else b"}"
    if opener == b"{":
        return b'{"a":' * depth + b"1" + closer * depth
    return opener * depth + closer * depth


RAW_BODIES = st.one_of(
    st.binary(max_size=200),
    st.binary(max_size=60).map(lambda b: b'{"model": "qwen3", "prompt": "' + b + b'"}'),
    st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"model": ', b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00",
                     b'{"model": "qwen3", "prompt": "x", "max_tokens": 1e400}', b'{"prompt": NaN}', b'{"a": 1,}', b"{'a': 1}"]),
    st.tuples(st.integers(1, 20000), st.sampled_from([b"[", b"{"])).map(lambda t: deep(*t)),
    st.tuples(st.integers(1, 20000), st.sampled_from([b"[", b"{"])).map(lambda t: b'{"model": "qwen3", "prompt": ' + deep(*t) + b"}"),
    st.integers(MAX_BODY - 64, MAX_BODY * 2).map(lambda n: b'{"model": "qwen3", "prompt": "' + b"a" * n + b'"}'),
    st.builds(lambda body, cut: body[:cut], st.just(json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).encode()), st.integers(0, 60)),
    st.text(max_size=80).map(lambda s: s.encode("utf-16")),
    st.text(max_size=80).map(lambda s: s.encode("latin-1", "replace")),
)


@st.composite
def raw_bodies(draw: st.DrawFn) -> Case:
    path = draw(st.sampled_from(GENERATION_PATHS))
    return Case("POST", path, "", draw(headers_for(path, True)), draw(RAW_BODIES))


ALL_PATHS = GENERATION_PATHS + ["/v1/models", "/health", "/metrics", "/debug/backends"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
PATHS = st.one_of(
    st.sampled_from(ALL_PATHS), st.sampled_from(ALL_PATHS),
    st.sampled_from(ALL_PATHS).map(lambda p: p + "/"), st.sampled_from(ALL_PATHS).map(str.upper),
    st.sampled_from(["/", "//v1/models", "/v1", "/v1/", "/debug", "/debug/", "/debug/streams", "/v1/models/qwen3", "/docs",
                     "/openapi.json", "/v1/completions/render", "/reset_prefix_cache", "/%76%31/models", "/v1/%ff", "/..%2f..%2fetc",
                     "/v1/models%00", "/" + "a" * 7000]),
    TOKEN.map(lambda t: "/" + t),
)
QUERIES = st.one_of(
    st.just(""), st.just(""),
    st.lists(st.tuples(TOKEN, st.text(max_size=20)), max_size=4).map(lambda kv: str(httpx.QueryParams(kv))),
    st.sampled_from(["include_tokens=true", "include_tokens=TRUE&include_tokens=no", "a=%ff%fe", "a=%00", "%%%", "=&=&",
                     "a[]=1&a[]=2", "x=" + "y" * 6000]),
)


@st.composite
def surface(draw: st.DrawFn) -> Case:
    """Any method on any path, known or not, with a small body or none."""
    method = draw(st.sampled_from(METHODS))
    path = draw(PATHS)
    body = draw(st.one_of(st.none(), st.just(json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()), st.binary(max_size=30)))
    if method in ("GET", "HEAD", "OPTIONS") and draw(st.booleans()):
        body = None
    return Case(method, path, draw(QUERIES), draw(headers_for(path, body is not None)), body)


# -- the raw socket ----------------------------------------------------------------------------


def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as it is (it asks for ``connection: close``) and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return status, headers, body


def dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while True:
        end = data.index(b"\r\n", i)
        size = int(data[i:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2 : end + 2 + size])
        i = end + 2 + size + 2


TARGET_BYTES = st.binary(max_size=12).map(lambda b: bytes(c for c in b if c not in b" \r\n"))


@st.composite
def wire(draw: st.DrawFn) -> tuple[Case, bytes]:
    """A request whose target and header values carry arbitrary bytes (valid framing otherwise)."""
    case = draw(st.one_of(surface(), openai_bodies()))
    target = case.path.encode() + draw(TARGET_BYTES)
    query = case.query.encode() + draw(TARGET_BYTES)
    if query:
        target += b"?" + query
    headers = [(k.encode(), v) for k, v in case.headers]
    headers += draw(st.lists(st.tuples(TOKEN.map(str.encode), st.binary(max_size=20)), max_size=3))
    body = case.body or b""
    head = b"%s %s HTTP/1.1\r\nhost: fuzz\r\n" % (case.method.encode(), target)
    head += b"".join(k + b": " + v + b"\r\n" for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding", b"host"))
    head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    return case, head + body


def send_wire(fleet: Fleet, example: tuple[Case, bytes]) -> None:
    case, request = example
    status, headers, body = raw_exchange(fleet.router.port, request)
    check_answer(fleet, case, status, headers, body)


SUITES: dict[str, tuple[st.SearchStrategy[Any], Callable[[Fleet, Any], None]]] = {
    "bodies": (openai_bodies(), send),
    "raw": (raw_bodies(), send),
    "surface": (surface(), send),
    "wire": (wire(), send_wire),
}


# -- the tests ---------------------------------------------------------------------------------


def test_fuzzed_openai_bodies_get_answers_or_openai_errors(fleet: Fleet) -> None:
    run("bodies", fleet)
    assert fleet.statuses.get(200, 0) > COUNTS["bodies"] // 20, fleet.statuses  # the fuzz also reaches the engines


def test_raw_garbage_bodies_get_openai_errors(fleet: Fleet) -> None:
    run("raw", fleet)


def test_any_method_path_query_and_headers_get_openai_errors(fleet: Fleet) -> None:
    run("surface", fleet)


def test_arbitrary_bytes_on_the_wire_never_break_the_router(fleet: Fleet) -> None:
    run("wire", fleet)


def test_an_unknown_path_is_an_openai_404(fleet: Fleet) -> None:
    """Starlette answered ``{"detail": "Not Found"}`` (found by this fuzz)."""
    for method, path in (("GET", "/nowhere"), ("POST", "/v1/chat"), ("GET", "/debug/streams"), ("PUT", "/")):
        r = fleet.client.request(method, path, headers={"authorization": f"Bearer {CLIENT_KEY}"})
        assert r.status_code == 404, r.text
        assert openai_error(r.content) == {"message": "Not Found", "type": "invalid_request_error", "code": "not_found"}


def test_a_method_the_path_does_not_take_is_an_openai_405_naming_the_allowed_ones(fleet: Fleet) -> None:
    """Starlette answered ``{"detail": "Method Not Allowed"}`` (found by this fuzz)."""
    for method, path, allow in (("GET", "/v1/completions", {"POST"}), ("DELETE", "/debug/backends", {"HEAD", "GET"}),
                                ("POST", "/health", {"HEAD", "GET"})):
        r = fleet.client.request(method, path, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == allow, r.text
        assert openai_error(r.content)["code"] == "method_not_allowed"


def test_head_on_a_router_endpoint_goes_through_its_checks(fleet: Fleet) -> None:
    """HEAD reaches the endpoints through FastAPI, which now calls them through the same error guard."""
    assert fleet.client.head("/v1/models").status_code == 401
    assert fleet.client.head("/v1/models", headers={"authorization": f"Bearer {CLIENT_KEY}"}).status_code == 200
    assert fleet.client.head("/debug/backends", headers={"authorization": f"Bearer {CLIENT_KEY}"}).status_code == 401


def test_case_count(fleet: Fleet) -> None:
    """The run's size, printed for the report (``-s``), and what each status was answered.
    The suites that have not run against this fleet (this test run alone, or with ``-k``)
    run first, so the count is always the whole fuzz."""
    for name in [n for n in SUITES if n not in fleet.sent]:
        run(name, fleet)
    total = sum(fleet.sent.values())
    print(f"\nHTTP fuzz: {total} cases {fleet.sent}, statuses {dict(sorted(fleet.statuses.items()))}, "
          f"{fleet.parser_rejections} refused by uvicorn's parser")
    assert total >= 0.9 * sum(COUNTS.values())
