"""The prefix index: which worker holds how many leading blocks of a request.

Every engine reports, through KV events, the 64-bit keys of the blocks it caches and in
which tier (``medium``: GPU, CPU, ...). The router asks, for a request's chain of block
keys, how many *leading* blocks each worker holds. Only the leading run counts because
each block hash chains its parent: vLLM's scheduler walks the chain left to right and
stops at the first miss (``docs/vllm-facts.md`` §2), so a block held after a gap is
never reused.

Two implementations share the :class:`Index` protocol and its semantics (the tests run
one behaviour suite over both): :class:`MemoryIndex` here, the embedded default, and
``indexer.redis_index.RedisIndex``, shared by router replicas.

Semantics common to both:

* ``lookup`` returns ``{worker: {medium: n}}`` where the ``n`` of a worker add up to its
  matched count, the number of leading keys it holds in *any* medium. Each of those
  blocks is attributed to the best tier holding it (:func:`medium_rank`: GPU, then
  CPU, then other names alphabetically), so a block in GPU and CPU counts as GPU. A
  worker that matched nothing is absent, and so is a medium with no blocks.
* Models are separate key spaces (vLLM's hash does not include the model name); LoRA
  adapters need no separation because their name (and, from 0.31, path) is in the hash.
* Keys are ints in ``0 .. 2**64-1``. ``store``/``remove`` reject anything else with
  :class:`InvalidKey` before changing anything (``apply`` cannot meet one: the event's
  hashes go through :func:`indexer.events.to_keys`, which maps ints and digests into
  that range). ``lookup`` does not check its keys (they come from the router's own
  hasher); an int outside the range cannot have been stored, so matching stops there.
* ``medium=None`` means GPU (older engines send no medium).
* A (worker, medium) may hold one key in several blocks: vLLM caches every newly full
  block under its hash even when another block already has that hash (the commonest
  case: an identical prompt of an exact multiple of ``block_size`` tokens, sent twice,
  recomputes its last block into a second block), publishes ``BlockStored`` for each,
  and one ``BlockRemoved`` per evicted block. So each (model, worker, medium, key) has
  a copy count: every occurrence of the key in a ``store`` adds one copy, every
  occurrence in a ``remove`` takes one away (never below none; removing a key not
  held is a no-op), and the key is held while a copy is left. ``clear`` drops all
  copies.
* ``block_counts`` counts distinct (block key, medium) entries per worker, not copies;
  a worker holding nothing is absent.
* A worker holds at most ``caps.cap(worker, medium)`` keys per medium (:class:`KeyCaps`:
  twice its engine's capacity in that tier). A ``store`` past the cap evicts the worker's
  oldest keys in that medium (oldest by first store since its last compaction), O(1)
  amortised per key; ``apply`` returns how many keys the caps dropped.
"""

from __future__ import annotations

import logging
import sys
import threading
from array import array
from collections.abc import Mapping, Sequence
from itertools import groupby, repeat
from typing import NamedTuple, Protocol

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, to_keys

__all__ = [
    "DEFAULT_MEDIUM",
    "Hits",
    "Index",
    "InvalidKey",
    "KeyCaps",
    "MemoryIndex",
    "Op",
    "Worker",
    "batch_ops",
    "medium_rank",
    "validate_keys",
]

log = logging.getLogger(__name__)

DEFAULT_MEDIUM = "GPU"
KEY_LIMIT = 1 << 64
KEY_CAP_SLACK = 2
"""A worker may hold this many times its engine's block capacity in keys per medium (see :class:`KeyCaps`)."""
DEFAULT_CAPACITY_BLOCKS = 1 << 20
"""The capacity assumed for a tier whose engine does not report one (no scrape yet, a tier
``vllm:cache_config_info`` does not describe, ``kvrouter indexer``): about a million blocks,
more than a small model's KV cache on eight H200s, so a real engine never meets the cap,
while a forged stream costs the index at most ~200 MB per (worker, medium)."""
EVICT_DRAIN = 4096
"""Most keys one store evicts beyond those it added: a cap that shrinks under a full worker
(its engine's capacity read after a flood) drains over later stores, not in one long pass
that holds the subscriber's thread (or Redis, which uses the same bound)."""


class Worker(NamedTuple):
    """One engine's KV cache: a backend and its data-parallel rank."""

    backend: str
    dp_rank: int = 0


Hits = dict[Worker, dict[str, int]]
"""worker -> {medium: number of the request's leading blocks held, attributed to that medium}."""


class InvalidKey(ValueError):
    """A block key that is not an int in ``0 .. 2**64-1``."""


class KeyCaps:
    """How many keys each worker may hold per medium: :data:`KEY_CAP_SLACK` times the blocks
    its engine has in that tier (``vllm:cache_config_info``'s ``num_gpu_blocks`` for GPU,
    ``num_cpu_blocks`` for CPU when the engine says), else :data:`DEFAULT_CAPACITY_BLOCKS`.

    A real engine never holds more blocks in a tier than the tier has, so a worker past its
    capacity is being sent forged events (KV-event sockets are unauthenticated) or lost
    some removals. Why twice and not once: the capacity is read off a scrape up to an
    interval old (an engine restarted with a bigger cache reports it only at the next
    one), the offloading connector's CPU tier may key one of its blocks by several hashes,
    and a real key evicted by mistake costs a routing miss while the slack costs only
    bounded memory. So a real engine stays clear of the cap, and a flood still ends at a
    bound the operator can read off ``/metrics``.

    Thread-safety: :meth:`set_capacity` (the router's scrape) replaces a worker's entry
    whole, so the subscriber thread's :meth:`cap` reads either the old or the new one.
    """

    def __init__(self, default_blocks: int = DEFAULT_CAPACITY_BLOCKS, slack: int = KEY_CAP_SLACK) -> None:
        self.default_blocks = default_blocks
        self.slack = slack
        self._blocks: dict[Worker, dict[str, int]] = {}

    def set_capacity(self, worker: Worker, blocks: Mapping[str, int] | None) -> None:
        """``worker``'s engine holds at most ``blocks[medium]`` blocks per tier (None: unknown again)."""
        if blocks is None:
            self._blocks.pop(worker, None)
        else:
            self._blocks[worker] = {m: int(n) for m, n in blocks.items() if int(n) > 0}

    def capacity(self, worker: Worker) -> dict[str, int]:
        """The tiers' capacities known for ``worker`` (a copy)."""
        return dict(self._blocks.get(worker, {}))

    def cap(self, worker: Worker, medium: str) -> int:
        """The most keys ``worker`` may hold in ``medium``."""
        known = self._blocks.get(worker)
        blocks = known.get(medium) if known else None
        return self.slack * (blocks or self.default_blocks)


class Index(Protocol):
    """Where the fleet's cached blocks are, per model, worker and medium."""

    caps: KeyCaps
    """The bound on keys per worker and medium, which :meth:`apply` and :meth:`store` enforce."""

    def apply(self, model: str, worker: Worker, batch: EventBatch) -> int:
        """Apply one event batch in order (the subscriber thread calls this); the number of
        stored keys the caps dropped (evicted, or past the cap within one event)."""

    def store(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        """``worker`` now holds one more copy of each of ``keys`` in ``medium``."""

    def remove(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        """``worker`` holds one copy fewer of each of ``keys`` in ``medium``; keys it did not hold are ignored."""

    def clear(self, model: str, worker: Worker) -> None:
        """Forget everything ``worker`` holds in every medium (AllBlocksCleared, restart, purge)."""

    async def lookup(self, model: str, keys: Sequence[int]) -> Hits:
        """Leading blocks of ``keys`` held by each worker (request path, event loop)."""

    def block_counts(self, model: str) -> dict[Worker, int]:
        """(block, medium) entries held per worker."""

    def worker_keys(self, model: str) -> dict[Worker, set[int]]:
        """Every key each worker holds, any medium (a full copy: debugging and the chaos suite)."""

    def memory_bytes(self) -> int:
        """Bytes the index occupies (an accounted estimate; see each implementation)."""


def medium_rank(medium: str) -> tuple[int, str]:
    """Sort key of tiers, best first: GPU, CPU, then any other name alphabetically."""
    if medium == "GPU":
        return (0, "")
    if medium == "CPU":
        return (1, "")
    return (2, medium)


def validate_keys(keys: Sequence[int]) -> Sequence[int]:
    """``keys`` unchanged if every one is an int in ``0 .. 2**64-1``, else :class:`InvalidKey`.

    ``min``/``max`` and a set of types run in C, so checking costs a few ns per key.
    """
    if not keys:
        return keys
    kinds = set(map(type, keys))
    if kinds != {int}:
        bad = next(k for k in keys if type(k) is not int)
        raise InvalidKey(f"block key {bad!r} is a {type(bad).__name__}, not an int")
    lo, hi = min(keys), max(keys)
    if lo < 0 or hi >= KEY_LIMIT:
        bad = lo if lo < 0 else hi
        raise InvalidKey(f"block key {bad} is outside 0 .. 2**64-1")
    return keys


class Op(NamedTuple):
    """One index write derived from an event: ``kind`` is store, remove or clear."""

    kind: str
    medium: str
    keys: Sequence[int]


def batch_ops(batch: EventBatch) -> list[Op]:
    """The index writes an event batch stands for, in order.

    Only KV-cache group 0 (or no group, pre-hybrid engines) is indexed. A hybrid model
    keys its blocks per group; group 0 is the full-attention group whose chain is the
    one the router hashes (one key per ``block_size`` tokens), while other groups
    (sliding window, mamba) hold either the same keys again or coarser keys, which
    would only duplicate or pollute group 0's chain. Events of unknown types are
    skipped (the subscriber counts them when decoding).
    """
    ops: list[Op] = []
    for ev in batch.events:
        if type(ev) is BlockStored:
            if ev.group_idx:
                continue
            ops.append(Op("store", ev.medium or DEFAULT_MEDIUM, to_keys(ev.block_hashes)))
        elif type(ev) is BlockRemoved:
            if ev.group_idx:
                continue
            ops.append(Op("remove", ev.medium or DEFAULT_MEDIUM, to_keys(ev.block_hashes)))
        elif type(ev) is AllBlocksCleared:
            ops.append(Op("clear", DEFAULT_MEDIUM, ()))
    return ops


_FIELD = 32
"""Bits per worker in a spread counter (see :meth:`_ModelIndex.spread`); counts < 2**32."""


class _ModelIndex:
    """One model's key space.

    Invariants:

    * ``tables[medium][key]`` is a bitmask of worker slots holding ``key`` in that
      medium, never 0 (a key no worker holds is deleted). With at most 9 workers the
      masks are CPython's cached small ints, so an entry costs only its dict slot and
      its key object.
    * ``logs[(slot, medium)]`` holds every key stored by that worker in that medium
      since the last compaction (removed keys included, duplicates possible), as raw
      8-byte values, in the order of their store: clearing a worker walks its own log,
      never the whole table. ``heads[(slot, medium)]`` (0 when absent) is where the
      cap's eviction resumes: every key the worker holds has an entry at or after it.
    * ``counts[(slot, medium)]`` is the number of keys whose mask has the slot's bit.
    * ``extras[(slot, medium)]`` maps a key to the copies the worker holds beyond the
      first (always > 0), and only ever names keys whose mask has the slot's bit.
      Duplicates are rare, so the bitmask table stays the whole picture for lookups and
      this side dict is touched only by a store of a key already held and by removes
      of a worker that has one.
    * ``workers`` (slot -> Worker) and ``order`` ((medium, table) best tier first) are
      tuples replaced whole, so a lookup on another thread reads a consistent snapshot.

    Writers hold :class:`MemoryIndex`'s lock; keys are already checked.
    """

    __slots__ = ("counts", "extras", "heads", "logs", "order", "slots", "spreads", "tables", "workers")

    def __init__(self) -> None:
        self.slots: dict[Worker, int] = {}
        self.workers: tuple[Worker, ...] = ()
        self.tables: dict[str, dict[int, int]] = {}
        self.order: tuple[tuple[str, dict[int, int]], ...] = ()
        self.logs: dict[tuple[int, str], array] = {}
        self.heads: dict[tuple[int, str], int] = {}
        self.counts: dict[tuple[int, str], int] = {}
        self.extras: dict[tuple[int, str], dict[int, int]] = {}
        self.spreads: dict[int, int] = {}

    def slot(self, worker: Worker) -> int:
        slot = self.slots.get(worker)
        if slot is None:
            slot = len(self.workers)
            self.slots[worker] = slot
            self.workers = (*self.workers, worker)
        return slot

    def table(self, medium: str) -> dict[int, int]:
        table = self.tables.get(medium)
        if table is None:
            table = self.tables[medium] = {}
            self.order = tuple(sorted(self.tables.items(), key=lambda mt: medium_rank(mt[0])))
        return table

    def store(self, worker: Worker, keys: Sequence[int], medium: str, cap: int) -> int:
        """Store ``keys``, then evict the worker's oldest keys in ``medium`` past ``cap``;
        the number of keys dropped. Of a store longer than ``cap`` only its first ``cap``
        keys are kept and the rest dropped unread: a store is one chain, head first, and
        hits are always a prefix, so its tail without its head could never be hit."""
        if not keys:
            return 0
        dropped = max(0, len(keys) - cap)
        if dropped:
            keys = keys[:cap]
        slot = self.slot(worker)
        bit = 1 << slot
        table = self.table(medium)
        get = table.get
        logkey = (slot, medium)
        log_ = self.logs.get(logkey)
        if log_ is None:
            log_ = self.logs[logkey] = array("Q")
        append = log_.append
        added = 0
        extra: dict[int, int] | None = None
        for k in keys:
            m = get(k, 0)
            if not m & bit:
                table[k] = m | bit
                append(k)
                added += 1
            else:
                if extra is None:
                    extra = self.extras.setdefault(logkey, {})
                extra[k] = extra.get(k, 0) + 1
        count = self.counts.get(logkey, 0) + added
        if count > cap:
            evicted = self._evict(logkey, bit, table, log_, min(count - cap, added + EVICT_DRAIN))
            count -= evicted
            dropped += evicted
        self.counts[logkey] = count
        head = self.heads.get(logkey, 0)
        if len(log_) - head > 2 * count + 4096:
            self.logs[logkey] = array("Q", [k for k in dict.fromkeys(log_[head:]) if get(k, 0) & bit])
            self.heads.pop(logkey, None)
        elif head > len(log_) - head + 4096:
            del log_[:head]
            self.heads.pop(logkey, None)
        return dropped

    def _evict(self, logkey: tuple[int, str], bit: int, table: dict[int, int], log_: array, n: int) -> int:
        """Drop up to ``n`` of the worker's keys, oldest first: walk its log from ``heads``,
        skipping entries it no longer holds. Each log entry is passed once, so eviction costs
        O(1) per stored key. All copies of an evicted key go with it."""
        head = self.heads.get(logkey, 0)
        end = len(log_)
        extra = self.extras.get(logkey)
        evicted = 0
        while evicted < n and head < end:
            k = log_[head]
            head += 1
            if _drop(table, bit, (k,)):
                if extra:
                    extra.pop(k, None)
                evicted += 1
        self.heads[logkey] = head
        return evicted

    def remove(self, worker: Worker, keys: Sequence[int], medium: str) -> None:
        slot = self.slots.get(worker)
        table = self.tables.get(medium)
        if slot is None or table is None:
            return
        logkey = (slot, medium)
        extra = self.extras.get(logkey)
        if extra:
            dropped = _drop_copies(table, 1 << slot, extra, keys)
        else:
            dropped = _drop(table, 1 << slot, keys)
        self.counts[logkey] = self.counts.get(logkey, 0) - dropped

    def clear(self, worker: Worker) -> None:
        slot = self.slots.get(worker)
        if slot is None:
            return
        for medium, table in self.tables.items():
            logkey = (slot, medium)
            log_ = self.logs.pop(logkey, None)
            if log_ is not None:
                _drop(table, 1 << slot, log_)
            self.heads.pop(logkey, None)
            self.counts.pop(logkey, None)
            self.extras.pop(logkey, None)

    def spread(self, mask: int) -> int:
        """``mask`` with slot ``s``'s bit moved to bit ``s * _FIELD``.

        Adding spread masks counts, in one big-int addition, how many times each slot
        was set; memoised because a fleet produces few distinct masks.
        """
        out = self.spreads.get(mask)
        if out is None:
            out, m = 0, mask
            while m:
                low = m & -m
                out |= 1 << ((low.bit_length() - 1) * _FIELD)
                m ^= low
            if len(self.spreads) > 4096:
                self.spreads.clear()
            self.spreads[mask] = out
        return out


class MemoryIndex:
    """The in-process index: per model and medium, one ``dict[int, int]`` key -> worker bitmask.

    Why this shape: a lookup is one ``dict.get`` and two int operations per block and
    stops when the last worker drops out, and one table serves every worker (no
    per-(block, worker) Python object). Writes hold a lock (``apply`` on the subscriber
    thread may race ``clear`` from a purge); lookups take none: they only ``get`` from
    dicts and read snapshot tuples, which a concurrent write cannot make raise. A
    lookup may see a batch half-applied, which is no worse than seeing it a moment
    later.
    """

    def __init__(self, caps: KeyCaps | None = None) -> None:
        self._models: dict[str, _ModelIndex] = {}
        self._lock = threading.Lock()
        self.caps = caps or KeyCaps()

    def _model(self, model: str) -> _ModelIndex:
        mi = self._models.get(model)
        if mi is None:
            mi = self._models[model] = _ModelIndex()
        return mi

    def apply(self, model: str, worker: Worker, batch: EventBatch) -> int:
        """Apply the batch under one lock hold; its keys need no check (``to_keys`` ranges them)."""
        ops = batch_ops(batch)
        if not ops:
            return 0
        dropped = 0
        cap = self.caps.cap
        with self._lock:
            mi = self._model(model)
            for op in ops:
                if op.kind == "store":
                    dropped += mi.store(worker, op.keys, op.medium, cap(worker, op.medium))
                elif op.kind == "remove":
                    mi.remove(worker, op.keys, op.medium)
                else:
                    mi.clear(worker)
        return dropped

    def store(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        validate_keys(keys)
        medium = medium or DEFAULT_MEDIUM
        with self._lock:
            self._model(model).store(worker, keys, medium, self.caps.cap(worker, medium))

    def remove(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        validate_keys(keys)
        with self._lock:
            mi = self._models.get(model)
            if mi is not None:
                mi.remove(worker, keys, medium or DEFAULT_MEDIUM)

    def clear(self, model: str, worker: Worker) -> None:
        with self._lock:
            mi = self._models.get(model)
            if mi is not None:
                mi.clear(worker)

    async def lookup(self, model: str, keys: Sequence[int]) -> Hits:
        mi = self._models.get(model)
        if mi is None or not keys:
            return {}
        order = mi.order
        if not order:  # the model's first event batch is being applied, or held only removes
            return {}
        if len(order) == 1:
            return _match_one(mi.workers, order[0][0], order[0][1], keys)
        return _match_tiers(mi, order, keys)

    def block_counts(self, model: str) -> dict[Worker, int]:
        with self._lock:
            mi = self._models.get(model)
            if mi is None:
                return {}
            out: dict[Worker, int] = {}
            for (slot, _), n in mi.counts.items():
                if n:
                    w = mi.workers[slot]
                    out[w] = out.get(w, 0) + n
            return out

    def worker_keys(self, model: str) -> dict[Worker, set[int]]:
        """Every key each worker holds, any medium: the whole picture, for ``/debug/index``.

        A full copy taken under the lock (a debug and test aid, never on a request's path):
        the chaos suite (:mod:`loadtest.chaos`) compares it with each engine's true cache."""
        with self._lock:
            mi = self._models.get(model)
            if mi is None:
                return {}
            out: dict[Worker, set[int]] = {}
            for table in mi.tables.values():
                for key, mask in table.items():
                    while mask:
                        low = mask & -mask
                        out.setdefault(mi.workers[low.bit_length() - 1], set()).add(key)
                        mask ^= low
            return out

    def memory_bytes(self) -> int:
        """Accounted bytes: dict tables, key objects, mask objects, per-worker logs and extra copies.

        Exact for the containers (``sys.getsizeof``); each key object is counted at 36
        bytes (an int >= 2**60, which 15/16 of random 64-bit keys are) and each mask at
        32 bytes unless the model has at most 9 workers, whose masks (< 512, most
        <= 256) are mostly CPython's shared small ints. ``benchmarks/bench_index.py``
        compares this figure with tracemalloc.
        """
        total = sys.getsizeof(self._models)
        with self._lock:
            for mi in self._models.values():
                value_bytes = 0 if len(mi.workers) <= 9 else 32
                for table in mi.tables.values():
                    total += sys.getsizeof(table) + len(table) * (36 + value_bytes)
                total += sum(sys.getsizeof(a) for a in mi.logs.values())
                total += sum(sys.getsizeof(x) + len(x) * 36 for x in mi.extras.values())
        return total


def _drop(table: dict[int, int], bit: int, keys: Sequence[int]) -> int:
    """Clear ``bit`` from each key's mask (deleting keys left with none); the number cleared."""
    get = table.get
    dropped = 0
    for k in keys:
        m = get(k, 0)
        if m & bit:
            m ^= bit
            if m:
                table[k] = m
            else:
                del table[k]
            dropped += 1
    return dropped


def _drop_copies(table: dict[int, int], bit: int, extra: dict[int, int], keys: Sequence[int]) -> int:
    """:func:`_drop` for a worker with extra copies: a key with an extra copy loses that copy, not its bit."""
    single = []
    for k in keys:
        n = extra.get(k)
        if n == 1:
            del extra[k]
        elif n:
            extra[k] = n - 1
        else:
            single.append(k)
    return _drop(table, bit, single)


def _match_one(workers: tuple[Worker, ...], medium: str, table: dict[int, int], keys: Sequence[int]) -> Hits:
    """Leading matches when the model has one medium: the hot path.

    ``alive`` holds the slots that held every key so far; a slot leaves it at the first
    key it lacks, and its match is that key's position.
    """
    get = table.get
    alive = get(keys[0], 0)
    if not alive:  # a new prompt: nobody holds its first block
        return {}
    # The masks come out of one C-level pass and are walked run by run (groupby, also C):
    # a chain has a few runs (a prefix many workers hold, then fewer), so Python only sees
    # those, not every key (a 512-block hit: 40 -> 23 µs).
    ends: list[tuple[int, int]] = []
    pos = 0
    for mask, run in groupby(map(get, keys, repeat(0))):
        held = mask & alive
        if held != alive:
            ends.append((alive ^ held, pos))
            alive = held
            if not alive:
                break
        pos += len(list(run))
    if alive:
        ends.append((alive, len(keys)))
    hits: Hits = {}
    for mask, n in ends:
        if n:
            while mask:
                low = mask & -mask
                hits[workers[low.bit_length() - 1]] = {medium: n}
                mask ^= low
    return hits


def _match_tiers(mi: _ModelIndex, order: tuple[tuple[str, dict[int, int]], ...], keys: Sequence[int]) -> Hits:
    """Leading matches over several media, each block attributed to its best tier.

    A block counts for every slot still alive after it; tiers after the first add the
    spread form of the slots they alone (among better tiers) hold to a per-tier counter,
    and the first tier gets the rest of each slot's match.
    """
    workers = mi.workers
    gets = [t.get for _, t in order]
    lower = range(1, len(gets))
    counters = [0] * len(gets)
    alive = (1 << len(workers)) - 1
    ends: list[tuple[int, int]] = []
    for i, k in enumerate(keys):
        masks = [g(k, 0) for g in gets]
        held = 0
        for m in masks:
            held |= m
        held &= alive
        if held != alive:
            ends.append((alive ^ held, i))
            alive = held
            if not alive:
                break
        covered = masks[0]
        for j in lower:
            only = masks[j] & alive & ~covered
            if only:
                counters[j] += mi.spread(only)
            covered |= masks[j]
    else:
        ends.append((alive, len(keys)))
    field = (1 << _FIELD) - 1
    hits: Hits = {}
    for mask, n in ends:
        if not n:
            continue
        while mask:
            low = mask & -mask
            slot = low.bit_length() - 1
            mask ^= low
            per: dict[str, int] = {}
            rest = n
            for j in lower:
                c = (counters[j] >> (slot * _FIELD)) & field
                if c:
                    per[order[j][0]] = c
                    rest -= c
            if rest:
                per[order[0][0]] = rest
            hits[workers[slot]] = dict(sorted(per.items(), key=lambda mc: medium_rank(mc[0])))
    return hits
