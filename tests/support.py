"""Helpers for tests that start real processes on loopback: free ports, readiness, cleanup.

``free_ports`` and ``wait_http`` are re-exported from :mod:`loadtest.fleet`, so the tests and
the bench wait for children the same way.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from loadtest.fleet import free_port_run as free_ports
from loadtest.fleet import wait_http

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
GOLDEN = FIXTURES / "golden"
QWEN3_DIR = REPO / "loadtest" / "data" / "tokenizers" / "qwen3"
KVROUTER = [sys.executable, "-m", "router.cli"]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not open after {timeout}s")


class Proc:
    """A child process that is always stopped: terminate, then kill after a grace period.

    Output goes to a log file so a failing test can show it (``proc.log()``).
    """

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path = REPO):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-8000:]

    def stop(self, grace: float = 5.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(grace)
        self._log.close()

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
