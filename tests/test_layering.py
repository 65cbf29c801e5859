"""The packages' dependency order (docs/architecture.md): kvconfig < indexer < router < loadtest.

A package may import the ones before it and never one after it, at module level or
inside a function: ``indexer`` serves ``kvrouter indexer`` without the router, and the
router's package must not pull in the load-test tools. Imports are read from the
source (ast), so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["kvconfig", "indexer", "router", "loadtest"]


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(first-party top-level package, line) for every import in ``path``."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update((n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in ORDER)
    return found


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", ORDER)
def test_a_package_imports_only_packages_below_it(package: str) -> None:
    allowed = set(ORDER[: ORDER.index(package) + 1])
    breaks = [
        f"{path.relative_to(ROOT)}:{line} imports {imported}"
        for path in modules(package)
        for imported, line in sorted(imported_packages(path))
        if imported not in allowed
    ]
    assert not breaks, f"{package} may import only {sorted(allowed)}:\n" + "\n".join(breaks)


def test_every_first_party_package_has_a_place_in_the_order() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages <= set(ORDER), f"add {sorted(packages - set(ORDER))} to ORDER and docs/architecture.md"
    assert all(modules(p) for p in ORDER)
