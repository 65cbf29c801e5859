"""The fleet-state log: what every router process did, in one order, folded alike by all.

Workers and replicas decide alone, yet each must weigh every process's requests, recent
decisions and health, as Dynamo's router replicas share one active-sequence
stream. Each process appends what it did (a record type below) and every :data:`SNAPSHOT_S`
a :class:`Snapshot` of its load, its heartbeat. Records carry load *changes* (a decision its
blocks too, under a ticket that its end names) and a snapshot sets a sender's counters outright:
the fold is exact, a lost record costs one snapshot interval, and a silent sender stops counting.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Union

import msgspec

if TYPE_CHECKING:
    from router.policies.approx_index import ApproxPrefixIndex


Count = Annotated[int, msgspec.Meta(ge=-(1 << 40), le=1 << 40)]  # bounded: a forged record cannot swamp a sum
Load = tuple[Count, Count, Count, Count, Count]  # in_flight, prefill_tokens, decode_seqs, active/context blocks
SNAPSHOT_S = 0.25  # how often a process appends its whole load: the heartbeat that keeps it counted
TTL_S = 1.0  # a sender silent this long (four snapshots missed) stops counting


class Decided(msgspec.Struct, tag=1, array_like=True):
    model: str
    backend: str
    load: Load
    keys: list[int]  # the prompt's block keys: the KV blocks it holds there, and its prefix for the memory
    ticket: int = 0  # the sender's name for the request, which the Changed that ends it gives


class Changed(msgspec.Struct, tag=2, array_like=True):  # a request's first token (prefill to decode) or end
    backend: str
    load: Load
    ended: list[int] = []  # the tickets that ended: the blocks they held stop counting


class Settled(Decided, tag=4): ...  # a deferred request's estimate replaced by its exact keys and prefill


class Snapshot(msgspec.Struct, tag=5, array_like=True):
    loads: dict[str, Load]


class Verdict(msgspec.Struct, tag=6, array_like=True):
    backend: str
    healthy: bool
    refused: bool = False
    timed_out: bool = False  # a check that only timed out: the engine keeps its cache, no worker purges it


class Scraped(msgspec.Struct, tag=7, array_like=True):  # the health leader's scrape (``at`` None: it failed)
    backend: str
    waiting: float | None
    running: float | None
    usage: float | None
    unseen: float
    at: float | None


Record = Union[Decided, Changed, Settled, Snapshot, Verdict, Scraped]

encode = msgspec.msgpack.Encoder().encode
_records = msgspec.msgpack.Decoder(list[Record])
_batch = msgspec.msgpack.Decoder(list[msgspec.Raw])
_record = msgspec.msgpack.Decoder(Record)
_BAD = (msgspec.DecodeError, msgspec.ValidationError)


def decode(data: bytes) -> tuple[list[Record], int] | None:
    """A batch's valid records and how many were not (each stands alone: one malformed record once
    stopped every backend's load from being shared), or None when ``data`` is not a batch."""
    if (whole := _or_none(_records, data)) is not None:
        return whole, 0
    if (raws := _or_none(_batch, data)) is None:
        return None
    records = [r for r in (_or_none(_record, raw) for raw in raws) if r is not None]
    return records, len(raws) - len(records)


def _or_none(decoder: msgspec.msgpack.Decoder[Any], data: bytes | msgspec.Raw) -> Any:
    try:
        return decoder.decode(data)
    except _BAD:
        return None


def _shift(counters: list[int], d: Load | list[int], sign: int = 1) -> None:
    for i in range(5):
        counters[i] += sign * d[i]


def coalesce(records: list[Record]) -> list[Record]:
    """The same fold in fewer records: the :class:`Changed` summed per backend, each sum placed
    before the next snapshot (which holds them) or last: one per backend, not two per request."""
    out: list[Record] = []
    sums: dict[str, Changed] = {}
    for r in records:
        if type(r) is Changed:
            if (c := sums.get(r.backend)) is None:
                c = sums[r.backend] = Changed(r.backend, (0, 0, 0, 0, 0), [])
            c.load = tuple(a + b for a, b in zip(c.load, r.load))  # type: ignore[assignment]
            c.ended += r.ended  # c's own list: one copy per batch, not one per record
            continue
        if type(r) is Snapshot:
            out += sums.values()
            sums = {}
        out.append(r)
    return out + list(sums.values())


@dataclass(slots=True)
class Sender:
    heard: float
    loads: dict[str, list[int]] | None = None  # per backend; None until its first snapshot


class FleetState:
    """The other processes' records, folded: :attr:`remote` load per backend, and each
    model's prefix memory (the same object the policies were built with)."""

    def __init__(self, memories: dict[str, ApproxPrefixIndex], ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.memories = memories
        self.ttl_s = ttl_s
        self._clock = clock
        self.senders: dict[str, Sender] = {}  # the live ones: when each was last heard (``clock``), its load
        self.remote: dict[str, list[int]] = {}  # per backend, summed over the other live senders
        self.follow: dict[type, Callable[[Any], None]] = {}  # other records' readers: follow[Verdict] = ...
        # Where the others' requests' KV blocks are counted (load.FleetBlocks); backend None: it ended.
        self.hold: Callable[[str, int, str | None, list[int]], None] = lambda sender, ticket, backend, keys: None
        self.forget: Callable[[str], None] = lambda sender: None

    def fold(self, sender: str, records: list[Record], age_s: float = 0.0) -> None:
        """Apply ``sender``'s records, in order; ``age_s``: how old they are (a prefix older
        than the memory's TTL is not learned)."""
        s = self.senders.setdefault(sender, Sender(0.0))
        s.heard = self._clock()
        for r in records:
            if isinstance(r, Decided):
                if (memory := self.memories.get(r.model)) is not None and r.keys and age_s < memory.ttl_s:
                    memory.insert(r.keys, r.backend)
                self._add(s, r.backend, r.load)
                self.hold(sender, r.ticket, r.backend, r.keys)
            elif type(r) is Changed:
                self._add(s, r.backend, r.load)
                for t in r.ended:
                    self.hold(sender, t, None, [])
            elif isinstance(r, Snapshot):
                self._set(s, r.loads)
            elif (follow := self.follow.get(type(r))) is not None:
                follow(r)

    def _add(self, s: Sender, backend: str, d: Load) -> None:
        if s.loads is not None:  # else it joined after this change: the next snapshot includes it
            _shift(s.loads.setdefault(backend, [0] * 5), d)
            _shift(self.remote.setdefault(backend, [0] * 5), d)

    def _set(self, s: Sender, loads: dict[str, Load]) -> None:
        self._withdraw(s)
        s.loads = {b: list(v) for b, v in loads.items()}
        for b, v in loads.items():
            _shift(self.remote.setdefault(b, [0] * 5), v)

    def _withdraw(self, s: Sender) -> None:
        for b, v in (s.loads or {}).items():
            _shift(self.remote[b], v, -1)

    def begin(self, sender: str) -> None:
        """``sender``'s records will be folded from its first on: its load counts from
        there, without waiting for a snapshot (a ring read from the worker's start)."""
        s = self.senders.setdefault(sender, Sender(self._clock()))
        if s.loads is None:
            s.loads = {}

    def drop(self, sender: str) -> None:
        """Forget a sender's load now (it restarted, or records of it were lost)."""
        self._withdraw(self.senders.pop(sender, Sender(0.0)))
        self.forget(sender)

    def expire(self) -> int:
        """Drop the senders silent for ``ttl_s``; returns how many."""
        late = self._clock() - self.ttl_s
        gone = [name for name, s in self.senders.items() if s.heard < late]
        for name in gone:
            self.drop(name)
        return len(gone)

