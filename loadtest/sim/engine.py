"""The scheduler step loop of one simulated engine: continuous batching with chunked prefill.

Each step follows vLLM v1's scheduler: with a budget of ``max_num_batched_tokens``,
running requests go first (one token for a decoding request, the next chunk of the
prompt for one still prefilling), then waiting requests are admitted in arrival order
while the budget, ``max_num_seqs`` and the KV pool allow. An admitted request's
prefix hit is taken from the cache, so only its *uncached* tokens are prefilled; with
a CPU offload tier the hit goes on past the GPU's into the CPU's, whose blocks are
loaded back (charged as transfer time to the step that admits the request). The
step's duration comes from :class:`~loadtest.sim.latency.LatencyModel`; the loop
sleeps ``duration / speedup`` wall seconds, then every request computed in the step
gets its next token, finished ones free their blocks, and the step's KV events go
out as one batch (as vLLM publishes after each step).

Two clocks: *engine time* (modelled seconds, what metrics report) advances by step
durations; wall time is engine time / ``speedup``. When the process cannot keep up,
engine time falls behind wall time by ``lag`` (exported as a metric) instead of
silently stretching steps.

Every change to an engine's state is made under :data:`STATE_LOCK`: the bench's side channel
(:mod:`loadtest.sim.state_server`) reads the engines from its own thread, so that its answers
do not wait behind the event loop's backlog of token streams.

Admission waits when the pool cannot hold a request's whole lifetime (prompt +
planned output) next to what running requests still need; vLLM would admit and
preempt later, this simulator never preempts.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadtest.sim.block_manager import BlockManager, CacheRecord, CacheRequest
from loadtest.sim.generation import PlannedOutput
from loadtest.sim.latency import LatencyModel
from loadtest.sim.metrics import EngineMetrics
from loadtest.sim.world_clock import sleep_until

FINISHED = None
"""Sentinel pushed to a request's sink after its last token."""


STATE_LOCK = threading.Lock()
"""Held by every change to the state of this process's engines and by the side channel's reads
(one lock for all of them: an answer reads every engine of the process at one instant)."""


class EngineDead(RuntimeError):
    """The engine was killed (fault injection) while the request was in flight."""


@dataclass(slots=True)
class EngineConfig:
    num_blocks: int = 8192
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768
    speedup: float = 1.0
    cpu_offload_blocks: int = 0
    """Blocks of the CPU offload tier (0: none, a GPU-only engine)."""
    uncached_first: bool = True
    """Freed blocks without a hash are reused before cached ones are evicted (vLLM >= 0.24;
    :func:`loadtest.sim.block_manager.reuses_uncached_first` gives it per version)."""
    latency: LatencyModel = field(default_factory=LatencyModel)


@dataclass(slots=True, eq=False)
class SimRequest:
    """One prompt in flight. Tokens are pushed to ``sink`` as ``(index, token_id)``."""

    cache: CacheRequest
    prompt_len: int
    planned: PlannedOutput
    sink: asyncio.Queue[tuple[int, Any]]
    index: int = 0
    lora: dict[str, Any] | None = None
    cache_salt: str | None = None
    arrival: float = 0.0
    num_computed_tokens: int = 0
    num_output: int = 0
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    finished_at: float | None = None
    done: bool = False

    @property
    def prefilling(self) -> bool:
        return self.num_computed_tokens < self.prompt_len


@dataclass(slots=True)
class _Scheduled:
    req: SimRequest
    num_new_tokens: int


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        hasher: Any,
        publish: Callable[[list[CacheRecord]], None] | None = None,
        metrics: EngineMetrics | None = None,
        paused: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.hasher = hasher
        self.bm = BlockManager(config.num_blocks, config.block_size, config.cpu_offload_blocks, config.uncached_first)
        self.publish = publish
        self.metrics = metrics
        self._paused = paused or (lambda: 0.0)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._wall = clock
        """Wall seconds: ``time.monotonic``, or a :class:`loadtest.sim.world_clock.WorldClock` that the
        bench's oracle stops while it asks a question, so that no step ends during one."""
        self._t0 = clock()
        self.clock = 0.0
        self.lag = 0.0
        self.steps = 0
        self.busy_engine_s = 0.0
        self.received = 0
        """Requests added since start: a client that counts what it sent knows which are in transit."""
        self.in_step: tuple[list[_Scheduled], float] | None = None
        """The step being computed (its work and its end, engine time), None between steps."""
        if metrics is not None:
            metrics.bind(lambda: len(self.running), lambda: len(self.waiting), self.bm.pool.usage)
            metrics.cache_config(config.num_blocks, config.block_size, hasher.algo)
            if self.bm.cpu is not None:
                metrics.enable_offload(self.bm.cpu.usage)

    # -- requests ---------------------------------------------------------------

    def wall_engine_time(self) -> float:
        return (self._wall() - self._t0) * self.config.speedup

    def now(self) -> float:
        """Engine time of an event happening now (wall time minus the current lag)."""
        return max(self.clock, self.wall_engine_time() - self.lag)

    def make_request(
        self,
        prompt_ids: list[int],
        planned: PlannedOutput,
        sink: asyncio.Queue[tuple[int, Any]],
        *,
        index: int = 0,
        lora: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> SimRequest:
        hashes = self.hasher.hash_blocks(prompt_ids, lora=lora, cache_salt=cache_salt)
        cache = CacheRequest(
            request_id=f"sim-{next(self._ids)}",
            all_token_ids=list(prompt_ids),
            block_hashes=hashes,
            block_extra_keys=[self._event_keys(i, lora, cache_salt) for i in range(len(hashes))],
            lora_id=lora["int_id"] if lora else None,
            lora_name=lora["name"] if lora else None,
        )
        return SimRequest(cache, len(prompt_ids), planned, sink, index=index, lora=lora, cache_salt=cache_salt)

    def lifetime_tokens(self, req: SimRequest) -> int:
        return req.prompt_len + len(req.planned.token_ids)

    def add(self, req: SimRequest) -> None:
        with STATE_LOCK:
            req.arrival = self.now()
            self.received += 1
            self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client gone): its blocks are freed like a finished one's."""
        if req.done:
            return
        with STATE_LOCK:
            req.done = True
            if req in self.waiting:
                self.waiting.remove(req)
            elif req in self.running:
                self.running.remove(req)
                self.bm.free(req.cache)
        self._wake.set()

    def kill(self) -> None:
        """Fail every request in flight (the engine died)."""
        with STATE_LOCK:
            dead = [*self.waiting, *self.running]
            for req in dead:
                req.done = True
            self.waiting.clear()
            self.running.clear()
        for req in dead:
            req.sink.put_nowait((req.index, EngineDead("engine died")))

    def reset_prefix_cache(self) -> bool:
        with STATE_LOCK:
            ok = self.bm.reset_prefix_cache()
        if ok:
            self._flush_events()
        return ok

    # -- one step ---------------------------------------------------------------

    def schedule(self, now: float) -> tuple[list[_Scheduled], float]:
        """Pick this step's work and allocate its KV blocks; returns it and its duration."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out: list[_Scheduled] = []
        prefill_tokens = decode_seqs = kv_blocks = loaded_blocks = 0
        for req in self.running:
            if budget <= 0:
                break
            n = min(req.prompt_len - req.num_computed_tokens, budget) if req.prefilling else 1
            kv_blocks += self.bm.allocate_slots(req.cache, req.num_computed_tokens, n)
            budget -= n
            if req.prefilling:
                prefill_tokens += n
            else:
                decode_seqs += 1
            out.append(_Scheduled(req, n))
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            hits, num_gpu_cached = self.bm.get_computed_blocks(req.cache)
            num_loaded = self.bm.get_offloaded_blocks(req.cache, len(hits))
            lifetime = self.bm.blocks_needed(self.lifetime_tokens(req), len(hits))
            if not self.bm.can_admit(hits, lifetime):
                break
            self.waiting.popleft()
            self.bm.admit(req.cache, hits, lifetime)
            num_cached = num_gpu_cached + num_loaded * cfg.block_size
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            loaded_blocks += num_loaded
            if self.metrics is not None:
                self.metrics.prefix_queries.inc(req.prompt_len)
                self.metrics.prefix_hits.inc(num_gpu_cached)
                if self.bm.cpu is not None:
                    self.metrics.external_queries.inc(req.prompt_len)
                    self.metrics.external_hits.inc(num_loaded * cfg.block_size)
                self.metrics.queue_time.observe(max(0.0, now - req.arrival))
            n = min(req.prompt_len - num_cached, budget)
            kv_blocks += self.bm.allocate_slots(req.cache, num_cached, n)
            budget -= n
            prefill_tokens += n
            self.running.append(req)
            out.append(_Scheduled(req, n))
        if not out:
            return out, 0.0
        return out, cfg.latency.step_time(prefill_tokens, decode_seqs, kv_blocks, loaded_blocks)

    def complete(self, scheduled: list[_Scheduled], end: float) -> None:
        """Apply a step's results at engine time ``end``: tokens out, finished requests freed."""
        metrics = self.metrics
        for item in scheduled:
            req = item.req
            if req.done:
                continue
            req.num_computed_tokens += item.num_new_tokens
            if req.prefilling:
                continue
            token = req.planned.token_ids[req.num_output]
            req.num_output += 1
            req.cache.all_token_ids.append(token)
            self._extend_hashes(req)
            if req.first_token_at is None:
                req.first_token_at = end
                if metrics is not None:
                    metrics.ttft.observe(end - req.arrival)
                    metrics.prompt_tokens.inc(req.prompt_len)
            elif metrics is not None:
                metrics.itl.observe(end - req.last_token_at)
            req.last_token_at = end
            req.sink.put_nowait((req.index, token))
            if req.num_output == len(req.planned.token_ids):
                req.done = True
                req.finished_at = end
                self.running.remove(req)
                self.bm.free(req.cache)
                req.sink.put_nowait((req.index, FINISHED))
                if metrics is not None:
                    metrics.generation_tokens.inc(req.num_output)
                    metrics.e2e.observe(end - req.arrival)
                    metrics.request_success(req.planned.finish_reason)
        self._flush_events()

    def _flush_events(self) -> None:
        events = self.bm.take_events()
        if events and self.publish is not None:
            self.publish(events)

    def _extend_hashes(self, req: SimRequest) -> None:
        """Hash blocks that generated tokens just filled (chained, same dialect as the prompt)."""
        cache = req.cache
        bs = self.config.block_size
        i = len(cache.block_hashes)
        if (i + 1) * bs > len(cache.all_token_ids):
            return
        tokens = cache.all_token_ids[i * bs : (i + 1) * bs]
        if req.lora is None and (i > 0 or req.cache_salt is None):
            h = self.hasher.hash_block(cache.block_hashes[-1] if i else None, tokens, None)
        else:
            parent = cache.block_hashes[-1] if i else None
            h = self.hasher.hash_blocks(
                tokens, lora=req.lora, cache_salt=req.cache_salt, parent=parent, start_block=i if i else None
            )[0]
        cache.block_hashes.append(h)
        cache.block_extra_keys.append(self._event_keys(i, req.lora, req.cache_salt))

    @staticmethod
    def _event_keys(block_index: int, lora: dict[str, Any] | None, cache_salt: str | None) -> list[Any] | None:
        """A block's extra keys as events carry them (untagged: LoRA name, then the salt on block 0)."""
        keys: list[Any] = []
        if lora:
            keys.append(lora["name"])
        if cache_salt is not None and block_index == 0:
            keys.append(cache_salt)
        return keys or None

    # -- loop -------------------------------------------------------------------

    async def run(self) -> None:
        """Step until cancelled, sleeping each step's modelled duration / speedup."""
        speedup = self.config.speedup
        busy = False
        while True:
            pause = self._paused()
            if pause > 0:
                busy = False
                await asyncio.sleep(pause)
                continue
            if not busy and (self.waiting or self.running):
                self.lag = 0.0
            # Back-to-back steps chain on engine time, so a process that cannot keep up
            # shows as lag instead of as longer steps.
            start = self.clock if busy else self.now()
            with STATE_LOCK:
                scheduled, duration = self.schedule(start) if (self.waiting or self.running) else ([], 0.0)
                end = start + duration
                if scheduled:
                    self.in_step = (scheduled, end)
            if not scheduled:
                busy = False
                self._wake.clear()
                await self._wake.wait()
                continue
            busy = True
            # A pause of the world clock during the sleep moves the step's end later.
            await sleep_until(self._t0 + end / speedup, self._wall)
            with STATE_LOCK:
                self.clock = end
                self.lag = max(0.0, self.wall_engine_time() - end)
                self.steps += 1
                self.busy_engine_s += duration
                self.complete(scheduled, end)
                self.in_step = None
            if self.metrics is not None:
                self.metrics.clock_lag.set(self.lag)
