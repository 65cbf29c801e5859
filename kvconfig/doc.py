"""``docs/config.md``, the config file's reference, generated from the pydantic models.

The models are the only statement of what the file accepts (``extra="forbid"``), so the
reference is read from them: every key with its type, bounds, default and description
(the attribute docstring under the field, which pydantic keeps as the field's
description). A key added, removed or re-described in :mod:`kvconfig` shows up here on the
next ``make config-doc``; ``tests/test_config_doc.py`` fails while the checked-in file
differs from what this module renders.

    python -m kvconfig.doc            # writes docs/config.md, prints the key count
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from kvconfig import Config, KeysFromEnv

OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "config.md"
COMMAND = "make config-doc"


@dataclass(frozen=True)
class Key:
    """One key of the file: its dotted path (``[]`` marks a list's entries) and its field."""

    section: str
    name: str
    field: FieldInfo
    table: type[BaseModel] | None
    """The model of a key whose value is a table (or a list of tables), documented as its own section."""
    many: bool
    """The value is a list of tables."""
    named: bool = False
    """The value is a table of tables, each under a name the file chooses (``router.tenants``)."""

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def table_path(self) -> str:
        """The section of a table key's entries: ``models[]`` for the list ``models``,
        ``router.tenants.<name>`` for the named tables of ``router.tenants``."""
        return self.path + ("[]" if self.many else ".<name>" if self.named else "")


def _unwrap(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _key(section: str, name: str, field: FieldInfo) -> Key:
    annotation = _unwrap(field.annotation)
    if get_origin(annotation) in (typing.Union, types.UnionType):  # an optional table is a table
        tables = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        annotation = tables[0] if len(tables) == 1 else annotation
    many = get_origin(annotation) is list
    named = get_origin(annotation) is dict
    item = _unwrap(get_args(annotation)[0]) if many else _unwrap(get_args(annotation)[1]) if named else annotation
    table = item if isinstance(item, type) and issubclass(item, BaseModel) else None
    return Key(section, name, field, table, many and table is not None, named and table is not None)


def sections(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[tuple[str, type[BaseModel], list[Key]]]:
    """Each table of the file, depth first in declaration order: its path, model and keys."""
    keys = [_key(prefix, name, field) for name, field in model.model_fields.items()]
    yield prefix, model, keys
    for k in keys:
        if k.table is not None:
            yield from sections(k.table, k.table_path)


def leaf_keys() -> list[Key]:
    """Every key that holds a value rather than a table: what an operator can set."""
    return [k for _, _, keys in sections() for k in keys if k.table is None]


def _type_name(annotation: Any) -> str:
    annotation = _unwrap(annotation)
    if annotation is type(None):
        return "null"
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(annotation))
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in get_args(annotation))
    if get_origin(annotation) is list:
        return f"list of {_type_name(get_args(annotation)[0])}"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", SecretStr: "secret string"}
    if annotation in names:
        return names[annotation]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "<="),
           (annotated_types.Lt, "lt", "<"))


def _bounds(field: FieldInfo) -> list[str]:
    out = []
    for m in field.metadata:
        out += [f"{sign} {getattr(m, attr)}" for kind, attr, sign in _BOUNDS if isinstance(m, kind)]
        if isinstance(m, annotated_types.MinLen) and m.min_length:
            out.append(f"min length {m.min_length}")
        if getattr(m, "pattern", None):
            out.append(f"matches `{m.pattern}`")
    return out


def _type_cell(key: Key) -> str:
    if key.table is not None:
        kind = "list of tables" if key.many else "tables by name" if key.named else "table"
        return f"{kind}: [`{key.table_path}`](#{_anchor(key.table_path)})"
    return ", ".join([_type_name(key.field.annotation), *_bounds(key.field)])


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _default_cell(key: Key) -> str:
    field = key.field
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "its keys' defaults"
    return f"`{_yaml(value)}`"


_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def _markdown(text: str) -> str:
    """A docstring's paragraphs on one line, reST literals and roles as Markdown code."""
    return _RST_ROLE.sub(r"`\1`", " ".join(text.split())).replace("``", "`")


def _description(field: FieldInfo) -> str:
    """One table cell."""
    return _markdown(field.description or "").replace("|", "\\|")


def _intro(model: type) -> str:
    """The first paragraph of a model's docstring (the rest is about its code)."""
    return _markdown((model.__doc__ or "").strip().split("\n\n")[0])


def _anchor(path: str) -> str:
    """GitHub's heading anchor for a section titled ``path`` in backticks."""
    return re.sub(r"[^a-z0-9_ -]", "", path.lower()).replace(" ", "-")


def render() -> str:
    keys = leaf_keys()
    lines = [
        "# Configuration reference",
        "",
        f"Generated from the pydantic models in `kvconfig/` by `{COMMAND}`: do not edit by hand.",
        "The file is YAML (`kvrouter serve --config FILE`); an unknown key is an error that names it.",
        f"{len(keys)} keys, not counting those whose value is a table.",
    ]
    for path, model, section_keys in sections():
        lines += ["", f"## `{path}`" if path else "## top level", ""]
        if path and _intro(model):
            lines += [_intro(model), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for k in section_keys:
            lines.append(f"| `{k.name}` | {_type_cell(k)} | {_default_cell(k)} | {_description(k.field)} |")
    prefix = KeysFromEnv.model_config.get("env_prefix", "")
    lines += ["", "## Environment variables", "", _intro(KeysFromEnv), "", "| variable | description |", "|---|---|"]
    for name, field in KeysFromEnv.model_fields.items():
        lines.append(f"| `{prefix}{name.upper()}` | {_description(field)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvconfig.doc", description="write docs/config.md from the config models")
    p.add_argument("--out", type=Path, default=OUTPUT, help=f"where to write it (default {OUTPUT})")
    args = p.parse_args(argv)
    args.out.write_text(render())
    print(f"wrote {args.out}: {len(leaf_keys())} config keys")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
