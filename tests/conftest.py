"""Shared fixtures: real processes on loopback, started, waited for and always stopped."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from support import Proc, free_port, wait_port


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, without persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: `make test` installs it with apt-get")
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)]
    with Proc(args, d / "redis.log") as proc:
        wait_port(port, timeout=20)
        yield f"redis://127.0.0.1:{port}/0"
        assert proc.popen.poll() is None, proc.log()
