"""docs/config-reference.md is generated from config.py and must not go stale."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_config_reference.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_current() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    # The message names the command that regenerates the page.
    assert done.returncode == 0, done.stderr


def test_every_key_of_the_run_config_is_in_the_reference() -> None:
    from swarmpipe.config import RunConfig

    gen = _generator()
    text = (REPO / "docs" / "config-reference.md").read_text()
    keys = list(gen.walk(RunConfig, "", gen.field_docs((REPO / "config.py").read_text())))
    assert len(keys) > 40
    for key in keys:
        assert f"| `{key.dotted}` |" in text


def test_a_field_without_a_docstring_stops_the_generator() -> None:
    gen = _generator()

    @dataclass
    class Section:
        documented: int = 1
        """Has words."""
        bare: int = 2

    source = 'class Section:\n    documented: int = 1\n    """Has words."""\n    bare: int = 2\n'
    with pytest.raises(SystemExit, match=r"Section\.bare has no docstring"):
        list(gen.walk(Section, "s", gen.field_docs(source)))
