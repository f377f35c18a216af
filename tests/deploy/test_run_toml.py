"""deploy/run.toml lists every run config key, with a comment and its default."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from swarmpipe.config import RunConfig, load_config

RUN_TOML = Path(__file__).resolve().parents[2] / "deploy" / "run.toml"


def _defaults(cls: type[Any], section: str = "") -> dict[str, Any]:
    """Dotted key -> default, for every key of the config dataclasses."""
    found: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{section}.{f.name}" if section else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            found.update(_defaults(hints[f.name], dotted))
        elif f.default is not dataclasses.MISSING:
            found[dotted] = f.default
        else:
            found[dotted] = f.default_factory()  # type: ignore[misc]
    return found


def _flatten(table: dict[str, Any], section: str = "") -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{section}.{key}" if section else key
        found.update(_flatten(value, dotted) if isinstance(value, dict) else {dotted: value})
    return found


def test_run_toml_parses_as_a_run_config() -> None:
    config = load_config(RUN_TOML)  # unknown keys and bad values raise ConfigError
    assert config.run_id == "community-gpt"


def test_run_toml_has_every_key_and_no_other() -> None:
    written = set(_flatten(tomllib.loads(RUN_TOML.read_text())))
    known = set(_defaults(RunConfig))
    assert not known - written, f"deploy/run.toml lacks {sorted(known - written)}"
    assert not written - known, f"deploy/run.toml has unknown {sorted(written - known)}"


def test_every_key_has_a_comment_and_changed_ones_name_their_default() -> None:
    defaults = _defaults(RunConfig)
    values = _flatten(tomllib.loads(RUN_TOML.read_text()))
    lines = RUN_TOML.read_text().splitlines()
    section = ""
    for i, line in enumerate(lines):
        if header := re.fullmatch(r"\[(\w+)\]", line):
            section = header[1]
        elif assignment := re.match(r"(\w+) = ", line):
            dotted = f"{section}.{assignment[1]}" if section else assignment[1]
            comment = lines[i - 1]
            assert comment.startswith("# "), f"{dotted} has no comment line above it"
            value = values[dotted]
            default = defaults[dotted]
            if (tuple(value) if isinstance(value, list) else value) != default:
                shown = f'"{default}"' if isinstance(default, str) else str(default)
                assert f"(default {shown}" in comment, (
                    f"{dotted} = {value!r} differs from its default {default!r}; "
                    f"say '(default {shown})' in its comment"
                )
