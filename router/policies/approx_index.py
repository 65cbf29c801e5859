"""The router's memory of its own routing decisions: block key -> backends, with a TTL.

Used by ``prefix_approx`` (the only cache signal when engines publish no KV events,
like Dynamo's approximate mode and SGLang's cache_aware tree) and by ``kv_aware`` for
speculative insertion (a burst sharing a new prefix follows the first request before
its real events arrive).

Block keys chain their parent (vLLM's hash of block i covers blocks 0..i), so a flat
dict of keys *is* a prefix tree: a key present means the whole prefix up to it was
sent there. Leading matches are found by walking the request's keys until no
backend continues.

Invariant: entries are kept in expiry order (every insert uses the same TTL and
moves the key to the end), so expiry and the size bound only ever pop from the front.
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
        for k in keys:
            owners = entries.get(k)
            if owners is None:
                entries[k] = {backend: expiry}
            else:
                owners[backend] = expiry
                entries.move_to_end(k)
        self._expire(now)

    def match(self, keys: list[int]) -> dict[str, int]:
        """Leading blocks of ``keys`` each backend was sent within the TTL."""
        now = self._clock()
        counts: dict[str, int] = {}
        entries = self._entries
        for i, k in enumerate(keys):
            owners = entries.get(k)
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
