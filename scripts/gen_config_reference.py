"""Regenerate docs/config-reference.md from the run config dataclasses in config.py.

Usage: python scripts/gen_config_reference.py [--check]

Each field's text is the docstring under it in config.py (read with `ast`, since Python
keeps no attribute docstrings at run time); its type and default come from the dataclass
itself, so the page cannot disagree with what `load_config` accepts. A field without a
docstring is an error. The checkout's own config.py is imported (through a scratch
`swarmpipe` link to the repository root), whatever swarmpipe is installed. With --check
nothing is written; the exit code is 1 when the committed page differs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import tempfile
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIG_PY = REPO / "config.py"
OUT = REPO / "docs" / "config-reference.md"
COMMAND = "python scripts/gen_config_reference.py"


@dataclass(frozen=True)
class Key:
    """One config key: where it lives, its TOML type and default, and its documentation."""

    section: str  # "" for the top level
    name: str
    type: str
    default: str
    doc: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name


def field_docs(source: str) -> dict[str, dict[str, str]]:
    """Class name -> field name -> the docstring written under that field."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                fields[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def toml_type(tp: Any) -> str:
    """How a field's annotation reads in TOML terms."""
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"array of {toml_type(args[0])}"
        return "[" + ", ".join(toml_type(a) for a in args) + "]"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(toml_type(a) for a in typing.get_args(tp))
    names = {int: "integer", float: "float", str: "string", bool: "boolean"}
    if tp in names:
        return names[tp]
    raise SystemExit(f"config.py: no TOML name for type {tp!r}; teach toml_type about it")


def toml_value(value: Any) -> str:
    """A default written as it would be in run.toml."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, int | float):
        return repr(value)
    raise SystemExit(f"config.py: cannot write default {value!r} as TOML")


def walk(cls: type[Any], section: str, docs: dict[str, dict[str, str]]) -> Iterator[Key]:
    """Every key of a config dataclass, nested sections after the keys of their parent."""
    hints = typing.get_type_hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested.append((f.name, tp))
            continue
        doc = docs.get(cls.__name__, {}).get(f.name)
        if not doc:
            raise SystemExit(
                f"config.py: {cls.__name__}.{f.name} has no docstring; write one under it"
            )
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        yield Key(section, f.name, toml_type(tp), toml_value(default), doc)
    for name, tp in nested:
        yield from walk(tp, name if not section else f"{section}.{name}", docs)


def sections(root: type[Any]) -> dict[str, type[Any]]:
    """Section name ("" for the top level) -> its dataclass, in declaration order."""
    found = {"": root}
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        if dataclasses.is_dataclass(hints[f.name]):
            found[f.name] = hints[f.name]
    return found


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(config: types.ModuleType) -> str:
    root = config.RunConfig
    docs = field_docs(CONFIG_PY.read_text())
    keys = list(walk(root, "", docs))
    lines = [
        "# Run config reference",
        "",
        f"<!-- Generated by `{COMMAND}` from config.py; do not edit by hand. -->",
        "",
        "Every key of a run's TOML file (`--config run.toml`), with its type and default, as",
        "documented in `config.py`. Any key can also be set with `--set section.key=value`;",
        "unknown sections or keys are errors, and every key may be left out.",
        "[configuration.md](configuration.md) explains the file and every command's flags;",
        "`deploy/run.toml` is an example that lists every key.",
        "",
    ]
    for name, cls in sections(root).items():
        title = "Top level" if not name else f"`[{name}]`"
        lines += [f"## {title}", "", _cell(inspect.cleandoc(cls.__doc__ or "")), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key in keys:
            if key.section == name:
                lines.append(
                    f"| `{key.dotted}` | {key.type} | `{key.default}` | {_cell(key.doc)} |"
                )
        lines.append("")
    return "\n".join(lines)


def import_config() -> types.ModuleType:
    """This checkout's config.py as `swarmpipe.config`."""
    scratch = Path(tempfile.mkdtemp(prefix="swarmpipe-gen-"))
    (scratch / "swarmpipe").symlink_to(REPO, target_is_directory=True)
    sys.path.insert(0, str(scratch))
    import importlib

    return importlib.import_module("swarmpipe.config")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed page is stale")
    args = parser.parse_args()
    text = render(import_config())
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(
                f"{OUT.relative_to(REPO)} differs from config.py; run `{COMMAND}`",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
