"""An attempt owns its load ticket: opened with the ticket and the decision's commit, ended once.

These check :mod:`router.attempt` in process, without an engine; the proxied paths
(retries, timeouts, disconnects, drain, backend death) end to end are in
tests/test_hardening.py, tests/test_graceful.py and tests/test_router_e2e.py, which
check the load back at zero.
"""

from __future__ import annotations

import asyncio

import pytest

from router.attempt import BACKEND_DOWN, SHUTTING_DOWN, Attempts
from router.fleet.backends import BackendPool
from kvconfig import parse_config
from router.fleet.load import LoadTracker

KEYS = [11, 12, 13]


def attempts(commits: list[str] | None = None, retries: int = 1) -> Attempts:
    cfg = parse_config({"models": [{"name": "m", "tokenizer": "unused", "backends": [
        {"name": "a", "url": "http://127.0.0.1:9"}, {"name": "b", "url": "http://127.0.0.1:10"},
    ]}]})
    pool = BackendPool(cfg)
    return Attempts(pool, LoadTracker(list(pool.backends)), retries, ["a", "b"], "m", "kv_aware", 0.0,
                    keys=KEYS, prefill={"a": 32, "b": 48}, commit=None if commits is None else commits.append)


def test_opening_the_first_attempt_takes_its_ticket_and_commits_at_once() -> None:
    commits: list[str] = []
    tries = attempts(commits)
    first = tries.open("a")
    load = tries.loads.own("a")
    assert (load.in_flight, load.prefill_tokens, commits) == (1, 32, ["a"])
    assert tries.next() is first


def test_a_first_attempt_never_tried_is_released_when_the_request_ends() -> None:
    tries = attempts()
    tries.open("a")
    tries.end(499)
    assert tries.loads.idle()


def test_a_retry_opens_its_own_attempt_and_commits_its_backend() -> None:
    commits: list[str] = []
    tries = attempts(commits)
    tries.open("a")

    async def run() -> None:
        async with tries.next() as first:  # type: ignore[union-attr]
            assert tries.more()
        async with tries.next() as retry:  # type: ignore[union-attr]
            assert retry.name == "b" and retry is not first
            assert tries.loads.own("a").in_flight == 0 and tries.loads.own("b").prefill_tokens == 48
        assert tries.next() is None and not tries.more()

    asyncio.run(run())
    tries.end(200)
    assert commits == ["a", "b"]
    assert tries.loads.idle()


def test_the_retry_budget_bounds_the_attempts() -> None:
    tries = attempts(retries=0)

    async def run() -> None:
        async with tries.next():  # type: ignore[union-attr]
            assert not tries.more()
        assert tries.next() is None

    asyncio.run(run())
    assert tries.loads.idle()


def test_an_attempt_ends_once_whatever_ends_its_block() -> None:
    tries = attempts()
    tries.open("a")

    async def run() -> None:
        async with tries.next() as attempt:  # type: ignore[union-attr]
            attempt.first_byte()
            assert attempt.backend.in_flight
            raise RuntimeError("the relay failed")

    with pytest.raises(RuntimeError):
        asyncio.run(run())
    tries.end(500)
    assert tries.loads.idle()
    assert not tries.pool.get("a").in_flight


@pytest.mark.parametrize("shutting_down, reason", [(False, BACKEND_DOWN), (True, SHUTTING_DOWN)])
def test_an_aborted_attempt_is_cancelled_and_says_why(shutting_down: bool, reason: str) -> None:
    tries = attempts()

    async def run() -> str | None:
        attempt = tries.next()
        assert attempt is not None
        async with attempt:
            assert attempt.backend.abort_in_flight(shutting_down=shutting_down) == 1
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(10)
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        return attempt.aborted

    assert asyncio.run(run()) == reason
    assert tries.loads.idle()
    assert not tries.pool.get("a").in_flight
