"""The prefix index in Redis, so that several router replicas share one picture of the fleet.

Semantics are :mod:`indexer.index`'s exactly (one test suite runs over both). Layout,
per model, under the prefix ``{ns}:{<model>}:`` (the braces are a cluster hash tag, so
one model's keys share a slot and a lookup script may touch all of them):

* ``reg`` -- a hash whose fields name every (worker, medium) that was written:
  ``<medium>\\n<worker>`` where ``<worker>`` is ``["backend",dp_rank]`` in compact JSON.
* ``s:<field>`` -- one set per (worker, medium): the worker's blocks in that medium,
  each member the key as 8 big-endian bytes.
* ``x:<field>`` -- a hash per (worker, medium), present only while the worker holds
  some key in more than one block: member -> copies beyond the first (always > 0,
  only for members of ``s:<field>``). Lookups never read it; a remove decrements it
  before taking the member out of the set.
* ``{ns}:models`` -- the models written, for memory accounting.

Why per-worker sets rather than one hash per block: a lookup asks each worker's set
about a whole chunk of the chain with one ``SMISMEMBER`` (C speed, no per-block command
inside the script), clearing a worker is an ``UNLINK`` of its sets (freed by Redis'
background thread, no SCAN and no per-block work), and ``SCARD`` is the block count.
Duplicates are rare, hence a side hash of extra copies rather than a count per member:
the set stays what lookups read, and a remove of a (worker, medium) without a hash of
extras is a plain ``SREM``.

A lookup is one ``EVALSHA`` round trip: the script reads the registry, then for each
worker walks the chain in growing chunks (16, 32, ... 4096 keys, so a worker that
misses early costs little) and stops at its first miss. The script is read-only
(``flags=no-writes``) so it also runs on replicas. Needs Redis >= 7.0 (shebang flags) or Valkey;
only core commands are used.

Every write call (``apply``: one event batch; ``store``, ``remove``, ``clear``) is one
``EVALSHA`` of :data:`_WRITE`, which must see a set before and after ``SADD`` to know
which members were already held; a script also keeps a batch atomic, and a missing
script (server restart) costs one reload with nothing half-applied. The model's name
goes into ``{ns}:models`` (a different cluster slot) by a separate command, once per
model per process.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence

import redis
import redis.asyncio as aredis

from indexer.events import EventBatch
from indexer.index import DEFAULT_MEDIUM, Hits, Worker, batch_ops, validate_keys

__all__ = ["RedisIndex"]

_CHUNK = 4096
"""Members per set command inside the write script: Lua's ``unpack`` is bounded (8000 in Redis' Lua)."""

_LOOKUP = """#!lua flags=no-writes
local prefix = ARGV[1]
local blob = ARGV[2]
local n = #blob / 8
if n == 0 then return {} end
local function rank(m)
  if m == 'GPU' then return '0' elseif m == 'CPU' then return '1' end
  return '2' .. m
end
local workers, order = {}, {}
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  local medium, wid = string.match(f, '^([^\\n]*)\\n(.*)$')
  local w = workers[wid]
  if not w then
    w = {}
    workers[wid] = w
    order[#order + 1] = wid
  end
  w[#w + 1] = {rank(medium), medium, prefix .. 's:' .. f}
end
local chunks = {}
local function chunk(first, last)
  local c = chunks[first]
  if not c then
    c = {}
    for i = first, last do c[#c + 1] = string.sub(blob, i * 8 - 7, i * 8) end
    chunks[first] = c
  end
  return c
end
local out = {}
for _, wid in ipairs(order) do
  local media = workers[wid]
  table.sort(media, function(a, b) return a[1] < b[1] end)
  local counts = {}
  for j = 1, #media do counts[j] = 0 end
  local first, size, done = 1, 16, false
  while first <= n and not done do
    local last = math.min(first + size - 1, n)
    local members = chunk(first, last)
    local held = {}
    for j = 1, #media do
      held[j] = redis.call('SMISMEMBER', media[j][3], unpack(members))
    end
    if #media == 1 then
      local h, c = held[1], 0
      for i = 1, last - first + 1 do
        if h[i] == 0 then done = true break end
        c = c + 1
      end
      counts[1] = counts[1] + c
    else
      for i = 1, last - first + 1 do
        local best = 0
        for j = 1, #media do
          if held[j][i] == 1 then best = j break end
        end
        if best == 0 then done = true break end
        counts[best] = counts[best] + 1
      end
    end
    first = last + 1
    if size < 4096 then size = size * 2 end
  end
  for j = 1, #media do
    if counts[j] > 0 then
      out[#out + 1] = wid
      out[#out + 1] = media[j][2]
      out[#out + 1] = counts[j]
    end
  end
end
return out
"""

_WRITE = """
local reg, prefix, chunk = KEYS[1], ARGV[1], tonumber(ARGV[2])
local function store(field, first, last)
  if last < first then return end
  redis.call('HSET', reg, field, 1)
  local set, extras = prefix .. 's:' .. field, prefix .. 'x:' .. field
  for a = first, last, chunk do
    local b = math.min(a + chunk - 1, last)
    local held = redis.call('SMISMEMBER', set, unpack(ARGV, a, b))
    if redis.call('SADD', set, unpack(ARGV, a, b)) < b - a + 1 then
      local seen = {}
      for i = a, b do
        local m = ARGV[i]
        if held[i - a + 1] == 1 or seen[m] then
          redis.call('HINCRBY', extras, m, 1)
        else
          seen[m] = true
        end
      end
    end
  end
end
local function remove(field, first, last)
  local set, extras = prefix .. 's:' .. field, prefix .. 'x:' .. field
  for a = first, last, chunk do
    local b = math.min(a + chunk - 1, last)
    if redis.call('EXISTS', extras) == 0 then
      redis.call('SREM', set, unpack(ARGV, a, b))
    else
      local had = redis.call('HMGET', extras, unpack(ARGV, a, b))
      local left, before, gone = {}, {}, {}
      for i = a, b do
        local m = ARGV[i]
        local c = left[m]
        if c == nil then
          c = tonumber(had[i - a + 1]) or 0
          before[m] = c
        end
        if c > 0 then
          left[m] = c - 1
        else
          left[m] = 0
          gone[#gone + 1] = m
        end
      end
      for m, c in pairs(left) do
        if c ~= before[m] then
          if c > 0 then redis.call('HSET', extras, m, c) else redis.call('HDEL', extras, m) end
        end
      end
      if #gone > 0 then redis.call('SREM', set, unpack(gone)) end
    end
  end
end
local function clear(wid)
  local suffix = '\\n' .. wid
  for _, f in ipairs(redis.call('HKEYS', reg)) do
    if string.sub(f, -#suffix) == suffix then
      redis.call('UNLINK', prefix .. 's:' .. f, prefix .. 'x:' .. f)
      redis.call('HDEL', reg, f)
    end
  end
end
local i = 3
while i <= #ARGV do
  local kind, name, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local first, last = i + 3, i + 2 + n
  if kind == 's' then store(name, first, last)
  elseif kind == 'r' then remove(name, first, last)
  else clear(name) end
  i = last + 1
end
return 0
"""


def _worker_id(worker: Worker) -> str:
    return json.dumps([worker.backend, worker.dp_rank], separators=(",", ":"))


def _members(keys: Sequence[int]) -> list[bytes]:
    """Each key as the 8 big-endian bytes stored in the sets (one C-level pack, then slices)."""
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


class RedisIndex:
    """:class:`indexer.index.Index` on a Redis (>= 7) or Valkey server at ``url``.

    ``namespace`` prefixes every key, so several fleets (or tests) can share a server.
    Writes, ``block_counts`` and ``memory_bytes`` use a synchronous client (the
    subscriber thread; the two readers are debug/metrics calls); ``lookup`` uses an
    asyncio client bound to the running event loop, made on first use in each loop.
    """

    def __init__(self, url: str, namespace: str = "kvr") -> None:
        if "\n" in namespace:
            raise ValueError("namespace must not contain a newline")
        self._url = url
        self._ns = namespace
        self._redis = redis.Redis.from_url(url)
        self._write_script = self._redis.register_script(_WRITE)
        self._models_seen: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aredis: aredis.Redis | None = None
        self._lookup_script: object = None

    def _prefix(self, model: str) -> str:
        return f"{self._ns}:{{{model}}}:"

    def _field(self, worker: Worker, medium: str | None) -> str:
        medium = medium or DEFAULT_MEDIUM
        if "\n" in medium:
            raise ValueError(f"medium {medium!r} must not contain a newline")
        return f"{medium}\n{_worker_id(worker)}"

    def _write(self, model: str, ops: Sequence[tuple[str, str, Sequence[int]]]) -> None:
        """Run ``ops`` -- (kind ``s``/``r``/``c``, field or worker id, keys) -- in one script call."""
        if model not in self._models_seen:
            self._redis.sadd(f"{self._ns}:models", model)
            self._models_seen.add(model)
        args: list[object] = []
        for kind, name, keys in ops:
            args += (kind, name, len(keys))
            args += _members(keys)
        if args:
            prefix = self._prefix(model)
            self._write_script(keys=[prefix + "reg"], args=[prefix, _CHUNK, *args])

    def apply(self, model: str, worker: Worker, batch: EventBatch) -> None:
        ops = batch_ops(batch)
        if not ops:
            return
        self._write(model, [
            ("c", _worker_id(worker), ()) if op.kind == "clear"
            else ("s" if op.kind == "store" else "r", self._field(worker, op.medium), op.keys)
            for op in ops
        ])

    def store(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        validate_keys(keys)
        self._write(model, [("s", self._field(worker, medium), keys)])

    def remove(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        validate_keys(keys)
        self._write(model, [("r", self._field(worker, medium), keys)])

    def clear(self, model: str, worker: Worker) -> None:
        self._write(model, [("c", _worker_id(worker), ())])

    async def lookup(self, model: str, keys: Sequence[int]) -> Hits:
        if not keys:
            return {}
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._aredis is None:
            self._aredis = aredis.Redis.from_url(self._url)
            self._lookup_script = self._aredis.register_script(_LOOKUP)
            self._loop = loop
        try:
            blob = struct.pack(f">{len(keys)}Q", *keys)
        except (struct.error, TypeError):
            blob = _valid_prefix(keys)
        prefix = self._prefix(model)
        flat = await self._lookup_script(keys=[prefix + "reg"], args=[prefix, blob])  # type: ignore[operator]
        hits: Hits = {}
        for i in range(0, len(flat), 3):
            backend, rank = json.loads(flat[i])
            hits.setdefault(Worker(backend, rank), {})[flat[i + 1].decode()] = int(flat[i + 2])
        return hits

    def block_counts(self, model: str) -> dict[Worker, int]:
        prefix = self._prefix(model)
        fields = self._redis.hkeys(prefix + "reg")
        pipe = self._redis.pipeline(transaction=False)
        for f in fields:
            pipe.scard(prefix.encode() + b"s:" + f)
        out: dict[Worker, int] = {}
        for f, n in zip(fields, pipe.execute()):
            if n:
                backend, rank = json.loads(f.split(b"\n", 1)[1])
                w = Worker(backend, rank)
                out[w] = out.get(w, 0) + n
        return out

    def memory_bytes(self) -> int:
        """Sum of ``MEMORY USAGE`` (Redis' default 5-sample estimate) over this namespace's keys.

        Found through the registries, not a SCAN; the whole server's figure is
        ``INFO memory`` (``used_memory``), which ``benchmarks/bench_index.py`` reports too.
        """
        models_key = f"{self._ns}:models"
        total = self._redis.memory_usage(models_key) or 0
        for model in self._redis.smembers(models_key):
            prefix = self._prefix(model.decode())
            fields = self._redis.hkeys(prefix + "reg")
            pipe = self._redis.pipeline(transaction=False)
            pipe.memory_usage(prefix + "reg")
            for f in fields:
                pipe.memory_usage(prefix.encode() + b"s:" + f)
                pipe.memory_usage(prefix.encode() + b"x:" + f)
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
