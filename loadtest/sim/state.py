"""An engine's exact state at decision time: the bench's side channel for the oracle policy.

A router knows an engine through KV events that trail the step that caused them and
through its own count of what it sent. The bench's ``oracle`` policy and the
``kv_aware+exact_*`` ablations (:mod:`loadtest.policies.oracle`) instead ask every engine,
for the prompt being routed, what the simulator knows exactly. Served only with
``kvrouter sim --debug-state`` (``POST /debug/state``), which the bench passes for
those policies and nothing else does: a real vLLM has no such endpoint, so those
policies refuse to start against one.

:func:`snapshot` answers, for one prompt:

* ``predicted_ttft_s``: engine seconds from now to the prompt's first token here,
  found by running the engine's own scheduler (:mod:`loadtest.sim.engine`) and latency
  model forward from its current state: the step being computed, the running batch,
  the waiting queue, the KV pool and its cached blocks, the prompt appended to the
  queue, nothing else arriving.
* ``cached_blocks``: the prompt's leading blocks the engine holds now, on the GPU and
  then in the CPU tier (what a perfectly fresh index would say).
* ``queued_blocks``: its leading blocks that a request already on the engine (running,
  or waiting) will hold once scheduled: the exact form of kv_aware's speculative hits.
* ``load``: the engine's queue in the router's terms (:class:`router.fleet.load.BackendLoad`).

``ahead`` are prompts the client sent to this engine that it has not received yet (the
HTTP layer picks them by their ordinal against the engine's count of arrivals): they
join the queue before the prompt, so two decisions a few milliseconds apart do not both
see an empty engine.

The forward run works on counts, not on the pool's blocks, and reads the engine
without changing it. Where it is not exact:

* a cached free block counts as evicted once the run has allocated past its place in
  the engine's LRU free queue (blocks freed in the run join its tail and are never
  reached, but for partial blocks a pool that reuses those first puts at its head); a
  block the run cached twice (vLLM keeps duplicates) counts once;
* only prompt blocks are looked up (workload histories carry recorded answers, never
  the generated tokens); the CPU tier is read, never updated;
* a stretch of decode-only steps in which nothing can be admitted is computed in one go
  (same result as stepping it).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

if TYPE_CHECKING:
    from loadtest.sim.block_manager import Block, BlockPool, CpuOffloadTier
    from loadtest.sim.engine import Engine, SimRequest

MAX_STEPS = 100_000
"""Forward steps before the run gives up (the prompt then never starts: ``None``)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt the forward run queues: its length, its prompt block hashes, its planned output."""

    prompt_len: int
    hashes: Sequence[bytes]
    output_len: int


class StatePrompt(msgspec.Struct, frozen=True):
    """A prompt in a side-channel question: ``request`` the OpenAI body (its sampling fields;
    its prompt or messages when ``token_ids`` is left out), ``id`` a name for later questions."""

    request: dict[str, Any]
    kind: str | None = None
    token_ids: list[int] | None = None
    id: int | None = None


class StateAhead(msgspec.Struct, frozen=True):
    """The client's ``n``-th request to an engine: its prompt, or the ``id`` of one asked about before."""

    n: int
    prompt: StatePrompt | None = None
    id: int | None = None


class StateEngine(msgspec.Struct, frozen=True):
    index: int
    ahead: list[StateAhead] = []


class StateAsk(msgspec.Struct, frozen=True):
    """``POST /debug/state``'s body."""

    prompt: StatePrompt
    engines: list[StateEngine] | None = None
    ahead: list[StateAhead] = []


class KnownPrompts:
    """Prompts by the id a client gave them, for the last few hundred questions.

    A prompt is asked about once, when it is routed, and then travels in the ``ahead`` list
    of every question until its engine receives it (up to 16 at once per engine). Naming
    it by id there instead of sending its ids again keeps each question one prompt long:
    on 3,000-token prompts the repeats were most of the channel's cost.
    """

    SIZE = 512

    def __init__(self) -> None:
        self._prompts: OrderedDict[int, Prompt] = OrderedDict()

    def remember(self, key: int, prompt: Prompt) -> None:
        self._prompts[key] = prompt
        if len(self._prompts) > self.SIZE:
            self._prompts.popitem(last=False)

    def get(self, key: int | None) -> Prompt | None:
        return None if key is None else self._prompts.get(key)


KNOWN_PROMPTS = KnownPrompts()
"""One per process: the engines of a ``kvrouter sim`` process answer together."""


class PromptHashes:
    """Prompt block hashes by token ids, remembered for the last few prompts.

    Every engine of a fleet is asked about the same prompt within milliseconds, and the
    engines of one ``kvrouter sim`` process share a hasher: one hashing serves them all.
    """

    SIZE = 64
    _memo: ClassVar[OrderedDict[tuple[int, str | None, tuple[int, ...]], list[bytes]]] = OrderedDict()

    def __init__(self, hasher: Any) -> None:
        self.hasher = hasher

    def of(self, ids: list[int], cache_salt: str | None) -> list[bytes]:
        key = (id(self.hasher), cache_salt, tuple(ids))
        memo = self._memo
        found = memo.get(key)
        if found is None:
            found = memo[key] = self.hasher.hash_blocks(ids, cache_salt=cache_salt)
            if len(memo) > self.SIZE:
                memo.popitem(last=False)
        return found


@dataclass(slots=True)
class _Seq:
    prompt_len: int
    hashes: Sequence[bytes]
    output_len: int
    computed: int = 0
    outputs: int = 0
    blocks: int = 0
    reserved_left: int = 0
    cached_upto: int = 0
    target: bool = False
    held: list[Block] = field(default_factory=list)
    """The real blocks it holds (a request already running on the engine)."""
    real_hits: list[int] = field(default_factory=list)
    """Real blocks its admission in the run found cached."""
    keys: list[bytes] = field(default_factory=list)
    """Hashes of blocks the run cached that it holds (found at admission, or its own)."""
    plain: int = 0
    """Blocks the run allocated to it that no other request can share."""
    real: list[Block] | None = None
    """Its leading blocks cached in the engine's pool (which the run never changes), once looked up."""
    memo: _Hit | None = None
    memo_version: int = -1

    def real_prefix(self, pool: BlockPool, block_size: int) -> list[Block]:
        """Leading blocks of the prompt cached in ``pool`` (at most those before its last token)."""
        if self.real is None:
            found: list[Block] = []
            cached = pool.cached
            for h in islice(self.hashes, (self.prompt_len - 1) // block_size):
                copies = cached.get(h)
                if not copies:
                    break
                found.append(next(iter(copies.values())))
            self.real = found
        return self.real

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


def snapshot(engine: Engine, prompt: Prompt, ahead: list[Prompt]) -> dict[str, Any]:
    """The side channel's answer for ``prompt`` on ``engine``, ``ahead`` the prompts sent to it
    that it has not received yet (see the module docstring)."""
    bs = engine.config.block_size
    now = engine.now()
    running = [_running_seq(engine, r) for r in engine.running if not r.done]
    waiting = [_Seq(r.prompt_len, r.cache.block_hashes[: r.prompt_len // bs], len(r.planned.token_ids))
               for r in engine.waiting if not r.done]
    waiting += [_Seq(p.prompt_len, p.hashes, p.output_len) for p in ahead]
    run = _ForwardRun(engine)
    start = now
    if engine.in_step is not None:
        scheduled, start = engine.in_step
        run.finish_step(running, {id(item.req): item.num_new_tokens for item in scheduled},
                        [r for r in engine.running if not r.done])
    for s in running:
        s.cached_upto = min(s.computed, s.prompt_len) // bs
    gpu, cpu = cached_prefix(engine.bm.pool, engine.bm.cpu, prompt.hashes, len(prompt.hashes))
    load, queued_hashes = _load(engine, running, waiting)
    queued = _leading(prompt.hashes, queued_hashes)
    target = _Seq(prompt.prompt_len, prompt.hashes, prompt.output_len, target=True)
    first = run.first_token_at(start, running, deque([*waiting, target]))
    return {
        "engine_time_s": now,
        "received": engine.received,
        "predicted_ttft_s": None if first is None else max(0.0, first - now),
        "cached_blocks": {"gpu": gpu, "cpu": cpu},
        "queued_blocks": queued,
        "load": load,
    }


def cached_prefix(pool: BlockPool, cpu: CpuOffloadTier | None, hashes: Sequence[bytes], limit: int) -> tuple[int, int]:
    """Leading blocks of ``hashes[:limit]`` cached on the GPU, then those the CPU tier continues with."""
    gpu = 0
    for h in islice(hashes, limit):
        if pool.get_cached_block(h) is None:
            break
        gpu += 1
    return gpu, cpu.lookup(hashes[gpu:limit]) if cpu is not None else 0


def _running_seq(engine: Engine, r: SimRequest) -> _Seq:
    bs = engine.config.block_size
    held, reserved = engine.bm.held_by(r.cache.request_id)
    return _Seq(r.prompt_len, r.cache.block_hashes[: r.prompt_len // bs], len(r.planned.token_ids),
                computed=r.num_computed_tokens, outputs=r.num_output, blocks=len(held), reserved_left=reserved,
                held=held)


def _leading(hashes: Sequence[bytes], held: set[bytes]) -> int:
    """Leading blocks of ``hashes`` in ``held`` (hashes chain: a prefix of another prompt's blocks)."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


def _load(engine: Engine, running: list[_Seq], waiting: list[_Seq]) -> tuple[dict[str, int], set[bytes]]:
    """The queue in :class:`router.fleet.load.BackendLoad`'s terms, exact: prompt tokens still to
    prefill, unique KV blocks held or about to be, prompt blocks per request; and the prompt
    blocks of every request on the engine. A waiting request's prefill counts neither what
    the engine holds nor what a request ahead of it will have computed by then (the
    router's own accounting does the same with what it sent)."""
    bs = engine.config.block_size
    pool, cpu = engine.bm.pool, engine.bm.cpu
    prefill = sum(s.prompt_len - s.computed for s in running if s.prefilling)
    held = pool.num_blocks - 1 - pool.num_free_blocks
    ahead: set[bytes] = set()
    for s in running:
        ahead.update(s.hashes)
    for s in waiting:
        limit = (s.prompt_len - 1) // bs
        gpu = max(len(s.real_prefix(pool, bs)), _leading(s.hashes[:limit], ahead))
        loaded = cpu.lookup(s.hashes[gpu:limit]) if cpu is not None else 0
        prefill += s.prompt_len - (gpu + loaded) * bs
        held += -(-s.prompt_len // bs) - gpu
        ahead.update(s.hashes)
    load = {
        "in_flight": len(running) + len(waiting),
        "prefill_tokens": prefill,
        "decode_seqs": sum(1 for s in running if not s.prefilling),
        "active_blocks": held,
        "context_blocks": sum(-(-s.prompt_len // bs) for s in (*running, *waiting)),
    }
    return load, ahead


@dataclass(slots=True)
class _Hit:
    blocks: int = 0
    loaded: int = 0
    real: list[Block] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    free: int = 0
    """Hit blocks no request holds: admission takes them out of the free queue."""


class _ForwardRun:
    """The engine's scheduler (:meth:`loadtest.sim.engine.Engine.schedule`) replayed on counts.

    Free blocks are counted like the pool counts them, by reference: a real block's count
    is the engine's, less the run's finished holders, plus the run's admissions that hit
    it; a block the run caches is counted by hash.
    """

    def __init__(self, engine: Engine) -> None:
        cfg = engine.config
        self.bs = cfg.block_size
        self.budget = cfg.max_num_batched_tokens
        self.max_seqs = cfg.max_num_seqs
        self.latency = cfg.latency
        self.pool = engine.bm.pool
        self.cpu = engine.bm.cpu
        self.free = self.pool.num_free_blocks
        self.reserved = engine.bm.reserved
        self.refs: dict[int, int] = {}
        """Real blocks whose count the run changed: block id -> change."""
        self.future: dict[bytes, int] = {}
        """Prompt blocks the run cached (as the engine caches them, when scheduled) -> holders."""
        self.taken: set[int] = set()
        """Blocks of the engine's free queue an admission in the run took out of it."""
        self._lru = iter(self.pool.free)
        self._evicted: set[int] = set()
        self._spare = 0
        """Blocks freed in the run that the next allocations take before the LRU queue's head
        (a finished request's partial last block, when the pool reuses those first)."""
        self._uncached_first = self.pool.uncached_first
        self._version = 0
        """Bumped whenever a remembered lookup may be stale (an admission, a finish, a hit evicted)."""
        self._watched: set[int] = set()
        """Free cached blocks some remembered lookup hit: their eviction bumps the version."""

    # -- the pool, in counts ----------------------------------------------------------------

    def _lookup(self, s: _Seq) -> _Hit:
        """What admitting ``s`` now would find: its leading cached blocks, and which are free.

        Remembered per request until the version moves or the run caches the block after
        the hit (a queue's head that cannot be admitted is asked every step)."""
        limit = (s.prompt_len - 1) // self.bs
        hit = s.memo
        if hit is not None and s.memo_version == self._version and (
            hit.blocks >= limit or s.hashes[hit.blocks] not in self.future
        ):
            return hit
        hit = _Hit()
        future, refs, evicted = self.future, self.refs, self._evicted
        real = s.real_prefix(self.pool, self.bs)
        for i, h in enumerate(islice(s.hashes, limit)):
            holders = future.get(h)
            if holders is not None:
                hit.keys.append(h)
                hit.free += holders == 0
            else:
                if i >= len(real) or real[i].block_id in evicted:
                    break
                block = real[i]
                hit.real.append(block)
                if block.ref_cnt + refs.get(block.block_id, 0) == 0:
                    hit.free += 1
                    self._watched.add(block.block_id)
            hit.blocks += 1
        hit.loaded = self.cpu.lookup(s.hashes[hit.blocks : limit]) if self.cpu is not None else 0
        s.memo, s.memo_version = hit, self._version
        return hit

    def _take_new(self, n: int) -> None:
        """``n`` new blocks: freed partial blocks first (if the pool reuses them first), then the
        LRU queue's head, whose cached blocks are evicted (taken ones are no longer in it)."""
        spare = min(n, self._spare)
        self._spare -= spare
        for _ in range(n - spare):
            for bid in self._lru:
                if bid not in self.taken:
                    self._evicted.add(bid)
                    if bid in self._watched:
                        self._version += 1
                    break

    def _unref(self, block: Block) -> None:
        bid = block.block_id
        change = self.refs.get(bid, 0) - 1
        self.refs[bid] = change
        if block.ref_cnt + change == 0:
            self.free += 1

    def _lifetime(self, s: _Seq, hit: _Hit) -> int:
        return -(-(s.prompt_len + s.output_len) // self.bs) - hit.blocks

    def _fits(self, s: _Seq, hit: _Hit) -> bool:
        """:meth:`BlockManager.can_admit`."""
        return self._lifetime(s, hit) <= self.free - hit.free - self.reserved

    def _admit(self, s: _Seq, num_running: int) -> int | None:
        """Admit ``s`` if the engine would (returns its CPU-loaded blocks), else None."""
        if num_running >= self.max_seqs:
            return None
        hit = self._lookup(s)
        if not self._fits(s, hit):
            return None
        lifetime = self._lifetime(s, hit)
        self._version += 1
        for block in hit.real:
            if block.ref_cnt == 0:
                self.taken.add(block.block_id)
            self.refs[block.block_id] = self.refs.get(block.block_id, 0) + 1
        for h in hit.keys:
            self.future[h] += 1
        self.free -= hit.free
        self.reserved += lifetime
        s.reserved_left = lifetime
        s.real_hits = [b.block_id for b in hit.real]
        s.keys = hit.keys
        s.blocks = s.cached_upto = hit.blocks
        s.computed = (hit.blocks + hit.loaded) * self.bs
        return hit.loaded

    def _allocate(self, s: _Seq, n: int) -> None:
        need = -(-(s.computed + n) // self.bs)
        new = need - s.blocks
        if new > 0:
            self.free -= new
            self._take_new(new)
            used = min(new, s.reserved_left)
            s.reserved_left -= used
            self.reserved -= used
            s.blocks = need
            s.plain += new
        full = min(s.computed + n, s.prompt_len) // self.bs
        if full > s.cached_upto:
            future = self.future
            for h in s.hashes[s.cached_upto : full]:
                if h not in future:
                    future[h] = 1
                    s.keys.append(h)
                    s.plain -= 1
            s.cached_upto = full

    def _finish(self, s: _Seq, running: list[_Seq]) -> None:
        running.remove(s)
        self._version += 1
        self.reserved -= s.reserved_left
        self.free += s.plain
        if self._uncached_first and (s.prompt_len + s.outputs) % self.bs:
            self._spare += 1
        refs = self.refs
        for block in s.held:
            bid = block.block_id
            if bid not in refs and block.ref_cnt == 1:
                refs[bid] = -1
                self.free += 1
            else:
                self._unref(block)
        for bid in s.real_hits:
            self._unref(self.pool.blocks[bid])
        future = self.future
        for h in s.keys:
            future[h] -= 1
            if future[h] == 0:
                self.free += 1

    def finish_step(self, running: list[_Seq], work: dict[int, int], reqs: list[SimRequest]) -> None:
        """Apply the step being computed (``work``: tokens per request id) to ``running``."""
        for s, r in zip(list(running), reqs):
            n = work.get(id(r))
            if not n:
                continue
            s.computed += n
            if not s.prefilling:
                s.outputs += 1
                if s.outputs >= s.output_len:
                    self._finish(s, running)

    # -- steps ------------------------------------------------------------------------------

    def first_token_at(self, t: float, running: list[_Seq], waiting: deque[_Seq]) -> float | None:
        """Engine time of the target's first token, stepping from ``t``; None if it never starts."""
        for _ in range(MAX_STEPS):
            if self._stalled(running, waiting):
                t += self._jump(running)
                continue
            budget = self.budget
            prefill = decode = kv = loaded_total = 0
            work: list[tuple[_Seq, int]] = []
            for s in running:
                if budget <= 0:
                    break
                if s.prefilling:
                    n = min(s.prompt_len - s.computed, budget)
                    prefill += n
                else:
                    n = 1
                    decode += 1
                self._allocate(s, n)
                kv += s.blocks
                budget -= n
                work.append((s, n))
            while waiting and budget > 0:
                s = waiting[0]
                loaded = self._admit(s, len(running))
                if loaded is None:
                    break
                waiting.popleft()
                n = min(s.prompt_len - s.computed, budget)
                self._allocate(s, n)
                kv += s.blocks
                budget -= n
                prefill += n
                loaded_total += loaded
                running.append(s)
                work.append((s, n))
            if not work:
                return None
            t += self.latency.step_time(prefill, decode, kv, loaded_total)
            for s, n in work:
                s.computed += n
                if s.prefilling:
                    continue
                if s.target:
                    return t
                s.outputs += 1
                if s.outputs >= s.output_len:
                    self._finish(s, running)
        return None

    def _stalled(self, running: list[_Seq], waiting: deque[_Seq]) -> bool:
        """Only decoding requests run and the queue's head cannot be admitted: nothing but
        decode steps until one finishes."""
        if not running or not waiting or any(s.prefilling for s in running):
            return False
        return len(running) >= self.max_seqs or not self._fits(waiting[0], self._lookup(waiting[0]))

    def _jump(self, running: list[_Seq]) -> float:
        """Every running request decodes until the first of them finishes; returns the time taken."""
        k = max(1, min(s.output_len - s.outputs for s in running))
        lat, bs = self.latency, self.bs
        # Step j reads ceil((computed + j) / bs) blocks of each request: summed in closed form.
        reads = sum(_ceil_sum(s.computed + k, bs) - _ceil_sum(s.computed, bs) for s in running)
        took = k * lat.step_time(0, len(running), 0) + lat.kv_read_s_per_block * reads
        for s in list(running):
            self._allocate(s, k)
            s.computed += k
            s.outputs += k
            if s.outputs >= s.output_len:
                self._finish(s, running)
        return took


def _ceil_sum(x: int, bs: int) -> int:
    """``sum(ceil(m / bs) for m in 1..x)``."""
    q, r = divmod(x, bs)
    return bs * q * (q + 1) // 2 + r * (q + 1)
