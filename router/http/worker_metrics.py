"""``serve --workers N``: each worker counts in its own memory, and any worker's ``/metrics``
shows every worker's series merged.

Why not prometheus-client's multiprocess mode: there every ``inc`` and ``observe`` takes a
lock, calls ``os.getpid()`` and packs the value into an mmap'd file, 2.2 us an increment
against 0.65 in one process, and batching those writes meant replacing the library's value
class at import. Here a worker's metrics are ordinary in-process metrics, and a
:class:`WorkerSeries` thread writes a snapshot of them now and then into the directory the
supervisor gives every worker:

- ``<id>.snap``: the worker's latest :class:`Snapshot` (msgpack), written under another
  name and renamed, so a reader never sees half of one. ``<id>`` is unique per process
  (a reused pid cannot overwrite a dead worker's counts).
- ``<id>.lock``: locked (``flock``) by the worker while it lives. The kernel drops the lock
  when the process dies, however it dies, so a reader tells a dead worker's snapshot from
  a live one's without the supervisor's help.
- ``scrape``: 8 bytes, the time (``CLOCK_MONOTONIC``, one clock for the host) a scrape
  asked for fresh snapshots.

Invariants:

- A scrape shows what every live worker counted before it began: it writes its time to
  ``scrape``, each live worker notices within :data:`POLL_S` and writes a snapshot taken
  after that time, and the scrape waits for those; a worker that does not answer within
  :data:`WAIT_S` (stopped with SIGSTOP) is shown as its last snapshot.
- A dead worker's counters and histograms stay in the sum at its last snapshot: a worker
  writes one every :data:`SNAPSHOT_S` and at exit, so one killed with SIGKILL loses at most
  its last :data:`SNAPSHOT_S` of counts.
- Gauges are the live workers' only, merged as ``gauge_merge`` says per family (summed,
  or the largest); any other gauge is shown per worker with a ``pid`` label.
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import mmap
import operator
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec
from prometheus_client.core import Metric

POLL_S = 0.01
"""How often a worker looks for a scrape's request."""
SNAPSHOT_S = 1.0
"""How often a worker writes a snapshot unasked: what a SIGKILL can lose. A snapshot costs
about 1-2 ms of the worker's CPU with a short run's ~140 samples (prometheus-client's own
``collect`` is nearly all of it), so ~0.1-0.2% of a core at this period."""
WAIT_S = 1.0
"""How long a scrape waits for a live worker's fresh snapshot."""

GaugeMerge = Callable[[float, float], float]


class Family(msgspec.Struct, array_like=True):
    name: str
    type: str
    documentation: str
    samples: list[tuple[str, dict[str, str], float]]


class Snapshot(msgspec.Struct, array_like=True):
    pid: int
    taken_ns: int
    """``time.monotonic_ns()`` before the series were read."""
    families: list[Family]


def take(series: Iterable[Metric]) -> Snapshot:
    """A snapshot of ``series``, without ``_created`` samples (per-process times that do
    not add up)."""
    taken = time.monotonic_ns()
    families = [
        Family(m.name, m.type, m.documentation, [(s.name, s.labels, s.value) for s in m.samples
                                                 if not s.name.endswith("_created")])
        for m in series
    ]
    return Snapshot(os.getpid(), taken, families)


def merge(snapshots: Iterable[tuple[Snapshot, bool]], gauge_merge: dict[str, GaugeMerge]) -> Iterator[Metric]:
    """Every family of ``snapshots`` (each with whether its worker lives) as one series set:
    counters and histograms summed over all workers, gauges over the live ones only (see
    the module docstring)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for snap, alive in snapshots:
        for f in snap.families:
            gauge = f.type == "gauge"
            if gauge and not alive:
                continue
            if f.name not in families:
                families[f.name] = Metric(f.name, f.documentation, f.type)
                values[f.name] = {}
            acc = values[f.name]
            combine = gauge_merge.get(f.name) if gauge else operator.add
            for name, labels, value in f.samples:
                if combine is None:
                    labels = {**labels, "pid": str(snap.pid)}
                key = (name, tuple(labels.items()))
                acc[key] = value if key not in acc or combine is None else combine(acc[key], value)
    for name, metric in families.items():
        for (sample, labels), value in values[name].items():
            metric.add_sample(sample, dict(labels), value)
        yield metric


class WorkerSeries:
    """This worker's side of the directory: it publishes its own snapshots (a daemon
    thread, and at exit) and merges everyone's for its ``/metrics``."""

    def __init__(self, directory: Path, series: Callable[[], Iterable[Metric]], gauge_merge: dict[str, GaugeMerge]) -> None:
        self.directory = directory
        self.series = series
        self.gauge_merge = gauge_merge
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock_file = open(directory / f"{self.id}.lock", "wb")  # noqa: SIM115 (held for the process's life)
        fcntl.flock(self._lock_file, fcntl.LOCK_EX)
        fd = os.open(directory / "scrape", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 8:
                os.ftruncate(fd, 8)
            self._scrape = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self._writing = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-snapshots", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def publish(self) -> None:
        """Write a snapshot of this worker's series now."""
        with self._writing:
            data = _ENCODER.encode(take(self.series()))
            tmp = self.directory / f"{self.id}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.directory / f"{self.id}.snap")

    def close(self) -> None:
        """Stop the thread and write the last snapshot (at exit: nothing counted is lost)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.publish()
        self._lock_file.close()

    async def merged(self) -> Iterator[Metric]:
        """Every worker's series merged, the others' taken after this call began (or their
        last, past :data:`WAIT_S`); this worker's own read live."""
        asked = time.monotonic_ns()
        struct.pack_into("q", self._scrape, 0, asked)
        deadline = asked + int(WAIT_S * 1e9)
        while True:
            others = self._others()
            fresh = all(snap is not None and snap.taken_ns >= asked for snap, alive in others if alive)
            if fresh or time.monotonic_ns() >= deadline:
                break
            await asyncio.sleep(POLL_S / 2)
        return merge([(take(self.series()), True), *((s, alive) for s, alive in others if s is not None)], self.gauge_merge)

    def _others(self) -> list[tuple[Snapshot | None, bool]]:
        """Every other worker's latest snapshot (None: none yet) and whether it lives."""
        found: list[tuple[Snapshot | None, bool]] = []
        for lock in self.directory.glob("*.lock"):
            if lock.stem == self.id:
                continue
            try:
                snap: Snapshot | None = _DECODER.decode(lock.with_suffix(".snap").read_bytes())
            except FileNotFoundError:
                snap = None
            found.append((snap, _alive(lock)))
        return found

    def _run(self) -> None:
        seen = self._asked()
        due = time.monotonic() + SNAPSHOT_S
        while not self._stop.wait(POLL_S):
            asked = self._asked()
            if asked != seen or time.monotonic() >= due:
                seen = asked
                self.publish()
                due = time.monotonic() + SNAPSHOT_S

    def _asked(self) -> int:
        return struct.unpack_from("q", self._scrape, 0)[0]


def _alive(lock: Path) -> bool:
    """Whether the worker that holds ``lock`` lives (it holds it until it dies)."""
    try:
        with open(lock, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except FileNotFoundError:
        return False
    return False


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Snapshot)
