"""``pip install kvrouter`` without extras: every command's ``--help`` works, and a lab
command run without its extra says which extra to install, in one line.

The installed ``kvrouter`` entry point runs in a subprocess whose imports of the extras'
packages fail as if they were not installed: a ``sitecustomize`` on ``PYTHONPATH`` puts a
finder first on ``sys.meta_path`` that refuses them. The test venv has every extra, so
this is the only way to see what a plain install sees.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from router.cli import COMMANDS, EXTRAS
from support import REPO

KVROUTER_BIN = Path(sys.executable).with_name("kvrouter")
NOT_INSTALLED = ("psutil", "locust", "matplotlib", "vllm_router")
"""The import names of every optional dependency (pyproject's extras, less what the core
dependencies already bring). The ``otel`` extra's are not here: FastAPI imports the
OpenTelemetry API itself, so ``opentelemetry`` cannot be hidden whole; tests/test_tracing.py
hides the SDK and the exporter alone."""

BLOCKER = f"""\
import sys

NOT_INSTALLED = {NOT_INSTALLED!r}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in NOT_INSTALLED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""


@pytest.fixture(scope="module")
def plain_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("plain-install")
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": str(site)}


def kvrouter(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(KVROUTER_BIN), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_blocker_hides_the_extras(plain_env: dict[str, str]) -> None:
    """Without this the other tests here would pass in a venv that has every extra."""
    probe = "import importlib, sys\nfor m in sys.argv[1:]:\n    try: importlib.import_module(m)\n    except ImportError: print(m)"
    r = subprocess.run([sys.executable, "-c", probe, *NOT_INSTALLED], env=plain_env, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.split() == list(NOT_INSTALLED), r.stderr


def test_top_level_help_runs_without_extras(plain_env: dict[str, str]) -> None:
    r = kvrouter(plain_env, "--help")
    assert r.returncode == 0, r.stderr
    assert all(name in r.stdout for name in COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_help_runs_without_extras(plain_env: dict[str, str], command: str) -> None:
    r = kvrouter(plain_env, command, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: kvrouter " + command), r.stdout
    assert "Traceback" not in r.stderr


def test_a_lab_command_without_its_extra_names_the_extra_in_one_line(plain_env: dict[str, str], tmp_path: Path) -> None:
    r = kvrouter(plain_env, "bench", "--out", str(tmp_path / "bench"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr == "kvrouter bench needs the 'loadtest' extra: pip install 'kvrouter[loadtest]'\n"
    assert r.stdout == ""
    assert not (tmp_path / "bench").exists()


def test_the_extras_the_cli_checks_are_pyprojects() -> None:
    """A package added to an extra in pyproject.toml must be checked before the commands
    that need it run (import names are the distributions' with ``-`` as ``_``)."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        packages = {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].replace("-", "_") for req in declared[extra]}
        assert set(modules) == packages, extra
    assert {c.extra for c in COMMANDS.values() if c.extra} <= set(EXTRAS)
