"""The prefix index in Redis, so that several router replicas share one picture of the fleet.

Semantics are :mod:`indexer.index`'s exactly (one test suite runs over both). Layout,
per model, under the prefix ``{ns}:{<model>}:`` (the braces are a cluster hash tag, so
one model's keys share a slot and a lookup script may touch all of them):

* ``reg`` -- a hash whose fields name every (worker, medium) that was written:
  ``<medium>\\n<worker>`` where ``<worker>`` is ``["backend",dp_rank]`` in compact JSON.
* ``s:<field>`` -- one set per (worker, medium): the worker's blocks in that medium,
  each member the key as 8 big-endian bytes.
* ``{ns}:models`` -- the models written, for memory accounting.

Why per-worker sets rather than one hash per block: a lookup asks each worker's set
about a whole chunk of the chain with one ``SMISMEMBER`` (C speed, no per-block command
inside the script), clearing a worker is an ``UNLINK`` of its sets (freed by Redis'
background thread, no SCAN and no per-block work), and ``SCARD`` is the block count.

A lookup is one ``EVALSHA`` round trip: the script reads the registry, then for each
worker walks the chain in growing chunks (16, 32, ... 4096 keys, so a worker that
misses early costs little) and stops at its first miss. The script is read-only
(``flags=no-writes``) so it also runs on replicas. Writes go through one pipeline per
call (``apply``: one per event batch). Needs Redis >= 7.0 (shebang flags) or Valkey;
only core commands are used.
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

_CHUNK = 10_000
"""Members per SADD/SREM command: bounds one command's size on the wire and in Redis."""

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

_CLEAR = """
local prefix = ARGV[1]
local suffix = '\\n' .. ARGV[2]
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(f, -#suffix) == suffix then
    redis.call('UNLINK', prefix .. 's:' .. f)
    redis.call('HDEL', KEYS[1], f)
  end
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
        self._clear_script = self._redis.register_script(_CLEAR)
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

    def _queue_store(self, pipe: redis.client.Pipeline, model: str, worker: Worker, keys: Sequence[int], medium: str | None) -> None:
        if model not in self._models_seen:
            pipe.sadd(f"{self._ns}:models", model)
            self._models_seen.add(model)
        if not keys:
            return
        prefix, field = self._prefix(model), self._field(worker, medium)
        pipe.hset(prefix + "reg", field, 1)
        members = _members(keys)
        for i in range(0, len(members), _CHUNK):
            pipe.sadd(prefix + "s:" + field, *members[i : i + _CHUNK])

    def _queue_remove(self, pipe: redis.client.Pipeline, model: str, worker: Worker, keys: Sequence[int], medium: str | None) -> None:
        if not keys:
            return
        setkey = self._prefix(model) + "s:" + self._field(worker, medium)
        members = _members(keys)
        for i in range(0, len(members), _CHUNK):
            pipe.srem(setkey, *members[i : i + _CHUNK])

    def _queue_clear(self, pipe: redis.client.Pipeline, model: str, worker: Worker) -> None:
        prefix = self._prefix(model)
        self._clear_script(keys=[prefix + "reg"], args=[prefix, _worker_id(worker)], client=pipe)

    def apply(self, model: str, worker: Worker, batch: EventBatch) -> None:
        ops = batch_ops(batch)
        if not ops:
            return
        pipe = self._redis.pipeline(transaction=False)
        for op in ops:
            if op.kind == "store":
                self._queue_store(pipe, model, worker, op.keys, op.medium)
            elif op.kind == "remove":
                self._queue_remove(pipe, model, worker, op.keys, op.medium)
            else:
                self._queue_clear(pipe, model, worker)
        pipe.execute()

    def store(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        validate_keys(keys)
        pipe = self._redis.pipeline(transaction=False)
        self._queue_store(pipe, model, worker, keys, medium)
        pipe.execute()

    def remove(self, model: str, worker: Worker, keys: Sequence[int], medium: str | None = DEFAULT_MEDIUM) -> None:
        validate_keys(keys)
        pipe = self._redis.pipeline(transaction=False)
        self._queue_remove(pipe, model, worker, keys, medium)
        pipe.execute()

    def clear(self, model: str, worker: Worker) -> None:
        prefix = self._prefix(model)
        self._clear_script(keys=[prefix + "reg"], args=[prefix, _worker_id(worker)])

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
