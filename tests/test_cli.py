"""The `swarmpipe` command answers `--help` and argument errors at once, for every subcommand.

Help is where a broken help string shows (argparse fills each one as a %-template, and a
bare `%` crashed `swarmpipe bench --help`), and where a subcommand that imports torch at its
top makes the whole command slow; both are checked for every subcommand and benchmark the
registries list, so a new one is covered without editing this file.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarmpipe.bench.main import BENCHMARKS
from swarmpipe.cli import COMMANDS, main

pytestmark = pytest.mark.timeout(120)

EVERY_HELP = [
    [],
    *([name] for name in COMMANDS),
    *(["bench", name] for name in BENCHMARKS),
]
"""The command lines whose `--help` must work: the command, each subcommand, each benchmark."""


def _swarmpipe(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "swarmpipe", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("words", EVERY_HELP, ids=lambda words: " ".join(words) or "swarmpipe")
def test_every_help_prints_its_usage(words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # In this process, through the same parser `python -m swarmpipe` builds (the command
    # itself is run below): a fresh interpreter for each of 40 helps cost seconds of CPU.
    with pytest.raises(SystemExit) as done:
        main([*words, "--help"])
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    assert out.out.startswith(f"usage: {' '.join(['swarmpipe', *words])} ")
    assert "options:" in out.out
    assert out.err == ""


def test_the_command_answers_help() -> None:
    done = _swarmpipe("node", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: swarmpipe node ") and done.stderr == ""


def test_an_argument_error_prints_usage_and_exits_2() -> None:
    done = _swarmpipe("node")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: swarmpipe node ")
    assert "the following arguments are required: --coordinator" in done.stderr
    done = _swarmpipe("bench", "nonesuch")
    assert done.returncode == 2
    assert "invalid choice: 'nonesuch'" in done.stderr


def test_help_imports_no_subcommand_and_never_torch() -> None:
    # In one fresh interpreter: the command's own help imports no subcommand's module, and
    # no subcommand's or benchmark's help imports torch (it alone takes seconds to import).
    code = f"""
import contextlib, io, sys
from swarmpipe.cli import COMMANDS, build_parser
build_parser().format_help()
loaded = [c.module for c in COMMANDS.values() if c.module in sys.modules]
assert not loaded, f"the top-level help imported {{loaded}}"
for words in {EVERY_HELP!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        build_parser().parse_args([*words, "--help"])
    assert "torch" not in sys.modules, f"swarmpipe {{' '.join(words)}} --help imported torch"
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["node", "--coordinator", "127.0.0.1:1", "--metrics-port", "70000"], "--metrics-port"),
        (["coordinator", "--listen", "127.0.0.1:0", "--metrics-port", "nine"], "--metrics-port"),
        (["coordinator", "--metrics-port", "0", "--metrics-host", "localhost"], "--metrics-host"),
    ],
    ids=["node-port-out-of-range", "coordinator-port-not-a-number", "host-not-an-address"],
)
def test_a_bad_metrics_flag_is_one_line_and_exit_2(words: list[str], said: str) -> None:
    done = _swarmpipe(*words)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"swarmpipe {words[0]}: configuration error: {said} ")
