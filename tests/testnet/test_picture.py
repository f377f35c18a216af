"""report.png drawn from a synthetic report.json: churn, a stage move, and no matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from swarmpipe.testnet import picture

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def link(src: str, dst: str, direction: str, codec: str, sent: int) -> dict[str, Any]:
    return {"src": src, "dst": dst, "direction": direction, "codec": codec, "bytes": sent,
            "tensors": 10}  # fmt: skip


def churn(
    action: str, node: str, at: float, step: int, outcome: str, *, mbit: float | None = None
) -> dict[str, Any]:
    return {"action": action, "node": node, "planned": f"step{step}", "at_seconds": at,
            "step": step, "stage": 0, "outcome": outcome, "mbit": mbit}  # fmt: skip


def change(
    seconds: float, step: int, node: str, stage: int, *, online: bool = True, serving: bool = True
) -> dict[str, Any]:
    return {"seconds": seconds, "step": step, "node": node, "stage": stage, "online": online,
            "serving": serving}  # fmt: skip


def synthetic_report(steps: int = 120) -> dict[str, Any]:
    """A 2-stage run of 4 nodes: n3 killed and back (downloading first), n2 moved from
    stage 0 to stage 1, a link limit set and withdrawn, with two codecs on the wire."""
    step_s = 0.05
    report: dict[str, Any] = {
        "format": "swarmpipe.testnet/1",
        "started_at": "2026-01-01T00:00:00+0000",
        "wall_seconds": steps * step_s + 5,
        "nodes": 4,
        "config": {
            "pipeline": {"stages": 2, "activation_codec": "auto", "gradient_codec": "lossless"}
        },
        "samples_per_second": 320.0,
        "final_loss": 2.5,
        "final_eval_loss": 2.6,
        "steps": [
            {
                "step": i,
                "loss": 5.0 - 2.5 * i / steps,
                "samples": 16,
                "seconds": step_s,
                "samples_per_second": 16 / step_s,
                "elapsed_s": (i + 1) * step_s,
                "seen_at_seconds": (i + 1) * step_s - 0.1,
            }
            for i in range(steps)
        ],
        "evals": [
            {"step": i, "loss": 5.1 - 2.5 * i / steps, "tokens": 2048, "elapsed_s": i * step_s}
            for i in range(0, steps, 20)
        ],
        "links": [
            link("n0", "n1", "activation", "lossless", 4_000_000),
            link("n0", "n1", "activation", "int8", 1_000_000),
            link("n1", "n0", "gradient", "lossless", 5_000_000),
            link("n1", "n3", "state", "lossless", 300_000),
        ],
        "counters": {"leased": 100, "committed": 100, "replayed": 4, "lost": 0},
        "members": [
            {"node_id": n, "stage": s, "online": False}
            for n, s in [("n0", 0), ("n1", 1), ("n2", 1), ("n3", 0)]
        ],
        "churn": [
            churn("kill", "n3", 1.0, 20, "killed"),
            churn("start", "n3", 2.0, 40, "started"),
            churn("kill", "", 2.5, 50, "skipped: no stage has 2"),
            churn("link", "n0", 3.0, 60, "limited to 2 Mbit/s", mbit=2.0),
            churn("link", "n0", 4.0, 80, "withdrawn"),
        ],
        "node_timeline": [
            *(change(-1.5, 0, n, s) for n, s in [("n0", 0), ("n1", 1), ("n2", 0), ("n3", 0)]),
            change(1.2, 21, "n3", 0, online=False, serving=False),
            change(2.5, 48, "n3", 0, serving=False),  # back, downloading its stage's state
            change(3.0, 58, "n3", 0),
            change(3.5, 70, "n2", 1),  # moved to stage 1
        ],
    }
    return report


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    # A blank or half-drawn figure of this size compresses to a few kB.
    assert 40_000 < len(data) < 2_000_000, len(data)


def test_draws_churn_and_a_stage_move(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "report.png"
    assert picture.write_picture(synthetic_report(), path) == path
    assert_png(path)
    assert capsys.readouterr().out == f"picture: {path}\n"


def test_draws_a_report_without_node_timeline_or_evals(tmp_path: Path) -> None:
    # Reports written before node_timeline existed, or a run with train.eval_every=0.
    report = synthetic_report()
    for key in ("node_timeline", "evals", "churn"):
        del report[key]
    picture.draw(report, tmp_path / "old.png")
    assert_png(tmp_path / "old.png")


def test_churn_and_timeline_move_onto_the_steps_clock() -> None:
    moved = picture._on_step_clock(synthetic_report())
    # Every step was seen 0.1 s "before" it ended: the testnet's clock started 0.1 s late.
    assert moved["churn"][0]["at_seconds"] == pytest.approx(1.1)
    assert moved["node_timeline"][-1]["seconds"] == pytest.approx(3.6)


def test_the_command_redraws_beside_the_report(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text(json.dumps(synthetic_report(1000)))
    assert picture.main([str(tmp_path / "report.json")]) == 0
    assert_png(tmp_path / "report.png")


def test_without_matplotlib_one_line_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes `import matplotlib...` raise ModuleNotFoundError, as when
    # the report extra is not installed.
    for name in [m for m in sys.modules if m.startswith("matplotlib")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    assert picture.write_picture(synthetic_report(), tmp_path / "report.png") is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "matplotlib is not installed" in out
    assert "pip install 'swarmpipe[report]'" in out
    assert not (tmp_path / "report.png").exists()
