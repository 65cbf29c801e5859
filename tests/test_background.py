"""Background work is counted from submission to completion, whichever thread submits it."""

from __future__ import annotations

import asyncio
import threading
import time

from router.background import Background


def drained(bg: Background) -> bool:
    """Whether the count returns to 0 (a future's result is visible just before its callbacks run)."""
    deadline = time.monotonic() + 5
    while bg.queued and time.monotonic() < deadline:
        time.sleep(0.001)
    return bg.queued == 0


def test_a_job_counts_until_it_finishes_and_full_follows_the_count() -> None:
    bg = Background(limit=2)
    gate = threading.Event()
    first = bg.submit(gate.wait)
    assert bg.queued == 1 and not bg.full
    second = bg.submit(gate.wait)
    assert bg.full
    gate.set()
    first.result(5)
    second.result(5)
    assert drained(bg) and not bg.full
    bg.shutdown()


def test_jobs_submitted_from_other_threads_are_counted() -> None:
    bg = Background()
    gate = threading.Event()
    threads = [threading.Thread(target=bg.submit, args=(gate.wait,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bg.queued == 4
    gate.set()
    assert drained(bg)
    bg.shutdown()


def test_run_returns_the_result_and_spawned_tasks_are_kept() -> None:
    async def main() -> int:
        bg = Background()
        done = asyncio.Event()

        async def task() -> None:
            done.set()

        bg.spawn(task())
        result = await bg.run(sum, [1, 2, 3])
        await asyncio.wait_for(done.wait(), 5)
        assert drained(bg)
        bg.shutdown()
        return result

    assert asyncio.run(main()) == 6
