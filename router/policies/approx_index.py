"""The router's memory of its own routing decisions: block key -> backends, with a TTL.

Used by ``prefix_approx`` (the only cache signal when engines publish no KV events,
like Dynamo's approximate mode and SGLang's cache_aware tree) and by ``kv_aware`` for
speculative insertion (a burst sharing a new prefix follows the first request before
its real events arrive).

Block keys chain their parent (vLLM's hash of block i covers blocks 0..i), so a flat
dict of keys *is* a prefix tree: a key present means the whole prefix up to it was
sent there. Leading matches are found by walking the request's keys until no
backend continues.

Invariants:

- entries are kept in expiry order (every insert uses the same TTL and moves its keys
  to the end), so expiry and the size bound only ever pop from the front;
- a request's keys are inserted tail first, so a chain's head is always at least as
  fresh as its tail: eviction drops tails before heads (as vLLM's free queue does), and
  for any backend "key i is held" is true for a prefix of the request's keys. ``match``
  therefore binary-searches each backend's run length instead of walking every key.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class ApproxPrefixIndex:
    def __init__(self, ttl_s: float, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, keys: list[int], backend: str) -> None:
        if self.ttl_s <= 0 or not keys:
            return
        now = self._clock()
        expiry = now + self.ttl_s
        entries = self._entries
        for k in reversed(keys):
            owners = entries.get(k)
            if owners is None:
                entries[k] = {backend: expiry}
            else:
                owners[backend] = expiry
                entries.move_to_end(k)
        self._expire(now)

    def match(self, keys: list[int]) -> dict[str, int]:
        """Leading blocks of ``keys`` each backend was sent within the TTL."""
        if not keys:
            return {}
        now = self._clock()
        entries = self._entries
        head = entries.get(keys[0])
        if head is None:
            return {}
        counts: dict[str, int] = {}
        for backend, expiry in head.items():
            if expiry <= now:
                continue
            lo, hi = 1, len(keys)  # keys[:lo] held; keys[hi:] not known to be held
            while lo < hi:
                mid = (lo + hi + 1) // 2
                owners = entries.get(keys[mid - 1])
                if owners is not None and owners.get(backend, 0.0) > now:
                    lo = mid
                else:
                    hi = mid - 1
            counts[backend] = lo
        return counts

    def match_reference(self, keys: list[int]) -> dict[str, int]:
        """:meth:`match` by walking every key (the tests compare the two)."""
        now = self._clock()
        counts: dict[str, int] = {}
        for i, k in enumerate(keys):
            owners = self._entries.get(k)
            if owners is None:
                break
            advanced = False
            for backend, expiry in owners.items():
                if expiry > now and counts.get(backend, 0) == i:
                    counts[backend] = i + 1
                    advanced = True
            if not advanced:
                break
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
