"""Repository rules: generated code matches the schemas, bare folder imports are rejected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_protobuf_code_is_current() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_lint_rejects_bare_imports_of_our_folders(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import node\nfrom compression import wire\nimport coordinator.main\n")
    ruff = Path(sys.executable).parent / "ruff"
    done = subprocess.run(
        [
            str(ruff),
            "check",
            "--config",
            str(REPO / "pyproject.toml"),
            "--select",
            "TID251",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    for name in ("node", "compression", "coordinator"):
        assert f"import swarmpipe.{name}, not the bare folder" in done.stdout, done.stdout


def test_control_plane_does_not_import_torch() -> None:
    code = (
        "import sys, swarmpipe.coordinator.service, swarmpipe.coordinator.main, "
        "swarmpipe.coordinator.metrics, swarmpipe.process.metrics, "
        "swarmpipe.control.link_control, swarmpipe.control.admin, "
        "swarmpipe.control.status_view; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
