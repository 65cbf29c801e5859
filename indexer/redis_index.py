"""The prefix index in Redis, so that several router replicas share one picture of the fleet.

Semantics are :mod:`indexer.index`'s exactly (one test suite runs over both). Layout,
per model, under the prefix ``{ns}:{<model>}:`` (the braces are a cluster hash tag, so
one model's keys share a slot and a script may touch all of them):

* ``reg`` -- a hash: live worker id (``["backend",dp_rank]`` in compact JSON) -> slot
  number. Slot ``s`` is bit ``s % 32`` of page ``s // 32``.
* ``m`` -- a set of the media ever written.
* ``h:<medium>\\n<page>`` -- one hash per (medium, page of 32 slots): block key (8
  big-endian bytes) -> bitmask of the page's slots holding it in that medium, as a
  decimal 32-bit signed int (Lua's ``bit`` library works on those), never 0: a key no
  slot holds is deleted.
* ``l:<slot>\\n<medium>`` -- a list per (slot, medium), the log ``clear`` walks (no
  SCAN): every key whose mask has the slot's bit, appended when the bit is set. Removes
  leave their keys in it (a list entry costs ~10 bytes where a set member costs ~50);
  a write that finds the log longer than twice the count plus :data:`_CHUNK` rotates one
  chunk of it, dropping keys whose bit is clear (and repeats within the chunk), so the
  log stays within a constant factor of what the slot holds. A log whose last key is
  removed is deleted.
* ``n`` -- a hash: ``<slot>\\n<medium>`` -> number of keys whose mask has the slot's bit
  (``block_counts``).
* ``x:<slot>\\n<medium>`` -- present only while the slot holds some key in more than one
  block: key -> copies beyond the first (always > 0, only for keys in the slot's log).
* ``d`` -- a hash whose fields are slots being drained after a ``clear``.

A store that leaves a slot with more keys in a medium than its cap (the op carries
``caps.cap(worker, medium)``, :class:`indexer.index.KeyCaps`) pops the slot's log from
its head and clears the bits of the keys still held, until the count is back at the
cap: each log entry is popped once, so this is O(1) per stored key. One store evicts at
most the keys it added plus :data:`_DRAIN`, so a cap that shrinks under a full worker
(its engine's capacity read after a flood) drains over later stores instead of blocking
Redis for seconds in one call. The log is in store
order except for the entries a compaction moved from the head to the tail, so "oldest"
is approximate after one, which is enough for a cap that only a forged stream or lost
removals reach.
* ``{ns}:models`` -- the models written, for memory accounting.

Why one hash of masks per medium rather than a set per worker: a lookup is one
``HMGET`` per medium for a chunk of the chain (growing chunks: 16, 64, 256, 1024, 4096
keys, so a miss costs little; the fields are cut from the packed keys by one
``struct.unpack``, a library Redis and Valkey load for scripts) and a walk with Lua's ``bit`` library that serves every worker of a
page at once and stops when the last one drops out; consecutive identical mask strings
(the common case: a prefix shared by the same workers) skip even the bit operations.
The cost is per matched block, not per (worker, matched block); what is left is mostly
Redis' own hash lookups. Writes are a read-modify-write of the masks, which is why each
is a script. Memory: a mask entry (~60 bytes) per distinct (block, medium, page) plus a
log entry (~10 bytes) per (block, worker), so a block held by several workers costs
little more than one held by a single worker (``benchmarks/bench_index.py``, where most
blocks have one holder, measures ~76 bytes per (block, worker)).

``clear`` is immediate for readers: it takes the worker out of ``reg`` (a lookup only
looks at bits of slots in ``reg``), drops its extra copies, and marks its slot as
draining in ``d``. The slot's bits are then cleared from its logs in steps of at
most :data:`_DRAIN` keys per script call (so one worker with millions of blocks never
blocks Redis for long); a slot is reused only once drained. Every write call finishes
with a step of draining when ``d`` is not empty, and :meth:`RedisIndex.clear` (or an
``apply`` whose batch cleared) repeats empty write calls until nothing is left, so a
process that died mid-drain leaves work that the next write resumes.

A lookup is one ``EVALSHA`` round trip, read-only (``flags=no-writes``) so it also runs
on replicas. Needs Redis >= 7.0 (shebang flags) or Valkey; only core commands are used.
Every write call (``apply``: one event batch; ``store``, ``remove``, ``clear``) is one
``EVALSHA`` of :data:`_WRITE` (a read-modify-write of masks must be atomic; a script
also keeps a batch atomic), plus the drain steps above after a clear. The model's name
goes into ``{ns}:models`` (a different cluster slot) by a separate command, once per
model per process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import time
from collections.abc import Sequence

import redis
import redis.asyncio as aredis
from prometheus_client import Counter

from indexer.breaker import Breaker, Open
from indexer.events import EventBatch
from indexer.index import DEFAULT_MEDIUM, EVICT_DRAIN, Hits, KeyCaps, Worker, batch_ops, validate_keys

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 1.0
"""Longest a lookup waits for Redis (connect or answer) before the request is routed without it."""
WRITE_TIMEOUT_S = 5.0
"""Longest a write, or a debug read, waits for Redis: the subscriber re-synchronises after it."""
LOOKUP_FAILURES = Counter("kvrouter_index_lookup_failures", "Redis index lookups that failed (routed without cache hits)")

__all__ = ["RedisIndex"]

_CHUNK = 2048
"""Keys per command inside the write script: an ``HSET`` of pairs takes twice as many arguments, and Lua's ``unpack`` is bounded (8000 in Redis' Lua)."""

_DRAIN = EVICT_DRAIN
"""Most log keys one write call walks for draining slots, and evicts past what it stored,
bounding how long it holds Redis (see the benchmark's clear time)."""

_PAGE = 32
"""Slots per mask hash: Lua's ``bit`` library works on 32-bit ints."""

_LOOKUP = """#!lua flags=no-writes
local prefix = ARGV[1]
local blob = ARGV[2]
local n = #blob / 8
if n == 0 then return {} end
local band, bor, bxor, bnot, lshift = bit.band, bit.bor, bit.bxor, bit.bnot, bit.lshift
local function rank(m)
  if m == 'GPU' then return '0' elseif m == 'CPU' then return '1' end
  return '2' .. m
end
local media = redis.call('SMEMBERS', prefix .. 'm')
if #media == 0 then return {} end
table.sort(media, function(a, b) return rank(a) < rank(b) end)
local nm = #media
local owner, pages, page_list = {}, {}, {}
local reg = redis.call('HGETALL', KEYS[1])
for i = 1, #reg, 2 do
  local slot = tonumber(reg[i + 1])
  owner[slot] = reg[i]
  local p = math.floor(slot / 32)
  if not pages[p] then
    pages[p] = 0
    page_list[#page_list + 1] = p
  end
  pages[p] = bor(pages[p], lshift(1, slot % 32))
end
local formats = {}
-- struct.unpack also returns the position after the last field: HMGET gets it as one
-- more field, which is never a key (a number of at most 6 digits, keys are 8 bytes).
local function hmget(hash, first, last)
  local k = last - first + 1
  local f = formats[k]
  if not f then
    f = string.rep('c8', k)
    formats[k] = f
  end
  return redis.call('HMGET', hash, struct.unpack(f, blob, first * 8 - 7))
end
local out = {}
for _, p in ipairs(page_list) do
  local alive = pages[p]
  local ends = {}
  local spread = {}
  for j = 2, nm do spread[j] = {} end
  local hashes = {}
  for j = 1, nm do hashes[j] = prefix .. 'h:' .. media[j] .. '\\n' .. p end
  local first, size = 1, 16
  while first <= n and alive ~= 0 do
    local last = math.min(first + size - 1, n)
    if nm == 1 then
      local masks = hmget(hashes[1], first, last)
      local same = nil
      for i = 1, last - first + 1 do
        local v = masks[i]
        if v ~= same then
          local held = v and band(tonumber(v), alive) or 0
          if held ~= alive then
            ends[#ends + 1] = {bxor(alive, held), first + i - 2}
            alive = held
            if alive == 0 then break end
          end
          same = v
        end
      end
    else
      local masks = {}
      for j = 1, nm do masks[j] = hmget(hashes[j], first, last) end
      for i = 1, last - first + 1 do
        local m = {}
        local held = 0
        for j = 1, nm do
          local v = masks[j][i]
          m[j] = v and tonumber(v) or 0
          held = bor(held, m[j])
        end
        held = band(held, alive)
        if held ~= alive then
          ends[#ends + 1] = {bxor(alive, held), first + i - 2}
          alive = held
          if alive == 0 then break end
        end
        local covered = m[1]
        for j = 2, nm do
          local only = band(m[j], band(alive, bnot(covered)))
          if only ~= 0 then
            local s = spread[j]
            for b = 0, 31 do
              if band(only, lshift(1, b)) ~= 0 then s[b] = (s[b] or 0) + 1 end
            end
          end
          covered = bor(covered, m[j])
        end
      end
    end
    first = last + 1
    if size < 4096 then size = size * 4 end
  end
  if alive ~= 0 then ends[#ends + 1] = {alive, n} end
  for _, e in ipairs(ends) do
    local mask, matched = e[1], e[2]
    if matched > 0 then
      for b = 0, 31 do
        if band(mask, lshift(1, b)) ~= 0 then
          local wid = owner[p * 32 + b]
          local rest = matched
          for j = 2, nm do
            local c = spread[j][b]
            if c then
              out[#out + 1] = wid
              out[#out + 1] = media[j]
              out[#out + 1] = c
              rest = rest - c
            end
          end
          if rest > 0 then
            out[#out + 1] = wid
            out[#out + 1] = media[1]
            out[#out + 1] = rest
          end
        end
      end
    end
  end
end
return out
"""

_WRITE = """local reg, prefix, chunk, budget = KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local band, bor, bxor, bnot, lshift = bit.band, bit.bor, bit.bxor, bit.bnot, bit.lshift
local dying, counts = prefix .. 'd', prefix .. 'n'
local function slot_of(wid, create)
  local s = redis.call('HGET', reg, wid)
  if s then return tonumber(s) end
  if not create then return nil end
  local used = {}
  for _, v in ipairs(redis.call('HVALS', reg)) do used[tonumber(v)] = true end
  for _, v in ipairs(redis.call('HKEYS', dying)) do used[tonumber(v)] = true end
  local slot = 0
  while used[slot] do slot = slot + 1 end
  redis.call('HSET', reg, wid, slot)
  return slot
end
local function names(slot, medium)
  return prefix .. 'h:' .. medium .. '\\n' .. math.floor(slot / 32),
         prefix .. 'l:' .. slot .. '\\n' .. medium,
         prefix .. 'x:' .. slot .. '\\n' .. medium,
         lshift(1, slot % 32),
         slot .. '\\n' .. medium
end
local function write_masks(h, fields, cur)
  local set, del = {}, {}
  for _, f in ipairs(fields) do
    local m = cur[f]
    if m == 0 then del[#del + 1] = f else set[#set + 1] = f; set[#set + 1] = m end
  end
  if #set > 0 then redis.call('HSET', h, unpack(set)) end
  if #del > 0 then redis.call('HDEL', h, unpack(del)) end
end
local function unset(h, b, keys)
  local had = redis.call('HMGET', h, unpack(keys))
  local cur, changed = {}, {}
  for i, f in ipairs(keys) do
    local m = cur[f]
    if m == nil then m = tonumber(had[i]) or 0 end
    if band(m, b) ~= 0 then
      cur[f] = bxor(m, b)
      changed[#changed + 1] = f
    else
      cur[f] = m
    end
  end
  write_masks(h, changed, cur)
  return changed
end
local function compact(h, log, b, count)
  if redis.call('LLEN', log) <= 2 * count + chunk then return end
  local keys = redis.call('LPOP', log, chunk)
  local had = redis.call('HMGET', h, unpack(keys))
  local keep, seen = {}, {}
  for i, f in ipairs(keys) do
    if not seen[f] and band(tonumber(had[i]) or 0, b) ~= 0 then
      seen[f] = true
      keep[#keep + 1] = f
    end
  end
  if #keep > 0 then redis.call('RPUSH', log, unpack(keep)) end
end
local function evict(h, log, extras, b, over)
  local evicted = 0
  local copies = redis.call('EXISTS', extras) == 1
  while evicted < over do
    local keys = redis.call('LPOP', log, math.min(over - evicted, chunk))
    if not keys then break end
    local gone = unset(h, b, keys)
    if #gone > 0 then
      if copies then redis.call('HDEL', extras, unpack(gone)) end
      evicted = evicted + #gone
    end
  end
  return evicted
end
local function store(wid, medium, cap, first, last)
  if last < first then return 0 end
  local slot = slot_of(wid, true)
  redis.call('SADD', prefix .. 'm', medium)
  local h, log, extras, b, field = names(slot, medium)
  local count, added = 0, 0
  for a = first, last, chunk do
    local z = math.min(a + chunk - 1, last)
    local had = redis.call('HMGET', h, unpack(ARGV, a, z))
    local cur, new = {}, {}
    for i = a, z do
      local f = ARGV[i]
      local m = cur[f]
      if m == nil then m = tonumber(had[i - a + 1]) or 0 end
      if band(m, b) == 0 then
        cur[f] = bor(m, b)
        new[#new + 1] = f
      else
        cur[f] = m
        redis.call('HINCRBY', extras, f, 1)
      end
    end
    if #new > 0 then
      redis.call('RPUSH', log, unpack(new))
      write_masks(h, new, cur)
      count = redis.call('HINCRBY', counts, field, #new)
      added = added + #new
    end
  end
  local evicted = 0
  if count > cap then
    evicted = evict(h, log, extras, b, math.min(count - cap, added + budget))
    count = redis.call('HINCRBY', counts, field, -evicted)
  end
  if count > 0 then compact(h, log, b, count) end
  return evicted
end
local function remove(wid, medium, first, last)
  local slot = slot_of(wid, false)
  if slot == nil then return end
  local h, log, extras, b, field = names(slot, medium)
  local count = -1
  for a = first, last, chunk do
    local z = math.min(a + chunk - 1, last)
    local had = redis.call('HMGET', h, unpack(ARGV, a, z))
    local copies = {}
    local extra = redis.call('EXISTS', extras) == 1
    if extra then copies = redis.call('HMGET', extras, unpack(ARGV, a, z)) end
    local cur, gone, left, before = {}, {}, {}, {}
    for i = a, z do
      local f = ARGV[i]
      local c = left[f]
      if extra and c == nil then
        c = tonumber(copies[i - a + 1]) or 0
        before[f] = c
      end
      if c and c > 0 then
        left[f] = c - 1
      else
        if extra then left[f] = 0 end
        local m = cur[f]
        if m == nil then m = tonumber(had[i - a + 1]) or 0 end
        if band(m, b) ~= 0 then
          cur[f] = bxor(m, b)
          gone[#gone + 1] = f
        end
      end
    end
    for f, c in pairs(left) do
      if c ~= before[f] then
        if c > 0 then redis.call('HSET', extras, f, c) else redis.call('HDEL', extras, f) end
      end
    end
    if #gone > 0 then
      write_masks(h, gone, cur)
      count = redis.call('HINCRBY', counts, field, -#gone)
    end
  end
  if count == 0 then
    redis.call('HDEL', counts, field)
    redis.call('UNLINK', log)
  elseif count > 0 then
    compact(h, log, b, count)
  end
end
local function clear(wid)
  local slot = slot_of(wid, false)
  if slot == nil then return end
  redis.call('HDEL', reg, wid)
  redis.call('HSET', dying, slot, 1)
  for _, medium in ipairs(redis.call('SMEMBERS', prefix .. 'm')) do
    local _, _, extras, _, field = names(slot, medium)
    redis.call('UNLINK', extras)
    redis.call('HDEL', counts, field)
  end
end
local function drain()
  local left = budget
  for _, s in ipairs(redis.call('HKEYS', dying)) do
    local slot = tonumber(s)
    local done = true
    for _, medium in ipairs(redis.call('SMEMBERS', prefix .. 'm')) do
      local h, log, _, b = names(slot, medium)
      while left > 0 do
        local keys = redis.call('LPOP', log, math.min(left, chunk))
        if not keys then break end
        left = left - #keys
        unset(h, b, keys)
      end
      if left == 0 and redis.call('EXISTS', log) == 1 then done = false end
    end
    if not done then return redis.call('HLEN', dying) end
    redis.call('HDEL', dying, s)
  end
  return 0
end
local i, evicted = 4, 0
while i <= #ARGV do
  local kind, wid, medium, cap, n = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  local first, last = i + 5, i + 4 + n
  if kind == 's' then evicted = evicted + store(wid, medium, cap, first, last)
  elseif kind == 'r' then remove(wid, medium, first, last)
  else clear(wid) end
  i = last + 1
end
if redis.call('EXISTS', dying) == 0 then return {0, evicted} end
return {drain(), evicted}
"""


def _worker_id(worker: Worker) -> str:
    return json.dumps([worker.backend, worker.dp_rank], separators=(",", ":"))


def _members(keys: Sequence[int]) -> list[bytes]:
    """Each key as the 8 big-endian bytes used as hash fields and set members (one C-level pack, then slices)."""
    packed = struct.pack(f">{len(keys)}Q", *keys)
    return [packed[i : i + 8] for i in range(0, len(packed), 8)]


def _valid_prefix(keys: Sequence[int]) -> bytes:
    """The packed keys before the first that cannot be a key: no worker holds it, so no match goes past it."""
    out = bytearray()
    for k in keys:
        if type(k) is not int or not 0 <= k < 1 << 64:
            break
        out += k.to_bytes(8, "big")
    return bytes(out)


def _medium(medium: str | None) -> str:
    medium = medium or DEFAULT_MEDIUM
    if "\n" in medium:
        raise ValueError(f"medium {medium!r} must not contain a newline")
    return medium


class RedisIndex:
    """:class:`indexer.index.Index` on a Redis (>= 7) or Valkey server at ``url``.

    ``namespace`` prefixes every key, so several fleets (or tests) can share a server.
    Writes, ``block_counts`` and ``memory_bytes`` use a synchronous client (the
    subscriber thread; the two readers are debug/metrics calls); ``lookup`` uses an
    asyncio client bound to the running event loop, made on first use in each loop.
    """

    def __init__(self, url: str, namespace: str = "kvr", caps: KeyCaps | None = None) -> None:
        if "\n" in namespace:
            raise ValueError("namespace must not contain a newline")
        self._url = url
        self._ns = namespace
        self._redis = redis.Redis.from_url(url, socket_timeout=WRITE_TIMEOUT_S, socket_connect_timeout=WRITE_TIMEOUT_S)
        self._write_script = self._redis.register_script(_WRITE)
        self._models_seen: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aredis: aredis.Redis | None = None
        self._lookup_script: object = None
        self._epoch: bytes | None = None
        self.lookup_failures = 0
        """Lookups answered with no hits because Redis did not answer (see :meth:`lookup`)."""
        self._breaker = Breaker()
        """Lookups fail fast while Redis does not answer (:mod:`indexer.breaker`)."""
        self.caps = caps or KeyCaps()
        """Keys per worker and medium (:class:`indexer.index.KeyCaps`; ``kvrouter indexer`` scrapes no
        ``/metrics``, so its caps stay at the default bound)."""

    def _prefix(self, model: str) -> str:
        return f"{self._ns}:{{{model}}}:"

    def _write(self, model: str, worker: Worker, ops: Sequence[tuple[str, str, Sequence[int]]]) -> int:
        """Run ``ops`` of ``worker`` -- (kind ``s``/``r``/``c``, medium, keys) -- in one script call, then
        finish any draining; the number of stored keys the caps dropped (see :class:`KeyCaps`)."""
        if model not in self._models_seen:
            self._redis.sadd(f"{self._ns}:models", model)
            self._models_seen.add(model)
        wid = _worker_id(worker)
        dropped = 0
        args: list[object] = []
        for kind, medium, keys in ops:
            cap = self.caps.cap(worker, medium) if kind == "s" else 0
            if len(keys) > cap > 0:  # a chain's head: its tail alone could never be hit
                dropped += len(keys) - cap
                keys = keys[:cap]
            args += (kind, wid, medium, cap, len(keys))
            args += _members(keys)
        prefix = self._prefix(model)
        draining, evicted = self._write_script(keys=[prefix + "reg"], args=[prefix, _CHUNK, _DRAIN, *args])
        while draining:
            draining, _ = self._write_script(keys=[prefix + "reg"], args=[prefix, _CHUNK, _DRAIN])
        return dropped + evicted

    def apply(self, model: str, worker: Worker, batch: EventBatch) -> int:
        ops = batch_ops(batch)
        if not ops:
            return 0
        return self._write(model, worker, [
            ("c", "", ()) if op.kind == "clear" else ("s" if op.kind == "store" else "r", _medium(op.medium), op.keys)
            for op in ops
        ])

    def store(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        validate_keys(keys)
        self._write(model, worker, [("s", _medium(medium), keys)])

    def remove(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        validate_keys(keys)
        self._write(model, worker, [("r", _medium(medium), keys)])

    def clear(self, model: str, worker: Worker) -> None:
        self._write(model, worker, [("c", "", ())])

    async def lookup(self, model: str, keys: Sequence[int]) -> Hits:
        if not keys:
            return {}
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._aredis is None:
            self._aredis = aredis.Redis.from_url(self._url, socket_timeout=LOOKUP_TIMEOUT_S,
                                                 socket_connect_timeout=LOOKUP_TIMEOUT_S)
            self._lookup_script = self._aredis.register_script(_LOOKUP)
            self._loop = loop
        try:
            blob = struct.pack(f">{len(keys)}Q", *keys)
        except (struct.error, TypeError):
            blob = _valid_prefix(keys)
        prefix = self._prefix(model)
        was = self._breaker.failing_since
        try:
            flat = await self._breaker.guard(lambda: self._lookup_script(keys=[prefix + "reg"], args=[prefix, blob]))  # type: ignore[operator]
        except (Open, redis.RedisError) as e:
            # Redis down, restarting or frozen: route on load alone (every worker misses) rather
            # than fail the request. Counted (kvrouter_index_lookup_failures_total) and logged
            # once per outage; only the breaker's probes pay LOOKUP_TIMEOUT_S.
            if was is None and self._breaker.failing_since is not None:  # this failure opened it
                log.warning("Redis index lookup failed (%s: %s); routing without cache hits until it answers",
                            type(e).__name__, e)
            self.lookup_failures += 1
            LOOKUP_FAILURES.inc()
            return {}
        if was is not None:
            log.warning("Redis index answers again after %.1fs", time.monotonic() - was)
        hits: Hits = {}
        for i in range(0, len(flat), 3):
            backend, rank = json.loads(flat[i])
            hits.setdefault(Worker(backend, rank), {})[flat[i + 1].decode()] = int(flat[i + 2])
        return hits

    def _layout(self, model: str) -> tuple[dict[bytes, int], list[int], list[str]]:
        """``reg`` (worker id -> slot), the draining slots and the media of ``model``."""
        prefix = self._prefix(model)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(prefix + "reg")
        pipe.hkeys(prefix + "d")
        pipe.smembers(prefix + "m")
        reg, dying, media = pipe.execute()
        return {w: int(s) for w, s in reg.items()}, [int(s) for s in dying], sorted(m.decode() for m in media)

    def block_counts(self, model: str) -> dict[Worker, int]:
        prefix = self._prefix(model)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(prefix + "reg")
        pipe.hgetall(prefix + "n")
        reg, counts = pipe.execute()
        per_slot: dict[int, int] = {}
        for field, n in counts.items():
            slot = int(field.split(b"\n", 1)[0])
            per_slot[slot] = per_slot.get(slot, 0) + int(n)
        out: dict[Worker, int] = {}
        for wid, slot in reg.items():
            n = per_slot.get(int(slot), 0)
            if n:
                backend, rank = json.loads(wid)
                out[Worker(backend, rank)] = n
        return out

    def state_lost(self) -> bool:
        """True when the server lost this namespace's data since the last call (a restart without
        persistence, FLUSHALL, a failover to an empty replica): the epoch marker this index (or
        another indexer) set is gone or was replaced. The first call only sets or reads it.

        ``kvrouter indexer`` polls this and then rebuilds every worker from the engines'
        histories: only the streams that happen to write during the outage notice it, the
        others would leave their blocks missing from the index for good."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(f"{self._ns}:epoch", os.urandom(8).hex(), nx=True)
        pipe.get(f"{self._ns}:epoch")
        _, epoch = pipe.execute()
        lost = self._epoch is not None and epoch != self._epoch
        self._epoch = epoch
        if lost:
            self._models_seen.clear()
        return lost

    def worker_keys(self, model: str) -> dict[Worker, set[int]]:
        """Every key each live worker holds, any medium (:meth:`MemoryIndex.worker_keys`'s
        contract): ``HGETALL`` of every mask page, a debug and test aid for small indexes."""
        reg, _, media = self._layout(model)
        workers = {int(slot): Worker(*json.loads(wid)) for wid, slot in reg.items()}
        prefix = self._prefix(model)
        out: dict[Worker, set[int]] = {}
        for medium in media:
            for page in sorted({s // _PAGE for s in workers}):
                for field, raw in self._redis.hgetall(f"{prefix}h:{medium}\n{page}").items():
                    key = struct.unpack(">Q", field)[0]
                    mask = int(raw) & 0xFFFFFFFF
                    for bit in range(_PAGE):
                        worker = workers.get(page * _PAGE + bit)
                        if mask >> bit & 1 and worker is not None:
                            out.setdefault(worker, set()).add(key)
        return out

    def models(self) -> set[str]:
        """The models this namespace holds blocks of (ever written by some indexer)."""
        return {m.decode() for m in self._redis.smembers(f"{self._ns}:models")}

    def memory_bytes(self) -> int:
        """Sum of ``MEMORY USAGE`` (Redis' default 5-sample estimate) over this namespace's keys.

        Found through the registries, not a SCAN; the whole server's figure is
        ``INFO memory`` (``used_memory``), which ``benchmarks/bench_index.py`` reports too.
        """
        models_key = f"{self._ns}:models"
        total = self._redis.memory_usage(models_key) or 0
        for model in self._redis.smembers(models_key):
            prefix = self._prefix(model.decode())
            reg, dying, media = self._layout(model.decode())
            slots = [*reg.values(), *dying]
            names = [prefix + "reg", prefix + "d", prefix + "m", prefix + "n"]
            for medium in media:
                names += (f"{prefix}h:{medium}\n{page}" for page in sorted({s // _PAGE for s in slots}))
                names += (f"{prefix}{kind}:{slot}\n{medium}" for slot in slots for kind in ("l", "x"))
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.memory_usage(name)
            total += sum(n or 0 for n in pipe.execute())
        return total

    def close(self) -> None:
        """Close the synchronous client (the asyncio one is closed by :meth:`aclose`)."""
        self._redis.close()

    async def aclose(self) -> None:
        """Close the asyncio client of the running loop, if one was made."""
        if self._aredis is not None:
            await self._aredis.aclose()
            self._aredis = None
            self._loop = None
