"""``kvrouter --help`` reads as plain text: no reStructuredText markup from docstrings."""

from __future__ import annotations

import re

import pytest

from router.cli import COMMANDS, build_parser

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
