"""The router's memory of its own routing decisions: block key -> backends, with a TTL.

Used by ``prefix_approx`` (the only cache signal when engines publish no KV events,
like Dynamo's approximate mode and SGLang's cache_aware tree) and by ``kv_aware`` for
speculative insertion (a burst sharing a new prefix follows the first request before
its real events arrive).

Block keys chain their parent (vLLM's hash of block i covers blocks 0..i), so a flat
dict of keys *is* a prefix tree: a key present means the whole prefix up to it was
sent there. So a chain need not be stored whole: :meth:`insert` keeps its first key,
every :data:`STRIDE`-th and its last (a 450-block chat history is 30 entries, not 450:
each request re-inserts its history, and this ran on every request's critical path).
:meth:`match` binary-searches a request's keys at those same positions, then looks at
the keys between the last one held and the next (where a shorter chain sent before
may have ended). The answer is exact for a prefix sent before whole, or extended; when
the request leaves a longer chain in the middle of a stride, it is rounded down to the
stride (< 16 blocks short).

Invariants:

- entries are kept in expiry order (every insert uses the same TTL and moves its keys
  to the end), so expiry and the size bound only ever pop from the front;
- a request's keys are inserted tail first, so a chain's head is always at least as
  fresh as its tail: eviction drops tails before heads (as vLLM's free queue does), and
  for any backend "the key at a stored position is held" is true for a prefix of those
  positions, which is what the binary search needs.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


STRIDE = 16


def _positions(n: int) -> list[int]:
    """The positions of an ``n``-key chain that :meth:`ApproxPrefixIndex.insert` stores."""
    out = [0, *range(STRIDE - 1, n - 1, STRIDE)]
    if n > 1:
        out.append(n - 1)
    return out


def stored_keys(keys: list[int]) -> list[int]:
    """The keys of a chain at the positions :meth:`ApproxPrefixIndex.insert` stores (what a
    decision's record carries to the other processes' memories)."""
    return [keys[p] for p in _positions(len(keys))] if keys else []


class ApproxPrefixIndex:
    def __init__(self, ttl_s: float, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, keys: list[int], backend: str) -> None:
        """Remember that ``backend`` was just sent the chain ``keys`` (only its stored positions are kept)."""
        if self.ttl_s <= 0 or not keys:  # a prompt under one block has none (_positions(0) is [0])
            return
        stored = stored_keys(keys)
        now = self._clock()
        expiry = now + self.ttl_s
        entries = self._entries
        for k in reversed(stored):
            owners = entries.get(k)
            if owners is None:
                entries[k] = {backend: expiry}
            else:
                owners[backend] = expiry
                entries.move_to_end(k)
        self._expire(now)

    def match(self, keys: list[int]) -> dict[str, int]:
        """Leading blocks of ``keys`` each backend was sent within the TTL (see the module
        docstring for the rounding)."""
        if not keys:
            return {}
        now = self._clock()
        entries = self._entries
        head = entries.get(keys[0])
        if head is None:
            return {}
        positions = _positions(len(keys))

        def held(p: int, backend: str) -> bool:
            owners = entries.get(keys[p])
            return owners is not None and owners.get(backend, 0.0) > now

        counts: dict[str, int] = {}
        for backend, expiry in head.items():
            if expiry <= now:
                continue
            lo, hi = 0, len(positions) - 1  # positions[:lo + 1] held; positions[hi + 1:] not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if held(positions[mid], backend):
                    lo = mid
                else:
                    hi = mid - 1
            last = positions[lo]
            if lo + 1 < len(positions):
                last = next((p for p in range(positions[lo + 1] - 1, last, -1) if held(p, backend)), last)
            counts[backend] = last + 1
        return counts

    def forget(self, backend: str) -> None:
        """Drop a backend's entries (it restarted or was ejected: its cache is gone)."""
        for k in list(self._entries):
            owners = self._entries[k]
            owners.pop(backend, None)
            if not owners:
                del self._entries[k]

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            k, owners = next(iter(entries.items()))
            if len(entries) > self.max_blocks or max(owners.values()) <= now:
                entries.popitem(last=False)
            else:
                break
