"""State the worker processes of one ``kvrouter serve --workers N`` share: load and health.

One memory-mapped file (in the supervisor's run directory, on ``/dev/shm`` when there is
one) holds flat 64-bit integers:

- a header (magic, layout version, worker count, slot count, worker restarts);
- a *slot table*: one 64-bit hash per backend name. A backend keeps its slot for the life
  of the supervisor, so a config reload that adds or removes backends never moves another
  backend's numbers. Slots are claimed under an ``flock`` on the file (start and reload
  only, never per request);
- per slot, the *health verdict* (state, version, ejections, whether the connection was
  refused) and the engine's scraped queue gauges, both from the leader (worker 0);
- per worker and slot, a *load row*: ``in_flight, prefill_tokens, decode_seqs,
  active_blocks, context_blocks``, written by that worker only;
- per worker, a *decision ring*: the prefixes it sent where (written by that worker,
  read by the others: :mod:`router.shared_prefix`).

Why no lock on the hot path: every row has exactly one writer (its worker), each field is
one aligned 8-byte store (atomic on the platforms we run on), and readers only sum. A
reader can see a worker's row half-way through an update (``in_flight`` already raised,
``prefill_tokens`` not yet): a few hundred nanoseconds of an estimate that is approximate
anyway, never a drift, because the next store writes the worker's exact counters again.

Why an mmap'd file and not :class:`multiprocessing.shared_memory.SharedMemory`: on Python
3.11 every process that attaches a ``SharedMemory`` registers it with its resource
tracker, which unlinks the segment when that process exits, so the first worker to die
would take the segment from all the others. A file in the run directory has one owner
(the supervisor removes the directory) and the same page-cache speed.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from hashlib import blake2b
from pathlib import Path

import numpy as np

MAGIC = 0x6B76727368617265  # "kvrshare"
LAYOUT = 3
HEADER_WORDS = 16
H_MAGIC, H_LAYOUT, H_WORKERS, H_SLOTS, H_RESTARTS = range(5)
MAX_BACKENDS = 512
"""Slots: backends ever configured over the supervisor's life (reloads included)."""
HEALTH_WORDS = 9
V_STATE, V_VERSION, V_EJECTIONS, V_REFUSED, V_WAITING, V_RUNNING, V_USAGE, V_UNSEEN, V_SCRAPED_MS = range(HEALTH_WORDS)
"""Per slot: the health verdict, then the leader's last scrape of the engine's gauges
(fixed point: waiting, running and the requests beyond the router's own count in
thousandths, KV usage in millionths; -1 when the scrape had no value; the time in ms, 0
when the last scrape failed)."""
_NONE = -1
ROW_WORDS = 8
"""A load row is 5 counters and the sent count (:data:`SENT_WORD`) padded to 64 bytes, one cache line."""
LOAD_FIELDS = ("in_flight", "prefill_tokens", "decode_seqs", "active_blocks", "context_blocks")
SENT_WORD = len(LOAD_FIELDS)
"""The row's requests sent to the backend since the worker started (never decreasing): the
other workers' policies count them in their request share
(:meth:`router.load.LoadTracker.sent_by_other_workers`)."""
WORKER_WORDS = 4
W_PID, W_STARTED_NS, W_LEADER_BEAT_NS = range(3)
RING_WORDS = 1 << 16
"""Words of each worker's decision ring (512 KiB): ~10,000 requests of ~6 stored keys,
far more than any worker sends within a reader's lag."""

UNKNOWN, HEALTHY, EJECTED = 0, 1, 2


def name_hash(name: str) -> int:
    """A backend name as a nonzero signed 64-bit slot key."""
    h = int.from_bytes(blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)
    return h or 1


class Segment:
    """The shared file, mapped. ``create`` (the supervisor) sizes and zeroes it; ``attach``
    (a worker) maps what exists."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.words = memoryview(mm).cast("q")
        self.uwords = memoryview(mm).cast("Q")
        """The same words unsigned: the decision rings hold unsigned 64-bit block keys."""
        if self.words[H_MAGIC] != MAGIC or self.words[H_LAYOUT] != LAYOUT:
            raise ValueError(f"{path} is not a kvrouter shared segment of layout {LAYOUT}")
        self.n_workers = self.words[H_WORKERS]
        self.n_slots = self.words[H_SLOTS]
        self._slots0 = HEADER_WORDS
        self._health0 = self._slots0 + self.n_slots
        self._workers0 = self._health0 + self.n_slots * HEALTH_WORDS
        self._rows0 = self._workers0 + self.n_workers * WORKER_WORDS
        self._rings0 = self._rows0 + self.n_workers * self.n_slots * ROW_WORDS

    @staticmethod
    def size_words(n_workers: int, n_slots: int) -> int:
        return (HEADER_WORDS + n_slots + n_slots * HEALTH_WORDS + n_workers * WORKER_WORDS + n_workers * n_slots * ROW_WORDS
                + n_workers * (1 + RING_WORDS))

    def ring(self, worker: int) -> int:
        """Where ``worker``'s decision ring starts: its cursor (words ever written), then the ring."""
        return self._rings0 + worker * (1 + RING_WORDS)

    @classmethod
    def create(cls, path: Path, n_workers: int, n_slots: int = MAX_BACKENDS) -> Segment:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, cls.size_words(n_workers, n_slots) * 8)
        mm = mmap.mmap(fd, 0)
        words = memoryview(mm).cast("q")
        words[H_WORKERS] = n_workers
        words[H_SLOTS] = n_slots
        words[H_LAYOUT] = LAYOUT
        words[H_MAGIC] = MAGIC
        words.release()
        return cls(path, fd, mm)

    @classmethod
    def attach(cls, path: Path) -> Segment:
        fd = os.open(path, os.O_RDWR)
        return cls(path, fd, mmap.mmap(fd, 0))

    def close(self) -> None:
        self.words.release()
        self.uwords.release()
        try:
            self._mm.close()
        except BufferError:  # a LoadTracker's array view still maps it: the mapping ends with the process
            pass
        os.close(self._fd)

    def slot(self, name: str) -> int:
        """The slot of backend ``name``, claimed on first use (under the file's lock: two
        workers reloading at once must not take one free slot for two names)."""
        key = name_hash(name)
        found = self._find(key)
        if found is not None:
            return found
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            found = self._find(key)
            if found is not None:
                return found
            for i in range(self.n_slots):
                if self.words[self._slots0 + i] == 0:
                    self.words[self._slots0 + i] = key
                    return i
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        raise ValueError(f"more than {self.n_slots} backends over this router's life: restart it to reclaim slots")

    def _find(self, key: int) -> int | None:
        w, s0 = self.words, self._slots0
        for i in range(self.n_slots):
            k = w[s0 + i]
            if k == key:
                return i
            if k == 0:
                return None
        return None

    # load rows
    def row_base(self, worker: int, slot: int) -> int:
        return self._rows0 + (worker * self.n_slots + slot) * ROW_WORDS

    def rows(self) -> np.ndarray:
        """Every load row as an ``int64`` array ``[worker, slot, field]`` over the mapping (no copy)."""
        return np.frombuffer(self._mm, dtype=np.int64, count=self.n_workers * self.n_slots * ROW_WORDS,
                             offset=self._rows0 * 8).reshape(self.n_workers, self.n_slots, ROW_WORDS)

    def row(self, worker: int, slot: int) -> tuple[int, ...]:
        r = self.row_base(worker, slot)
        return tuple(self.words[r:r + len(LOAD_FIELDS)])

    def zero_worker(self, worker: int) -> None:
        """Forget a worker's load (it died, or starts again): the supervisor, or the worker itself."""
        start = self.row_base(worker, 0)
        self.words[start:start + self.n_slots * ROW_WORDS] = memoryview(bytes(self.n_slots * ROW_WORDS * 8)).cast("q")

    def zero_row(self, worker: int, slot: int) -> None:
        r = self.row_base(worker, slot)
        for i in range(ROW_WORDS):
            self.words[r + i] = 0

    # health verdicts
    def _health(self, slot: int) -> int:
        return self._health0 + slot * HEALTH_WORDS

    def verdict(self, slot: int) -> tuple[int, int, int, bool]:
        """``(state, version, ejections, refused)`` of a slot's health verdict."""
        h = self._health(slot)
        w = self.words
        return w[h + V_STATE], w[h + V_VERSION], w[h + V_EJECTIONS], bool(w[h + V_REFUSED])

    def set_verdict(self, slot: int, state: int, *, refused: bool = False) -> None:
        """Publish a health verdict; the version is bumped last so a follower that sees it
        also sees the state. Two workers publishing at the same instant may bump it once
        between them: the later state stands, which is what either of them would publish."""
        h = self._health(slot)
        w = self.words
        if state == EJECTED and w[h + V_STATE] != EJECTED:
            w[h + V_EJECTIONS] += 1
        w[h + V_REFUSED] = int(refused)
        w[h + V_STATE] = state
        w[h + V_VERSION] += 1

    # the leader's scrapes of each engine's gauges
    def set_scraped(self, slot: int, waiting: float | None, running: float | None, usage: float | None,
                    unseen: float, at: float | None) -> None:
        h = self._health(slot)
        w = self.words
        w[h + V_WAITING] = _NONE if waiting is None else round(waiting * 1000)
        w[h + V_RUNNING] = _NONE if running is None else round(running * 1000)
        w[h + V_USAGE] = _NONE if usage is None else round(usage * 1e6)
        w[h + V_UNSEEN] = round(unseen * 1000)
        w[h + V_SCRAPED_MS] = 0 if at is None else round(at * 1000)

    def scraped(self, slot: int) -> tuple[float | None, float | None, float | None, float, float | None]:
        """``(waiting, running, kv_usage, unseen, scraped_at)`` as the leader last published them."""
        h = self._health(slot)
        w = self.words
        waiting, running, usage, at = w[h + V_WAITING], w[h + V_RUNNING], w[h + V_USAGE], w[h + V_SCRAPED_MS]
        return (None if waiting == _NONE else waiting / 1000, None if running == _NONE else running / 1000,
                None if usage == _NONE else usage / 1e6, w[h + V_UNSEEN] / 1000, at / 1000 if at else None)

    # workers and the supervisor
    def _worker(self, worker: int) -> int:
        return self._workers0 + worker * WORKER_WORDS

    def mark_started(self, worker: int, pid: int) -> None:
        base = self._worker(worker)
        self.words[base + W_PID] = pid
        self.words[base + W_STARTED_NS] = time.time_ns()

    def pid(self, worker: int) -> int:
        return self.words[self._worker(worker) + W_PID]

    def beat(self, worker: int) -> None:
        """The health leader's heartbeat (followers take over checking when it stops)."""
        self.words[self._worker(worker) + W_LEADER_BEAT_NS] = time.monotonic_ns()

    def last_beat_ns(self, worker: int) -> int:
        return self.words[self._worker(worker) + W_LEADER_BEAT_NS]

    def count_restart(self) -> None:
        self.words[H_RESTARTS] += 1

    @property
    def restarts(self) -> int:
        return self.words[H_RESTARTS]
