"""The fleet-state log between the workers of one host: one ring of bytes per worker.

One memory-mapped file in the supervisor's run directory holds a header, per worker its
generation, start and cursor, then per worker a ring. A worker appends each batch (4-byte
length, msgpack), then advances its cursor with one aligned 8-byte store: one writer, no lock.
A reader a whole ring behind skips to the cursor and forgets that worker's load until its next
snapshot. The supervisor bumps a worker's generation when it dies or restarts (readers drop its
load). A file, not ``SharedMemory``: Python 3.11's resource tracker unlinks that when its first
user exits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from array import array
from pathlib import Path

from router.fleet.log import FleetState, decode

MAGIC = 0x6B76726C6F677269  # "kvrlogri"
LAYOUT = 1
H_MAGIC, H_LAYOUT, H_WORKERS, H_RESTARTS, H_RING_BYTES = range(5)
HEADER_WORDS = 8
W_GENERATION, W_START, W_CURSOR = range(3)
WORKER_WORDS = 4
RING_BYTES = 1 << 21  # ~450 decisions of 8k-token prompts (~4.6 KB of keys each); 2 MiB a worker fits /dev/shm in containers


def sender(worker: int) -> str:  # a worker's name in the fold
    return f"w{worker}"


class Ring:
    """The shared file, mapped: ``create`` (the supervisor) sizes it; ``attach`` (a worker) maps it."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, worker: int | None = None) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.words = memoryview(mm).cast("q")
        if self.words[H_MAGIC] != MAGIC or self.words[H_LAYOUT] != LAYOUT:
            raise ValueError(f"{path} is not a kvrouter fleet ring of layout {LAYOUT}")
        self.n_workers = self.words[H_WORKERS]
        self.ring_bytes = self.words[H_RING_BYTES]
        self._rings0 = (HEADER_WORDS + self.n_workers * WORKER_WORDS) * 8
        self.worker = worker
        # Per worker: the generation and the cursor this reader has folded up to.
        self._seen = [(self._word(w, W_GENERATION), self._word(w, W_CURSOR)) for w in range(self.n_workers)]

    @classmethod
    def create(cls, path: Path, n_workers: int, ring_bytes: int = RING_BYTES) -> Ring:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, (HEADER_WORDS + n_workers * WORKER_WORDS) * 8 + n_workers * ring_bytes)
        mm = mmap.mmap(fd, 0)
        with memoryview(mm).cast("q") as words:
            words[:H_RING_BYTES + 1] = array("q", [MAGIC, LAYOUT, n_workers, 0, ring_bytes])
        return cls(path, fd, mm)

    @classmethod
    def attach(cls, path: Path, worker: int) -> Ring:
        fd = os.open(path, os.O_RDWR)
        return cls(path, fd, mmap.mmap(fd, 0), worker)

    def _at(self, worker: int, field: int) -> int:
        return HEADER_WORDS + worker * WORKER_WORDS + field

    def _word(self, worker: int, field: int) -> int:
        return self.words[self._at(worker, field)]

    def new_generation(self, worker: int, *, restarted: bool = False) -> None:
        """The supervisor: ``worker`` died or is being started; readers drop what it held."""
        self.words[self._at(worker, W_START)] = self._word(worker, W_CURSOR)
        self.words[self._at(worker, W_GENERATION)] += 1
        if restarted:
            self.words[H_RESTARTS] += 1

    @property
    def restarts(self) -> int:
        return self.words[H_RESTARTS]

    def append(self, batch: bytes) -> None:
        assert self.worker is not None
        frame = len(batch).to_bytes(4, "little") + batch
        cursor = self._word(self.worker, W_CURSOR)
        base = self._rings0 + self.worker * self.ring_bytes
        at = cursor % self.ring_bytes
        first = min(len(frame), self.ring_bytes - at)
        self._mm[base + at:base + at + first] = frame[:first]
        if first < len(frame):
            self._mm[base:base + len(frame) - first] = frame[first:]
        self.words[self._at(self.worker, W_CURSOR)] = cursor + len(frame)

    def _read(self, base: int, pos: int, n: int) -> bytes:
        at = pos % self.ring_bytes
        first = min(n, self.ring_bytes - at)
        out = self._mm[base + at:base + at + first]
        return out if first == n else out + self._mm[base:base + n - first]

    def catch_up(self, state: FleetState) -> None:
        """Fold every record the other workers appended since this reader last looked."""
        for w in range(self.n_workers):
            if w == self.worker:
                continue
            generation, end = self._word(w, W_GENERATION), self._word(w, W_CURSOR)
            seen_generation, pos = self._seen[w]
            if generation == seen_generation and pos == end:
                continue
            name = sender(w)
            if generation != seen_generation:
                state.drop(name)  # it died or restarted: its requests went with it
                pos = self._word(w, W_START)
            if pos == self._word(w, W_START):
                state.begin(name)  # read from the worker's first record: nothing missed
            if end - pos > self.ring_bytes or end < pos:
                state.drop(name)  # fell a ring behind: its next snapshot counts it again
                pos = end
            base = self._rings0 + w * self.ring_bytes
            while pos < end:
                n = int.from_bytes(self._read(base, pos, 4), "little")
                got = decode(self._read(base, pos + 4, n))
                pos += 4 + n
                if got is None or pos > end:
                    state.drop(name)
                    pos = end
                    break
                state.fold(name, got[0])
            self._seen[w] = (generation, pos)

    def close(self) -> None:
        self.words.release()
        with contextlib.suppress(BufferError):  # a view still held elsewhere: the exit unmaps it
            self._mm.close()
        os.close(self._fd)
