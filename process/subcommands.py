"""Subcommands whose modules are imported only when the command line reaches them.

`swarmpipe --help` must answer at once, but a subcommand's module may need torch (1 s and
more to import), grpc or an MQTT client to run. So each subcommand is a module with
`add_arguments(parser)` and `serve(args)` (or an object in a module with both, where one
module holds several subcommands), named here by its import path with one line of help, and
its parser imports that module and adds its arguments only when parsing reaches it:
`swarmpipe --help` imports no subcommand, `swarmpipe node --help` imports
`swarmpipe.node.main` alone. The same holds one level down (`swarmpipe bench convergence`).

What keeps this fast is the modules' side of the bargain: a module that defines
`add_arguments` imports only light things (argparse, errors, config) at its top, and the
heavy ones inside `serve` or the functions it calls.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Subcommand:
    """One subcommand: where its code is, and what its line in the parent's help says."""

    module: str
    """Import path of the module with `add_arguments(parser)` and `serve(args)`."""
    help: str
    """One line for the parent's list of subcommands. Plain text: a `%` is a percent sign,
    not the start of one of argparse's `%(default)s` fields."""
    attribute: str = ""
    """Where `module` holds several subcommands: the name of the object in it that has
    `add_arguments` and `serve` in the module's stead, and whose docstring is the
    description."""


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that fills itself from its module the first time it is used."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._module = ""
        self._serve_dest = ""
        self._attribute = ""

    def defer(self, module: str, serve_dest: str, attribute: str = "") -> None:
        """Take the arguments, description and `serve` of `module` (or of its object named
        `attribute`) when first used; `serve` lands in the parsed namespace as
        `serve_dest`."""
        self._module, self._serve_dest, self._attribute = module, serve_dest, attribute

    def _load(self) -> None:
        if not self._module:
            return
        module = importlib.import_module(self._module)
        self._module = ""  # loaded once, even if parsed again (tests reuse parsers)
        command = getattr(module, self._attribute) if self._attribute else module
        self.description = command.__doc__
        command.add_arguments(self)
        self.set_defaults(**{self._serve_dest: command.serve})

    # typeshed spells the same signature as three overloads; this is all of them in one.
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        self._load()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._load()
        return super().format_usage()

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def add_subcommands(
    parser: argparse.ArgumentParser,
    commands: Mapping[str, Subcommand],
    *,
    dest: str,
    serve_dest: str,
    metavar: str | None = None,
) -> None:
    """Give `parser` a required subcommand out of `commands`: its name lands in the parsed
    namespace as `dest`, its module's `serve` as `serve_dest`."""
    sub = parser.add_subparsers(
        dest=dest, required=True, metavar=metavar, parser_class=SubcommandParser
    )
    for name, command in commands.items():
        # argparse fills a help string as a %-template; ours are plain text.
        child = sub.add_parser(name, help=command.help.replace("%", "%%"))
        child.defer(command.module, serve_dest, command.attribute)
