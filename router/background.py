"""The router's background work: one low-priority thread, one back-pressure count, one way in.

What a request leaves behind once it is sent runs here: a deferred request's full
tokenization (:mod:`router.prompt.cold`), learning a chat history (:mod:`router.prompt.history`), the
sampled check of a prompt tokenized from its segments, and the asyncio tasks that wait
for those (settles, parity checks against a backend's ``/tokenize``). :mod:`router.settle`
is the one module that submits: each plan says what it owes, and settle pays it here.

Invariant: every job on the thread is counted in :attr:`Background.queued` from the
moment it is submitted until it finishes, so :attr:`Background.full` is the one signal
the request path reads to stop adding work (outcome ``busy``: tokenize on the request
path instead). The count changes under a lock (``submit`` may be called from any
thread); reading it needs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

MAX_SETTLING = 8
"""Most jobs queued on the background thread. It is one thread at a low OS priority:
past this it is not keeping up, and a deferred request's load would stay an estimate for
longer than tokenizing it on the request path takes, so requests take that path until it
catches up (outcome ``busy``)."""
BACKGROUND_NICE = 10
"""The thread's nice value: it yields the cores to the event loop and the tokenizer pool."""


class Background:
    """The background thread, its job count and the tasks waiting on it."""

    def __init__(self, limit: int = MAX_SETTLING) -> None:
        self.limit = limit
        self.queued = 0
        """Jobs submitted to the thread and not finished (see :data:`MAX_SETTLING`)."""
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="settle", initializer=_lower_priority)
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def full(self) -> bool:
        return self.queued >= self.limit

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread, awaited (event loop only)."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on the thread, from any thread; the future may be dropped."""
        with self._lock:
            self.queued += 1
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)
        return future

    def _done(self, _: object) -> None:
        with self._lock:
            self.queued -= 1

    @property
    def tasks(self) -> int:
        """Tasks spawned here and not finished (a soak watches it stay flat)."""
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task the router keeps a reference to until it ends."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """Lower the calling thread's scheduling priority (Linux: threads have their own nice)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
