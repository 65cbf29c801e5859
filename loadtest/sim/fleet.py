"""K simulated engines in one asyncio process: engine i serves HTTP on P+i, PUB on Q+i, replay on R+i.

One process is enough for a fleet on a small machine: an engine is a coroutine that
mostly sleeps, and the tokenizer, output table and hasher are shared read-only. Each
:class:`Instance` owns its engine, publisher, metrics registry and uvicorn server, and
can be killed and restarted in place (fault injection): a restart is a fresh engine
(empty cache, seq from 0), as a restarted vLLM would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
import zmq.asyncio

from loadtest.sim.engine import Engine, EngineConfig
from loadtest.sim.faults import Faults
from loadtest.sim.generation import OutputGenerator
from loadtest.sim.http import create_app
from loadtest.sim.metrics import EngineMetrics
from loadtest.sim.publisher import EventPublisher
from loadtest.sim.state_server import StateServer
from loadtest.sim.world_clock import WorldClock

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    index: int
    host: str
    zmq_host: str
    port: int
    kv_events_port: int | None
    replay_port: int | None


@dataclass(slots=True)
class FleetSettings:
    model_name: str
    tokenizer_path: str
    vllm_version: str
    int_hashes: bool
    kv_topic: bytes
    buffer_steps: int
    engine: EngineConfig
    drop_event_fraction: float = 0.0
    error_rate: float = 0.0
    extra_latency_s: float = 0.0
    seed: int = 0
    mean_output_tokens: float = 128.0
    debug_state: bool = False
    """Serve ``/debug/state``, the exact-state side channel of the bench's oracle (:mod:`loadtest.sim.state`)."""
    world_clock: str | None = None
    """The file of a :class:`loadtest.sim.world_clock.WorldClock` the engines keep time by (the
    oracle stops it while it asks), announced to side-channel clients; None: the wall clock."""


@functools.cache
def _world_clock(path: str) -> WorldClock:
    """One mapping of the world clock per process, shared by its engines and their restarts."""
    return WorldClock(path)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to the fleet (K servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Instance:
    def __init__(self, spec: InstanceSpec, settings: FleetSettings, tokenizer: object, generator: OutputGenerator, hasher: object, zctx: zmq.asyncio.Context) -> None:
        self.spec = spec
        self.settings = settings
        self.model_name = settings.model_name
        self.tokenizer_path = settings.tokenizer_path
        self.config = settings.engine
        self.tokenizer = tokenizer
        self.generator = generator
        self.hasher = hasher
        self.faults = Faults(settings.drop_event_fraction, settings.error_rate, settings.extra_latency_s, seed=settings.seed + spec.index)
        self.sampling_rng = random.Random(settings.seed * 1_000_003 + spec.index)
        self.started = time.time()
        self._zctx = zctx
        self.up = False
        self.engine: Engine
        self.metrics: EngineMetrics
        self.publisher: EventPublisher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._server: _Server | None = None
        self._kill_task: asyncio.Task[None] | None = None
        self.peers: dict[int, Instance] = {spec.index: self}
        """Every engine of this process by index (the side channel answers for all of them at once)."""
        self.process_id = ""
        """Names this process to side-channel clients, so they can ask its engines in one request."""
        self._state_server: StateServer | None = None
        self.state_url: str | None = None
        """Where the side channel is answered off the event loop (``--debug-state``; :mod:`loadtest.sim.state_server`)."""
        self.app = create_app(self)

    async def start(self) -> None:
        s, spec = self.settings, self.spec
        self.metrics = EngineMetrics(s.model_name)
        if spec.kv_events_port is not None:
            self.publisher = EventPublisher(
                self._zctx,
                f"tcp://{spec.zmq_host}:{spec.kv_events_port}",
                f"tcp://{spec.zmq_host}:{spec.replay_port}" if spec.replay_port is not None else None,
                topic=s.kv_topic,
                vllm_version=s.vllm_version,
                block_size=self.config.block_size,
                int_hashes=s.int_hashes,
                buffer_steps=s.buffer_steps,
                faults=self.faults,
            )
        publish = self.publisher.publish if self.publisher is not None else None
        clock = _world_clock(s.world_clock).now if s.world_clock else time.monotonic
        self.engine = Engine(self.config, self.hasher, publish, self.metrics, self.faults.pause_left, clock)
        config = uvicorn.Config(
            self.app, host=spec.host, port=spec.port, log_level="warning", access_log=False,
            lifespan="off", timeout_graceful_shutdown=1, timeout_keep_alive=30,
        )
        self._server = _Server(config)
        self._tasks = [asyncio.create_task(self.engine.run()), asyncio.create_task(self._server.serve())]
        if self.publisher is not None:
            self._tasks.append(asyncio.create_task(self.publisher.serve_replay()))
        while not self._server.started:
            if self._tasks[1].done():
                self._tasks[1].result()
                raise RuntimeError(f"HTTP server of instance {spec.index} exited at start")
            await asyncio.sleep(0.01)
        if s.debug_state:
            self._state_server = StateServer(spec.host, self.app.state.answer_state)
            self.state_url = self._state_server.url
        self.up = True
        log.info("instance %d up: http %d kv-events %s replay %s", spec.index, spec.port, spec.kv_events_port, spec.replay_port)

    async def stop(self) -> None:
        """Die: in-flight requests fail, sockets close, the cache is gone."""
        self.up = False
        self.engine.kill()
        if self._state_server is not None:
            server, self._state_server, self.state_url = self._state_server, None, None
            await asyncio.to_thread(server.close)
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        server_task = self._tasks[1] if len(self._tasks) > 1 else None
        for t in self._tasks:
            if t is not server_task:
                t.cancel()
        if server_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(server_task, timeout=5)
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def schedule_kill(self, down_s: float | None) -> None:
        """Kill soon (after the fault reply went out); restart after ``down_s`` unless None/negative."""
        if self._kill_task is None or self._kill_task.done():
            self._kill_task = asyncio.create_task(self._kill(down_s))

    async def _kill(self, down_s: float | None) -> None:
        await asyncio.sleep(0.05)
        await self.stop()
        if down_s is None or down_s < 0:
            return
        await asyncio.sleep(down_s)
        self.faults.paused_until = 0.0
        await self.start()


def instance_specs(host: str, zmq_host: str, port: int, kv_events_port: int | None, replay_port: int | None, instances: int) -> list[InstanceSpec]:
    return [
        InstanceSpec(
            index=i, host=host, zmq_host=zmq_host, port=port + i,
            kv_events_port=None if kv_events_port is None else kv_events_port + i,
            replay_port=None if replay_port is None or kv_events_port is None else replay_port + i,
        )
        for i in range(instances)
    ]


async def run_fleet(specs: list[InstanceSpec], settings: FleetSettings, tokenizer: object, hasher: object, stop: asyncio.Event) -> None:
    generator = OutputGenerator(tokenizer, settings.mean_output_tokens)
    zctx = zmq.asyncio.Context()
    fleet = [Instance(spec, settings, tokenizer, generator, hasher, zctx) for spec in specs]
    peers = {inst.spec.index: inst for inst in fleet}
    process_id = uuid.uuid4().hex
    for inst in fleet:
        inst.peers, inst.process_id = peers, process_id
    try:
        for inst in fleet:
            await inst.start()
        print(f"kvrouter sim: {len(fleet)} engine(s) ready on http ports {specs[0].port}..{specs[-1].port}", flush=True)
        await stop.wait()
    finally:
        for inst in fleet:
            if inst.up:
                await inst.stop()
        zctx.term()

