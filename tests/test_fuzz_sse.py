"""SSE fuzz (issue 17 §3): an engine that streams malformed, split and oversized frames, and dies mid-stream.

Behind a real ``kvrouter serve`` is :class:`ScriptedEngine`, an aiohttp server on
loopback in this process that answers each streamed request with a script drawn from a
seeded RNG: events that are good OpenAI chunks or malformed (not JSON, not UTF-8,
comments and unknown fields, CR or CRLF line ends, several ``data:`` lines, a last event
without its empty line, ``[DONE]`` in the middle), some of them megabytes long, written
whole, byte by byte, or cut at random points (mid-UTF-8 included) with pauses so the
pieces reach the router apart, and then an ending: a clean end, a reset, a close without
the chunked terminator, or a stall past the router's read timeout.

What the client must get, whatever the script (the router relays bytes, it does not
re-encode them, so a malformed event the engine completed reaches the client as sent):

- a stream that ends with ``[DONE]`` is relayed byte for byte;
- anything else (the engine died, stalled, or ended without ``[DONE]``) ends with one
  error event of its own, ``data: {"error": {...}}``, after a prefix of the engine's
  bytes that stops at an event boundary: never a half event glued to the error, never a
  200 that ends silently;
- an engine that fails before its first byte gets an OpenAI-shaped 502/504;
- within the read timeout plus slack (never a hang);

and after every case the router's load ticket is released (``in_flight`` back to 0 in
``/debug/backends``), a client that hangs up mid-stream included.

``make test`` runs 300 scripts; ``KVROUTER_FUZZ_FULL=1`` runs 3,000.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http import sse
from router.http.sse import EventCut
from support import QWEN3_DIR, LoopbackEngine, RouterProc, fuzz_cases, openai_error, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "m"
READ_TIMEOUT_S = 3.0
CASES = fuzz_cases(300, 3000)
SEED = 1717


@dataclass
class Script:
    """What the engine does for one request: ``pieces`` written in order (each after
    ``pause`` seconds), then ``ending``: eof, reset, close or stall."""

    pieces: list[bytes]
    pauses: list[float]
    ending: str
    status: int = 200
    content_type: str = "text/event-stream"
    hang_up_after: int | None = None
    """The client closes the connection after reading this many bytes (None: reads all)."""

    @property
    def sent(self) -> bytes:
        return b"".join(self.pieces)


class ScriptedEngine(LoopbackEngine):
    """An OpenAI-shaped engine on a loopback port; ``scripts[prompt]`` says how to answer."""

    APP_OPTIONS = {"client_max_size": 1 << 20}
    RUNNER_OPTIONS = {"handler_cancellation": True}

    def __init__(self) -> None:
        super().__init__()
        self.scripts: dict[str, Script] = {}

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        script = self.scripts[body["prompt"]]
        if script.status != 200:
            return web.Response(status=script.status, body=b"".join(script.pieces), content_type="application/json")
        response = web.StreamResponse(headers={"content-type": script.content_type})
        await response.prepare(request)
        transport = request.transport
        assert transport is not None
        for piece, pause in zip(script.pieces, script.pauses):
            if pause:
                await asyncio.sleep(pause)
            await response.write(piece)
        if script.ending == "eof":
            await response.write_eof()
        elif script.ending == "reset":
            transport.abort()
        elif script.ending == "close":
            transport.close()
        else:  # stall: the router's read timeout must end it
            await asyncio.sleep(READ_TIMEOUT_S * 4)
            transport.abort()
        return response

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)


@dataclass
class Fleet:
    engine: ScriptedEngine
    router: RouterProc
    outcomes: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with ScriptedEngine() as engine:
        config = {
            "models": [{"name": MODEL, "tokenizer": str(QWEN3_DIR), "block_size": 16, "max_model_len": 4096,
                        "backends": [{"name": "scripted", "url": engine.url}]}],
            # One health check at start, no circuit breaker: every script reaches the engine.
            "router": {"retries": 0, "request_timeout_s": READ_TIMEOUT_S, "health_interval_s": 3600},
        }
        router = RouterProc("router", config, tmp_path_factory.mktemp("fuzz-sse"), log_level="info",
                            tuning={"metrics_scrape_interval_s": 3600, "breaker_failures": 1_000_000_000})
        try:
            yield Fleet(engine, router)
        finally:
            router.stop()


# -- scripts -----------------------------------------------------------------------------------

TEXTS = ["hello", " world", "\u00e9t\u00e9", "\u6f22\u5b57", "\U0001f600\U0001f680", "\u0627\u0644", "\n", "\\", '"', "a b c"]


def chunk_event(rng: random.Random, size: int = 0) -> bytes:
    text = "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 4)))
    if size:
        text = (text * (size // max(1, len(text.encode())) + 1))[: size // 2]
    doc = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return json.dumps(doc, ensure_ascii=rng.random() < 0.3).encode()


def frame(data: bytes, eol: bytes) -> bytes:
    return b"data: " + data + eol + eol


def malformed(rng: random.Random, eol: bytes) -> bytes:
    kind = rng.randrange(9)
    if kind == 0:
        return b"data: {not json" + eol + eol
    if kind == 1:
        return b"data: " + rng.randbytes(rng.randint(1, 30)).replace(b"\n", b"").replace(b"\r", b"") + eol + eol
    if kind == 2:
        return b": keep-alive" + eol + eol
    if kind == 3:
        return b"event: ping" + eol + b"id: 7" + eol + b"retry: x" + eol + b"data: " + chunk_event(rng) + eol + eol
    if kind == 4:
        return b"data: {\"choices\":" + eol + b"data: []}" + eol + eol
    if kind == 5:
        return b"garbage without a field" + eol + eol
    if kind == 6:
        return b"data: [DONE]" + eol + eol  # in the middle: the client stops here, the router relays on
    if kind == 7:
        return eol * rng.randint(1, 3)
    return b"data:" + chunk_event(rng) + eol + eol


def draw_script(rng: random.Random) -> Script:
    eol = rng.choice([b"\n", b"\n", b"\n", b"\r\n", b"\r"])
    events: list[bytes] = []
    for _ in range(rng.randint(0, 12)):
        roll = rng.random()
        if roll < 0.7:
            events.append(frame(chunk_event(rng), eol))
        elif roll < 0.95:
            events.append(malformed(rng, eol))
        else:
            events.append(frame(chunk_event(rng, rng.choice([70_000, 300_000, 2_000_000])), eol))
    if rng.random() < 0.7:
        events.append(b"data: [DONE]" + eol + eol)
    if rng.random() < 0.15 and events:  # the last event loses its end
        events[-1] = events[-1].rstrip(b"\r\n")
    if rng.random() < 0.05:
        events.append(b"data: {\"choices\": [{\"text\": \"tail")
    stream = b"".join(events)
    split = rng.random()
    if split < 0.3 or not stream:
        pieces = events or [b""]
    elif split < 0.45 and len(stream) < 400:
        pieces = [stream[i : i + 1] for i in range(len(stream))]
    else:
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(1, 8)))) if len(stream) > 1 else []
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    pauses = [0.002 if rng.random() < 0.3 else 0.0 for _ in pieces]
    ending = rng.choices(["eof", "reset", "close", "stall"], weights=[60, 20, 15, 2])[0]
    script = Script([p for p in pieces if p] or [b""], pauses, ending)
    roll = rng.random()
    if roll < 0.04:
        script.status = rng.choice([500, 503, 400])
        script.pieces = [json.dumps({"error": {"message": "engine says no", "type": "x", "code": script.status}}).encode()]
    elif roll < 0.07:
        script.content_type = "application/json"  # answered a stream request with something else: relayed as it is
    elif roll < 0.12 and len(stream) > 10:
        script.hang_up_after = rng.randint(1, len(stream) - 1)
    return script


# -- one case ----------------------------------------------------------------------------------


def done_ending(sent: bytes) -> bool:
    """Whether the engine's bytes end with a ``data: [DONE]`` line and the empty line that completes its event."""
    last_line = re.split(rb"\r\n|\r|\n", sent.rstrip(b"\r\n"))[-1]
    return last_line in (b"data: [DONE]", b"data:[DONE]") and not sse_events(sent)[1]


def check_stream(script: Script, status: int, body: bytes, what: str, elapsed: float) -> str:
    """The client-side contract (see the module docstring); returns the outcome's name."""
    sent = script.sent
    if status != 200:
        assert status in (502, 504), what
        error = openai_error(body)
        if error["code"] == "upstream_timeout" and elapsed >= READ_TIMEOUT_S:
            # The engine (a thread of this loaded test process) did not answer within the
            # read timeout: the router's timeout did its job; no script property is tested.
            return SLOW
        assert not sse_events(sent)[0] or script.ending != "eof", what  # only a failure before any event
        return f"{status} before the first byte"
    if script.ending == "eof" and done_ending(sent):
        assert body == sent, what
        return "relayed whole"
    events, rest = sse_events(body)
    assert not rest, f"the stream does not end at an event boundary: {rest[:200]!r}\n{what}"
    assert events, what
    error = json.loads(events[-1])["error"]
    assert error["type"] == "server_error" and error["message"].startswith("backend scripted "), what
    marker = b"data: " + events[-1]
    head = body[: body.rindex(marker)]
    assert sent.startswith(head), f"the client got bytes the engine did not send\n{what}"
    assert sse_events(head)[1] == b"", f"the error event is glued to a half event\n{what}"
    return f"{script.ending}: error event"


SLOW = "504: the engine did not answer in time"


def run_case(fleet: Fleet, n: int, script: Script) -> str:
    prompt = f"case-{n}"
    fleet.engine.scripts[prompt] = script
    body = {"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": 4}
    what = f"case {n}: {script.ending}, status {script.status}, {script.content_type}, sent {script.sent[:300]!r}..."
    started = time.monotonic()
    with httpx.stream("POST", fleet.router.url + "/v1/completions", json=body, timeout=30) as r:
        got = bytearray()
        for chunk in r.iter_raw():
            got += chunk
            if script.hang_up_after is not None and len(got) >= script.hang_up_after:
                break
        status = r.status_code
    elapsed = time.monotonic() - started
    assert elapsed < READ_TIMEOUT_S + 10, f"took {elapsed:.1f}s\n{what}"
    if script.hang_up_after is not None and len(got) >= script.hang_up_after:
        outcome = "client hung up"
    elif script.status >= 500:  # the engine's body stays in the router's log
        assert status == script.status and openai_error(bytes(got))["code"] == "upstream_error", what
        assert b"engine says no" not in got, what
        outcome = "engine error answered"
    elif script.status != 200:
        assert status == script.status and bytes(got) == script.pieces[0], what
        outcome = "engine error relayed"
    elif not script.content_type.startswith("text/event-stream"):
        outcome = "non-SSE relayed"
        if script.ending == "eof":
            assert bytes(got) == script.sent, what
    else:
        outcome = check_stream(script, status, bytes(got), what, elapsed)
    fleet.outcomes[outcome] = fleet.outcomes.get(outcome, 0) + 1
    del fleet.engine.scripts[prompt]
    return outcome


def run_regression(fleet: Fleet, n: int, script: Script) -> None:
    """One scripted case, again (up to 3 tries) while a slow engine makes it time out before
    its first byte, so the property it guards is tested rather than the machine's load."""
    for _ in range(3):
        if run_case(fleet, n, script) != SLOW:
            break
    else:
        pytest.fail("the engine timed out 3 times in a row")


def in_flight(fleet: Fleet) -> dict[str, Any]:
    backends = httpx.get(fleet.router.url + "/debug/backends", timeout=30).json()["backends"]
    return backends[0]["load"]


def wait_released(fleet: Fleet) -> None:
    deadline = time.monotonic() + READ_TIMEOUT_S + 10
    while (load := in_flight(fleet))["in_flight"] or load["prefill_tokens"] or load["decode_seqs"] or load["active_blocks"]:
        assert time.monotonic() < deadline, f"load ticket not released: {load}"
        time.sleep(0.02)


# -- the tests ---------------------------------------------------------------------------------


def test_fuzzed_sse_streams_reach_the_client_whole_or_with_a_clean_error(fleet: Fleet) -> None:
    rng = random.Random(SEED)
    for n in range(CASES):
        run_case(fleet, n, draw_script(rng))
        if n % 10 == 9:
            wait_released(fleet)
    wait_released(fleet)
    print(f"\nSSE fuzz: {CASES} scripts, outcomes {dict(sorted(fleet.outcomes.items()))}")
    assert fleet.outcomes.get("relayed whole", 0) > CASES // 5 and fleet.outcomes.get("reset: error event", 0) > CASES // 20
    log = fleet.router.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-5000:]


def test_concurrent_broken_streams_release_every_ticket(fleet: Fleet) -> None:
    """Many scripts at once, a third of them abandoned by their client: the counters still end at 0."""
    rng = random.Random(SEED + 1)

    async def one(client: httpx.AsyncClient, n: int, script: Script) -> None:
        prompt = f"concurrent-{n}"
        fleet.engine.scripts[prompt] = script
        body = {"model": MODEL, "prompt": prompt, "stream": True}
        async with client.stream("POST", fleet.router.url + "/v1/completions", json=body) as r:
            async for _ in r.aiter_raw():
                if n % 3 == 0:
                    break

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            scripts = [draw_script(rng) for _ in range(60)]
            await asyncio.gather(*(one(client, n, s) for n, s in enumerate(scripts)))

    asyncio.run(main())
    wait_released(fleet)


def test_a_stream_cut_inside_an_event_ends_with_a_separate_error_event(fleet: Fleet) -> None:
    """Regression: the router appended its error event to the half event the engine left
    (``data: {"cho`` + ``data: {"error"...``), which a client parses as one broken event."""
    whole = b'data: {"choices": [{"text": "a"}]}\n\n'
    script = Script([whole, b'data: {"choices": [{"te'], [0.0, 0.01], "reset")
    run_regression(fleet, 10**6, script)
    wait_released(fleet)


def test_a_stream_that_ends_without_done_is_not_a_silent_200(fleet: Fleet) -> None:
    """Regression: a clean end of the engine's stream without ``[DONE]`` reached the client as a complete 200."""
    script = Script([b'data: {"choices": [{"text": "a"}]}\n\n'], [0.0], "eof")
    run_regression(fleet, 10**6 + 1, script)
    wait_released(fleet)


# -- the relay's event cutter on its own ----------------------------------------------------------

EOL = st.sampled_from([b"\n", b"\n", b"\r", b"\r\n"])
SSE_LINES = st.one_of(
    EOL,
    st.builds(lambda f, v, e: f + v + e, st.sampled_from([b"data: ", b"data:", b": c", b"id: ", b"x"]),
              st.sampled_from([b"[DONE]", b"[DONE]", b'{"a": 1}', b"", b"\xe6\xbc", b"\xa2"]), EOL),
    st.sampled_from([b"data: [DONE]", b"data: x"]),  # a line without its end
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


@settings(max_examples=fuzz_cases(2000, 20000), deadline=None)
@given(stream=st.lists(SSE_LINES, max_size=16).map(b"".join), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_event_cut_passes_every_byte_on_and_cuts_only_between_events(stream: bytes, cuts: list[int]) -> None:
    cut = EventCut()
    out = b""
    for piece in split(stream, cuts):
        out += cut.feed(piece)
        assert not sse_events(out)[1], out  # what the client has so far ends between two events
    assert out + b"".join(cut.held) == stream
    assert cut.complete == done_ending(stream)
    events = sse_events(out + cut.error_event("backend b failed mid-stream"))[0]
    assert events[:-1] == sse_events(out)[0] and json.loads(events[-1])["error"]["message"] == "backend b failed mid-stream"


def test_an_event_over_the_hold_limit_is_passed_on_and_the_error_event_ends_it_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "MAX_HELD_EVENT_BYTES", 16)
    cut = EventCut()
    assert cut.feed(b"data: 0123456") == b""
    assert cut.feed(b"789abcdef") == b"data: 0123456789abcdef" and cut.mid_event
    assert cut.error_event("x").startswith(b"\n\ndata: {")
    assert cut.feed(b"\n\ndata: [DONE]\n\n") == b"\n\ndata: [DONE]\n\n" and cut.complete


def test_done_followed_by_many_blank_lines_is_still_a_complete_stream() -> None:
    cut = EventCut()
    assert cut.feed(b'data: {"a": 1}\n\n') and cut.feed(b"data: [DONE]" + b"\n" * 40) and cut.complete
    assert cut.feed(b"data: x\n\n") and not cut.complete
