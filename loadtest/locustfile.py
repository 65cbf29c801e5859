"""Locust users for an OpenAI endpoint (the router, one vLLM, or a peer router).

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8080 --model qwen3-sim \\
        --headless -u 32 -r 8 -t 60s --csv out/run MultiTurnChatUser

Three user classes (pick one or more by name; all three run by default):

* ``MultiTurnChatUser``: a ShareGPT conversation per user, history growing turn by
  turn, think time between turns (``--think-time``, divided by ``--speedup``).
* ``SharedPrefixUser``: synthetic shared-prefix requests (system prompt groups and
  RAG documents, :class:`loadtest.workloads.SyntheticSpec`; ``--synthetic-spec``).
* ``TraceUser``: the requests of a trace file (``--trace``, any format that
  :func:`loadtest.workloads.load` reads), taken in order by whichever user is free.

Every request streams. Each is reported twice: as ``POST <path>`` with the end-to-end
time, and as ``TTFT <path>`` with the time to the first streamed chunk that carries
output, so Locust's tables, charts and CSVs show TTFT as its own metric. Failed
requests (HTTP error, error inside the stream, broken connection) fail both.

To find the load where TTFT p90 crosses an SLO instead of running a fixed user count, load
the step-load shape too: ``-f loadtest/locustfile.py,loadtest/locust_step.py`` (it reads the
``TTFT`` events; see :mod:`loadtest.locust_step`).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

from locust import User, events, task  # first: Locust monkey-patches ssl, which must precede requests

import requests

from loadtest import workloads
from loadtest.workloads import Session, Turn

_LOCK = threading.Lock()
_CYCLES: dict[str, Iterator[Session]] = {}


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    parser.add_argument("--model", default="qwen3-sim", help="model name in every request")
    parser.add_argument("--trace", default=str(workloads.DATA_DIR / "traces" / "mooncake_conversation_head1500.jsonl"),
                        help="TraceUser: trace file")
    parser.add_argument("--trace-format", default="", help="TraceUser: trace format (default: detected)")
    parser.add_argument("--sharegpt", default=str(workloads.DATA_DIR / "traces" / "sharegpt_multiturn_150.json"),
                        help="MultiTurnChatUser: ShareGPT file")
    parser.add_argument("--synthetic-spec", default="default", help="SharedPrefixUser: JSON spec or 'default'")
    parser.add_argument("--think-time", type=float, default=5.0, help="mean think time between turns (s)")
    parser.add_argument("--speedup", type=float, default=1.0, help="divide think times by X (simulated engines)")
    parser.add_argument("--length-scale", type=float, default=1.0, help="TraceUser (mooncake): block/input scale")
    parser.add_argument("--output-scale", type=float, default=1.0, help="TraceUser (mooncake): output scale")
    parser.add_argument("--max-output-tokens", type=int, default=512, help="cap of max_tokens in chat users")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the generated workloads")


def _sessions(kind: str, opts: Any) -> Iterator[Session]:
    """One endless, process-wide iterator of sessions per user kind (loaded on first use)."""
    with _LOCK:
        it = _CYCLES.get(kind)
        if it is None:
            seed = opts.workload_seed
            if kind == "chat":
                wl = workloads.load_sharegpt(opts.sharegpt, seed=seed, think_s=opts.think_time,
                                             max_output_tokens=opts.max_output_tokens)
            elif kind == "prefix":
                wl = workloads.synthetic(workloads.SyntheticSpec.from_file(opts.synthetic_spec), seed=seed)
            else:
                fmt = opts.trace_format or None
                extra = ({"length_scale": opts.length_scale, "output_scale": opts.output_scale}
                         if (fmt or workloads.detect_format(opts.trace)) == "mooncake" else {})
                wl = workloads.load(opts.trace, fmt, seed=seed, **extra)
            it = _CYCLES[kind] = itertools.cycle(wl.sessions)
        return it


@events.test_start.add_listener
def _preload(environment: Any, **_: Any) -> None:
    """Load the workloads of the selected users before they start, so no request waits on it."""
    for cls in environment.user_classes:
        if getattr(cls, "kind", ""):
            _sessions(cls.kind, environment.parsed_options)


def _next_session(kind: str, opts: Any) -> Session:
    it = _sessions(kind, opts)
    with _LOCK:
        return next(it)


class OpenAIUser(User):
    """Streams OpenAI requests and reports end-to-end time and TTFT as separate Locust metrics."""

    abstract = True
    kind = ""

    def on_start(self) -> None:
        self.http = requests.Session()
        self.opts = self.environment.parsed_options

    def on_stop(self) -> None:
        self.http.close()

    def run_session(self, s: Session) -> None:
        for i, turn in enumerate(s.turns):
            if i and turn.think_s > 0:
                self.wait_s(turn.think_s / max(self.opts.speedup, 1e-9))
            if not self.send(turn, s.session_id):
                return

    def wait_s(self, seconds: float) -> None:
        import gevent

        gevent.sleep(seconds)

    def send(self, turn: Turn, session_id: str) -> bool:
        """One streamed request; True when it completed."""
        body = {**turn.body, "model": self.opts.model, "stream": True, "stream_options": {"include_usage": True}}
        url = self.host.rstrip("/") + turn.path
        t0 = time.perf_counter()
        ttft: float | None = None
        length = 0
        error: Exception | None = None
        try:
            with self.http.post(url, json=body, stream=True, timeout=600,
                                headers={"x-session-id": session_id}) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                for raw in resp.iter_lines():
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {str(chunk['error'])[:200]}")
                    if ttft is None and _has_output(chunk):
                        ttft = time.perf_counter() - t0
                    length += len(data)
        except (requests.RequestException, RuntimeError, ValueError) as e:
            error = e
        e2e = time.perf_counter() - t0
        fire = self.environment.events.request.fire
        if error is None and ttft is not None:
            fire(request_type="TTFT", name=turn.path, response_time=ttft * 1000, response_length=0,
                 exception=None, context={})
        elif error is None:
            error = RuntimeError("stream ended without output")
        if error is not None:
            fire(request_type="TTFT", name=turn.path, response_time=e2e * 1000, response_length=0,
                 exception=error, context={})
        fire(request_type="POST", name=turn.path, response_time=e2e * 1000, response_length=length,
             exception=error, context={})
        return error is None


def _has_output(chunk: dict[str, Any]) -> bool:
    for c in chunk.get("choices") or ():
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False


class MultiTurnChatUser(OpenAIUser):
    """A ShareGPT conversation per iteration: turns in order, think time between them."""

    kind = "chat"

    def wait_time(self) -> float:
        return self.opts.think_time / max(self.opts.speedup, 1e-9)

    @task
    def conversation(self) -> None:
        self.run_session(_next_session(self.kind, self.opts))


class SharedPrefixUser(OpenAIUser):
    """Synthetic requests that share system prompts and RAG documents, back to back."""

    kind = "prefix"

    def wait_time(self) -> float:
        return 0.0

    @task
    def ask(self) -> None:
        self.run_session(_next_session(self.kind, self.opts))


class TraceUser(OpenAIUser):
    """The next request (or session) of a trace, back to back (closed loop)."""

    kind = "trace"

    def wait_time(self) -> float:
        return 0.0

    @task
    def replay(self) -> None:
        self.run_session(_next_session(self.kind, self.opts))
