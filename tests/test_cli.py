"""``kvrouter --help`` reads as plain text (no reStructuredText markup from docstrings), and a lab
command stopped by a signal stops the processes it started."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from router.cli import COMMANDS, build_parser
from support import KVROUTER, REPO

MARKUP = re.compile(r"``|:(?:class|func|meth|mod|data|attr):`")


def test_top_level_help_has_no_markup() -> None:
    text = build_parser([]).format_help()
    assert "KV-cache-aware router" in text
    assert not MARKUP.search(text), text


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_subcommand_help_has_no_markup(command: str) -> None:
    parser = build_parser([command])
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    text = sub.format_help()
    assert not MARKUP.search(text), text


def test_sigterm_to_a_lab_command_stops_its_children(tmp_path: Path) -> None:
    """A bench killed with SIGTERM (a CI timeout, systemd, ``kill``) takes its simulated engines and
    router with it and exits 143 without a traceback; by default the signal would end it at once and
    leave them running, holding ports and cores."""
    bench = subprocess.Popen(
        [*KVROUTER, "bench", "--out", str(tmp_path / "out"), "--workload", "synthetic", "--backends", "2",
         "--policies", "round_robin", "--max-requests", "2000", "--speedup", "1", "--quiet"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    me = psutil.Process(bench.pid)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and bench.poll() is None:
            children = me.children(recursive=True)
            commands = {a for c in children for a in _cmdline(c)}
            if {"sim", "serve"} <= commands:
                break
            time.sleep(0.2)
        assert bench.poll() is None, bench.communicate()
        assert children, "the bench started no fleet and router within 120 s"
        bench.send_signal(signal.SIGTERM)
        out, err = bench.communicate(timeout=60)
        assert bench.returncode == 128 + signal.SIGTERM, out[-2000:] + err[-2000:]
        assert "Traceback" not in err, err[-3000:]
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        for p in [*children, me]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        bench.wait(10)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # exited (or became a zombie) since it was listed
        return []
