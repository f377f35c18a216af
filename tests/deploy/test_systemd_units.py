"""deploy/'s systemd units: `systemd-analyze verify` passes, and their settings hold together.

`systemd-analyze verify` also checks that ExecStart's binary exists and is executable, and
the units name /opt/swarmpipe/bin/swarmpipe, where a server would install it. So the test
renders each unit into a temporary folder with that path replaced by the `swarmpipe`
console script of the Python running the tests, and verifies the rendered copies.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swarmpipe.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
UNITS = ("swarmpipe-coordinator.service", "swarmpipe-node.service")
INSTALLED_AT = "/opt/swarmpipe/bin/swarmpipe"


def _settings(unit: str) -> dict[str, list[str]]:
    """Key -> every value it is given in the unit (comments and section headers left out)."""
    found: dict[str, list[str]] = {}
    for line in (REPO / "deploy" / unit).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def _drain_timeout_s() -> float:
    """node/daemon.py's DRAIN_TIMEOUT_S, read without importing torch."""
    tree = ast.parse((REPO / "node" / "daemon.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "DRAIN_TIMEOUT_S":
            return float(ast.literal_eval(node.value))
    raise AssertionError("node/daemon.py no longer defines DRAIN_TIMEOUT_S")


def test_systemd_analyze_verify_passes(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    executable = Path(sys.executable).with_name("swarmpipe")
    if not executable.exists():
        pytest.skip(f"no swarmpipe console script beside {sys.executable} to point ExecStart at")
    rendered = []
    for unit in UNITS:
        text = (REPO / "deploy" / unit).read_text()
        assert text.count(INSTALLED_AT) == 1, f"{unit}: ExecStart should run {INSTALLED_AT}"
        (tmp_path / unit).write_text(text.replace(INSTALLED_AT, str(executable)))
        rendered.append(str(tmp_path / unit))
    done = subprocess.run(
        [analyze, "verify", *rendered], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ours = [line for line in done.stderr.splitlines() if "swarmpipe" in line]
    assert not ours, "\n".join(ours)


@pytest.mark.parametrize("unit", UNITS)
def test_units_restart_on_failure_but_not_on_config_errors(unit: str) -> None:
    settings = _settings(unit)
    assert settings["Restart"] == ["on-failure"]
    # cli.py EXIT_CONFIG; and EXIT_NOT_ADMITTED for a node (a retry cannot fix either)
    assert settings["RestartPreventExitStatus"][0].split() in (["2"], ["2", "4"])
    assert "KillSignal" not in settings  # SIGTERM, the signal both daemons stop cleanly on
    assert settings["EnvironmentFile"]


def test_node_unit_waits_longer_than_the_nodes_drain() -> None:
    settings = _settings("swarmpipe-node.service")
    assert float(settings["TimeoutStopSec"][0]) > _drain_timeout_s() + 10
    assert "PrivateDevices" not in settings  # it would hide the GPU


@pytest.mark.parametrize(
    ("unit", "environment"),
    [
        ("swarmpipe-coordinator.service", {}),
        (
            "swarmpipe-coordinator.service",
            {"SWARMPIPE_ARGS": "--listen 0.0.0.0:7600 --broker mqtt://coordinator@b:1883"},
        ),
        ("swarmpipe-node.service", {"COORDINATOR": "coordinator.example:7600"}),
        (
            "swarmpipe-node.service",
            {"COORDINATOR": "c:7600", "SWARMPIPE_ARGS": "--threads 4 --node-id alice-gpu"},
        ),
    ],
)
def test_exec_start_is_a_valid_swarmpipe_command_line(
    unit: str, environment: dict[str, str]
) -> None:
    settings = _settings(unit)
    env = {}
    for value in settings.get("Environment", []):
        name, _, default = value.strip('"').partition("=")
        env[name] = default
    env.update(environment)
    (exec_start,) = settings["ExecStart"]
    # systemd's rules: ${X} is one argument, $X splits on whitespace (none if empty).
    line = re.sub(r"\$\{(\w+)\}", lambda m: shlex.quote(env[m[1]]), exec_start)
    argv = shlex.split(line)
    argv = [word for a in argv for word in (env[a[1:]].split() if a.startswith("$") else [a])]
    assert argv[0] == INSTALLED_AT
    args = build_parser().parse_args(argv[1:])  # SystemExit(2) on a bad flag
    assert args.command == unit.removeprefix("swarmpipe-").removesuffix(".service")
