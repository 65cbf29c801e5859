"""Give a burst's freed heap pages back to the operating system (glibc's ``malloc_trim``).

A replay of an engine's history (after an ejection, a restart, a router start) receives
up to the engine's whole replay buffer at once (vLLM's ``buffer_steps``, 10,000 batches)
and holds it until the end marker: ~10-25 MB of payloads, libzmq frames and decoded
events per stream, allocated from the subscriber thread's and libzmq's I/O thread's
malloc arenas. Once applied it is all freed, but glibc keeps a thread arena's free pages
mapped (it only gives back the free top of a heap, and the replay's survivors, index
entries made during it, pin the top): the process keeps the burst's high-water mark as
resident memory. That was the 1-hour soak's RSS steps at ejections (docs/chaos/README.md).
It is bounded (the next burst reuses the pages), but it is memory the router no longer
uses. ``malloc_trim(0)`` releases every whole free page of every arena (``madvise``),
which no Python library exposes, hence ctypes. Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["trim"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc's, where it is linked
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim() -> bool | None:
    """Return free heap pages to the OS: True if glibc released some, False if it had none
    to release, None where the C library has no ``malloc_trim``."""
    fn = _malloc_trim()
    return None if fn is None else bool(fn(0))
