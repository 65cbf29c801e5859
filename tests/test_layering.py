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


def imports(path: Path) -> set[tuple[str, int]]:
    """(dotted name, line) for every absolute import in ``path``; ``from a.b import c``
    gives ``a.b`` and ``a.b.c`` (``c`` may be a module)."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module, node.lineno))
            found.update((f"{node.module}.{a.name}", node.lineno) for a in node.names)
    return found


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(first-party top-level package, line) for every import in ``path``."""
    return {(name.split(".")[0], line) for name, line in imports(path) if name.split(".")[0] in ORDER}


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


REQUEST_PATH = ["parse", "runtime", "prompt_ids", "plans", "choose", "settle", "proxy", "request_path", "core", "app", "server"]
"""The request path's modules in dependency order (docs/architecture.md, "The request
path"): each may import the ones before it; the rest of ``router/`` (config, errors,
metrics, load, backends, background, the tokenizer's modules, cold, history, policies)
is what they stand on and imports none of them."""


def router_imports(path: Path) -> set[tuple[str, int]]:
    """(module name under ``router/``, without its subpackage, and line) for every
    ``router.X`` or ``router.pkg.X`` import in ``path``."""
    return {(name.split(".")[-1], line) for name, line in imports(path) if name.startswith("router.")}


def test_the_request_path_modules_import_only_the_stages_before_them() -> None:
    breaks = []
    for path in modules("router"):
        name = path.parent.name if path.stem == "__init__" else path.stem
        allowed = set(REQUEST_PATH[: REQUEST_PATH.index(name)]) if name in REQUEST_PATH else set()
        breaks += [f"{path.relative_to(ROOT)}:{line} imports router.{imported}"
                   for imported, line in sorted(router_imports(path))
                   if imported in REQUEST_PATH and imported not in allowed]
    assert not breaks, "the request path's order (docs/architecture.md) is broken:\n" + "\n".join(breaks)


def router_module_imports() -> dict[str, set[str]]:
    """Every module under ``router/`` (dotted) -> the ``router`` modules it imports, type-only
    imports included: a circle of imports is a tangle whether or not it runs."""
    modules_by_name = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
                       for p in modules("router")}
    graph: dict[str, set[str]] = {}
    for name, path in modules_by_name.items():
        found = {n for n, _ in imports(path) if n in modules_by_name}
        graph[name] = found - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_import_circles_are_found() -> None:
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_module_under_router_imports_itself_through_others() -> None:
    circles = import_circles(router_module_imports())
    assert not circles, "import circles under router/:\n" + "\n".join(", ".join(c) for c in circles)



FLEET_STATE = {"log", "ring", "stream", "process"}
"""The whole fleet-state mechanism: the log and its fold, the two transports, this process's side."""
FLEET_OTHERS = {"discovery", "__init__", "backends", "gauges", "load", "scrape"}
"""The rest of ``router/fleet``: a new module there is one or the other, never uncounted."""


def test_module_sizes_stay_within_the_budget_the_architecture_sets() -> None:
    """A module over 500 lines has grown more than one job; the fleet-state mechanism, which
    once spread over nine protocols, stays one of a few hundred lines."""
    over = {str(p.relative_to(ROOT)): n for p in modules("router") if (n := len(p.read_text().splitlines())) > 500}
    assert not over, f"modules over 500 lines: {over}"
    fleet = {p.stem: len(p.read_text().splitlines()) for p in (ROOT / "router/fleet").glob("*.py")}
    assert set(fleet) == FLEET_STATE | FLEET_OTHERS, sorted(fleet)
    assert sum(fleet[m] for m in FLEET_STATE) <= 600, {m: fleet[m] for m in FLEET_STATE}
