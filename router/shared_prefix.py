"""The policies' memory of where prefixes were just sent, shared by the workers of one host.

kv_aware sends a burst that shares a new prefix after its first request
(:class:`router.policies.approx_index.ApproxPrefixIndex`: "speculative insertion",
before the engine's KV events can say the blocks are there), and prefix_approx routes on
nothing else. Each worker of ``serve --workers N`` has its own memory, so without sharing
a burst spread over N workers by the kernel is split over up to N backends, each worker
sending its share to wherever it chose first (measured in docs/scaling.md, "Workers";
with load shared but memory not, the split is certain: the other workers see the first
backend busy and pick another).

:class:`SharedPrefixIndex` is the policy's memory with replication: every insert is also
appended to this worker's *decision ring* in the shared segment (the chain's keys at the
positions the index stores, and the backend's slot), and before every read the worker
replays the records the other workers appended since it last looked. The matching stays
the local index's own code, unchanged; sharing only adds the other workers' inserts, a
few microseconds behind.

A ring has one writer, so no lock: the writer stores a record's words, then advances its
cursor; a reader replays up to the cursor it read. A reader that fell a whole ring behind
(a worker stalled for ~10,000 requests of the others) skips to the cursor: these are
hints, and the engines' KV events soon say where the blocks really are.

Across hosts (router replicas on one Redis) the same inserts go out through
:mod:`router.replica_decisions` instead: :attr:`SharedPrefixIndex.publish` hands each
insert's stored keys to it, and it replays the other replicas' with
:meth:`ApproxPrefixIndex.insert_stored`. A lone router on Redis has no segment
(``segment=None``) and shares through Redis only.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable

from router.policies.approx_index import STRIDE, ApproxPrefixIndex
from router.shared_state import RING_WORDS, Segment

_SLOT_MASK = (1 << 32) - 1


def stored_keys(keys: list[int]) -> list[int]:
    """The keys of a chain at the positions :meth:`ApproxPrefixIndex.insert` stores."""
    n = len(keys)
    out = [keys[0], *keys[STRIDE - 1:n - 1:STRIDE]]
    if n > 1:
        out.append(keys[n - 1])
    return out


class SharedPrefixIndex(ApproxPrefixIndex):
    """An :class:`ApproxPrefixIndex` whose inserts every worker of the host (through
    ``segment``) and every other replica (through :attr:`publish`) sees."""

    def __init__(self, ttl_s: float, max_blocks: int, segment: Segment | None = None, worker: int = 0,
                 slot_of: Callable[[str], int] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ttl_s, max_blocks, clock)
        self.segment = segment
        self.worker = worker
        self._slot_of = slot_of
        self._names: dict[int, str] = {}
        self._slots: dict[str, int] = {}
        self._read = [] if segment is None else [segment.uwords[segment.ring(w)] for w in range(segment.n_workers)]
        """Per worker, how many words of its ring this worker has replayed."""
        self.publish: Callable[[list[int], str], None] | None = None
        """Hands each insert's stored keys and backend to the other replicas (set by
        :class:`router.replica_decisions.ReplicaDecisions`)."""

    def insert(self, keys: list[int], backend: str) -> None:
        super().insert(keys, backend)
        if self.ttl_s > 0 and keys:
            stored = stored_keys(keys)
            if self.segment is not None:
                self._append(stored, backend)
            if self.publish is not None:
                self.publish(stored, backend)

    def match(self, keys: list[int]) -> dict[str, int]:
        self.catch_up()
        return super().match(keys)

    def __len__(self) -> int:
        self.catch_up()
        return super().__len__()

    def _append(self, stored: list[int], backend: str) -> None:
        assert self.segment is not None and self._slot_of is not None
        slot = self._slots.get(backend)
        if slot is None:
            slot = self._slots[backend] = self._slot_of(backend)
            self._names[slot] = backend
        u = self.segment.uwords
        base = self.segment.ring(self.worker)
        cursor = u[base]
        n = len(stored)
        at = cursor % RING_WORDS
        if at + n + 1 <= RING_WORDS:
            u[base + 1 + at:base + 2 + at + n] = array("Q", [(n << 32) | slot, *stored])
        else:
            u[base + 1 + at] = (n << 32) | slot
            for j, k in enumerate(stored, 1):
                u[base + 1 + (cursor + j) % RING_WORDS] = k
        u[base] = cursor + n + 1

    def catch_up(self) -> None:
        """Replay what the other workers inserted since this worker last looked."""
        seg = self.segment
        if seg is None:
            return
        u = seg.uwords
        for w in range(seg.n_workers):
            if w == self.worker:
                continue
            base = seg.ring(w)
            end = u[base]
            pos = self._read[w]
            if end == pos:
                continue
            if end < pos or end - pos > RING_WORDS:
                pos = end  # the worker restarted (its cursor began again), or this one fell a ring behind
            while pos < end:
                header = u[base + 1 + pos % RING_WORDS]
                n, slot = header >> 32, header & _SLOT_MASK
                stored = [u[base + 1 + (pos + j) % RING_WORDS] for j in range(1, n + 1)]
                pos += n + 1
                name = self._names.get(slot)
                if name is not None and stored:
                    self.insert_stored(stored, name)
            self._read[w] = end

    def learn(self, names: list[str]) -> None:
        """The backends this worker may see in the rings (its config's, again after a reload)."""
        if self._slot_of is None:
            return
        self._slots = {n: self._slot_of(n) for n in names}
        self._names = {slot: n for n, slot in self._slots.items()}
