"""The simulator's side channel: every engine's exact state at decision time (bench only).

A router knows its engines through KV events, which trail the step that caused them,
and through its own count of what it sent; it cannot see a queue another client filled
or a block the engine just evicted. To measure how much routing that costs, ``kvrouter
sim --debug-state`` answers ``POST /debug/state`` (:mod:`loadtest.sim.state`): for the
prompt being routed, the engine's exact cached prefix, its queue in
:class:`router.fleet.load.BackendLoad`'s terms, and the TTFT its own scheduler and latency
model predict for the prompt. :class:`SideChannel` is the client the bench's ``oracle``
and ``kv_aware+exact*`` policies (:mod:`loadtest.policies.oracle`) ask it through.

Those policies exist to measure routing in the simulator, never to route real engines:
:meth:`SideChannel.start` checks that every backend serves the channel and refuses to
start otherwise, naming the backend.

The engines of one ``kvrouter sim`` process are asked in one request (the side channel
names its process), which also makes their answers one instant's. The request goes to the
``state_url`` that ``GET /debug/state`` names, a thread of the simulator that answers without
waiting behind its event loop (:mod:`loadtest.sim.state_server`): a decision's question then
costs milliseconds of wall time, not the loop's backlog, and the oracle keeps up with the
loads a capacity sweep offers.

Requests in transit: the channel counts the requests this router sent to each engine
and keeps the last few prompts; each question carries those the engine may not have
received yet (it counts what it received; sent within the last second), so two
decisions a few milliseconds apart see each other, as they do in the router's own load
accounting. They travel by id: every prompt was the subject of an earlier question to
the same simulator process, which remembers it.

Questions are outside simulated time: where the simulator keeps time by a world clock
(:mod:`loadtest.sim.world_clock`, ``world_clock`` in its ``GET /debug/state``), each question
stops it, for the engines and the bench's client alike, so that the oracle is judged on where
it places requests, not on what asking costs on the bench's host.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from loadtest.sim.world_clock import WorldClock
from router.fleet.load import BackendLoad

log = logging.getLogger(__name__)

STATE_PATH = "/debug/state"
AHEAD_KEPT = 16
"""Prompts kept per engine for the in-transit list (more than ever travel at once on loopback)."""
IN_TRANSIT_S = 1.0
"""A request sent longer ago has arrived or never will (an engine rejected it, or restarted and
counts from 0): it is not sent as in transit any more."""
_PROMPT_FIELDS = ("prompt", "messages")
_encoder = msgspec.json.Encoder()


class SideChannelMissing(RuntimeError):
    """A backend does not serve the simulator's side channel (a real engine, or a sim without --debug-state)."""


class EngineLoad(BackendLoad):
    """A backend's load as the engine itself knows it, in :class:`BackendLoad`'s shape."""

    __slots__ = ("_active_blocks",)

    def __init__(self, name: str, load: dict[str, int]) -> None:
        super().__init__(name)
        self.in_flight = load["in_flight"]
        self.prefill_tokens = load["prefill_tokens"]
        self.decode_seqs = load["decode_seqs"]
        self.context_blocks = load["context_blocks"]
        self._active_blocks = load["active_blocks"]

    @property
    def active_blocks(self) -> int:
        return self._active_blocks

    def snapshot(self) -> dict[str, float | int | None]:
        return {**super().snapshot(), "active_blocks": self._active_blocks}


@dataclass(frozen=True, slots=True)
class EngineState:
    """One engine's answer for one prompt (see :mod:`loadtest.sim.state`)."""

    predicted_ttft_s: float | None
    """None: the engine could never start the prompt (it does not fit its KV pool)."""
    gpu_blocks: int
    cpu_blocks: int
    queued_blocks: int
    load: EngineLoad

    @classmethod
    def parse(cls, name: str, d: dict[str, Any]) -> EngineState:
        cached = d["cached_blocks"]
        return cls(d["predicted_ttft_s"], cached["gpu"], cached["cpu"], d["queued_blocks"], EngineLoad(name, d["load"]))


class SideChannel:
    """Asks every backend of one model for its exact state (``POST /debug/state``)."""

    def __init__(self, backends: dict[str, str], timeout_s: float = 10.0) -> None:
        self.urls = backends
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None
        self._sent = dict.fromkeys(backends, 0)
        self._received = dict.fromkeys(backends, 0)
        self._recent: dict[str, deque[tuple[int, float, int]]] = {b: deque(maxlen=AHEAD_KEPT) for b in backends}
        self._index: dict[str, int] = {}
        self._ask_urls: dict[str, str] = {}
        """Where each backend answers questions: off its event loop where it says so (``state_url``)."""
        self._groups: list[list[str]] = []
        """Backends by simulator process: each group is asked in one request."""
        self._prompts: OrderedDict[int, int] = OrderedDict()
        """Each decision's prompt id (what the engines remember it by), by its key, until it is
        sent (bounded: ``/debug/route`` decides without sending)."""
        self._conns: dict[str, http.client.HTTPConnection] = {}
        """One keep-alive connection per simulator process, used from the router's loop thread only."""
        self._next_id = random.getrandbits(40) << 20
        """Prompt ids: random high bits, so two clients of one simulator never share one."""
        self._clocks: dict[str, WorldClock] = {}
        """The world clocks the simulators keep time by, stopped while a question is asked."""

    async def start(self, policy: str) -> None:
        """Open the session and check that every backend serves the channel."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=30.0),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )
        groups: dict[str, list[str]] = {}
        for name, url in self.urls.items():
            why = None
            try:
                async with self.session.get(url + STATE_PATH) as r:
                    body = await r.json(content_type=None) if r.status == 200 else None
                    if not isinstance(body, dict) or body.get("side_channel") != "kvrouter-sim":
                        why = f"answered {r.status} to GET {STATE_PATH}"
                    else:
                        self._received[name] = int(body["received"])
                        self._ask_urls[name] = str(body.get("state_url") or url + STATE_PATH)
                        self._index[name] = int(body["index"])
                        if body.get("world_clock") and body["world_clock"] not in self._clocks:
                            self._clocks[body["world_clock"]] = WorldClock(body["world_clock"])
                        groups.setdefault(str(body["process"]), []).append(name)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
                why = f"cannot be asked ({e!r})"
            if why is not None:
                await self.aclose()
                raise SideChannelMissing(
                    f"policy {policy} reads each engine's exact state and runs only against simulated engines "
                    f"started with `kvrouter sim --debug-state` (kvrouter bench does this); backend {name} ({url}) {why}"
                )
        self._groups = list(groups.values())

    async def aclose(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        for clock in self._clocks.values():
            clock.close()
        self._clocks.clear()
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def ask(self, key: int, token_ids: list[int], body: dict[str, Any], kind: str) -> dict[str, EngineState | None]:
        """Every backend's state for this prompt (None where it could not answer). ``key``
        names the decision for :meth:`sent`; ``token_ids`` may be empty (the engine then
        tokenizes ``body`` itself)."""
        self._next_id += 1
        pid = self._next_id
        if token_ids:
            request = {k: v for k, v in body.items() if k not in _PROMPT_FIELDS}
            prompt = _encoder.encode({"request": request, "kind": kind, "token_ids": token_ids, "id": pid})
        else:
            prompt = _encoder.encode({"request": body, "kind": kind, "id": pid})
        self._prompts[key] = pid
        if len(self._prompts) > 4 * AHEAD_KEPT:
            self._prompts.popitem(last=False)
        with contextlib.ExitStack() as stopped:
            for clock in self._clocks.values():
                stopped.enter_context(clock.pause())
            answers = [self._ask(names, prompt) for names in self._groups]
        return {name: state for names, states in zip(self._groups, answers) for name, state in zip(names, states)}

    def sent(self, key: int, backend: str) -> None:
        """The decision ``key`` is being sent to ``backend``: in transit until the engine counts it."""
        if backend not in self._sent:
            return
        self._sent[backend] += 1
        pid = self._prompts.pop(key, None)
        if pid is not None:
            self._recent[backend].append((self._sent[backend], time.monotonic(), pid))

    def _ask(self, names: list[str], prompt: bytes) -> list[EngineState | None]:
        """One simulator process's engines ``names``, in one request to the first of them.

        A blocking call on the router's event loop, on purpose: a decision is atomic when
        nothing awaits between the question and :meth:`sent` (the next question then carries
        this one's prompt as in transit), and the answer comes from the simulator's state
        thread in a few milliseconds. Asked with ``await``, each decision also waited for the
        router's loop to come round three times (send, answer, the next decider's turn), and a
        loop carrying every token stream at four times real speed took tens of milliseconds a
        turn: the oracle then decided fewer requests per second than a capacity sweep offers,
        and its client TTFT measured that queue instead of its placement."""
        engines = []
        recent_since = time.monotonic() - IN_TRANSIT_S
        for name in names:
            received = self._received[name]
            ahead = b",".join(b'{"n":%d,"id":%d}' % (n, pid) for n, t, pid in self._recent[name]
                              if n > received and t > recent_since)
            engines.append(b'{"index":%d,"ahead":[%b]}' % (self._index[name], ahead))
        payload = b'{"prompt":%b,"engines":[%b]}' % (prompt, b",".join(engines))
        url = urlsplit(self._ask_urls[names[0]])
        conn = self._conns.get(url.netloc)
        if conn is None:
            conn = self._conns[url.netloc] = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=self.timeout_s)
        try:
            conn.request("POST", url.path, body=payload, headers={"content-type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                log.warning("engine state of %s: HTTP %d %s", names, r.status, data[:200])
                return [None] * len(names)
            answers = msgspec.json.decode(data)["engines"]
        except (OSError, http.client.HTTPException, msgspec.DecodeError, KeyError, TypeError) as e:
            conn.close()
            self._conns.pop(url.netloc, None)
            log.warning("engine state of %s: %r", names, e)
            return [None] * len(names)
        out: list[EngineState | None] = []
        for name, d in zip(names, answers):
            if d is None:
                out.append(None)
                continue
            self._received[name] = max(self._received[name], int(d["received"]))
            out.append(EngineState.parse(name, d))
        return out
