"""docs/config.md is what ``kvconfig.doc`` renders from the config models: current, and
covering every key an operator can write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvconfig.doc import COMMAND, OUTPUT, leaf_keys, render, sections
from support import REPO

EXAMPLES = sorted((REPO / "configs").glob("*.yaml"))


def written_keys(value: Any, prefix: str = "") -> set[str]:
    """The dotted paths of the keys a YAML document sets (``[]`` for a list's tables)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else k
            out.add(path)
            out |= written_keys(v, path)
    elif isinstance(value, list):
        for item in value:
            out |= written_keys(item, prefix + "[]")
    return out


def test_config_reference_is_current() -> None:
    if not OUTPUT.exists() or OUTPUT.read_text() != render():
        pytest.fail(f"{OUTPUT.relative_to(REPO)} is not what the config models in kvconfig/ give: "
                    f"regenerate it with `{COMMAND}` (python -m kvconfig.doc)", pytrace=False)


def test_every_config_key_has_a_description() -> None:
    missing = [k.path for _, _, keys in sections() for k in keys if not k.field.description]
    assert not missing, f"add a docstring under each of these fields in kvconfig/: {missing}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_key_the_example_configs_set_is_documented(path: Path) -> None:
    documented = {k.path for _, _, keys in sections() for k in keys}
    written = written_keys(yaml.safe_load(path.read_text()))
    assert written and written <= documented, sorted(written - documented)


def test_the_command_writes_the_reference_and_prints_the_key_count(tmp_path: Path) -> None:
    out = tmp_path / "config.md"
    r = subprocess.run([sys.executable, "-m", "kvconfig.doc", "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == render()
    assert r.stdout == f"wrote {out}: {len(leaf_keys())} config keys\n"
