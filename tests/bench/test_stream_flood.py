"""`swarmpipe bench stream-flood`: one peer's streams to a real node, with the per-peer limits
and without."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmpipe.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--streams", "0"], "--streams must be >= 1"), (["--open-timeout-s", "0"], "must be > 0")],
)
def test_bad_arguments_are_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "stream-flood", *args])
    text = str(exit_info.value.code)
    assert message in text and "\n" not in text
    assert capsys.readouterr().out == ""


@pytest.mark.slow  # starts a coordinator and a node twice
@pytest.mark.timeout(300)
def test_the_limited_node_holds_only_its_limit_open(tmp_path: Path) -> None:
    out = tmp_path / "flood.json"
    code = main(
        ["bench", "stream-flood", "--streams", "120", "--out", str(out),
         "--set", "pipeline.peer_max_streams=30"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    limited, unlimited = report["sides"]["limited"], report["sides"]["unlimited"]
    assert limited["codes"] == {"OPEN": 30, "RESOURCE_EXHAUSTED": 90}
    assert "peer_max_streams=30" in limited["details_by_code"]["RESOURCE_EXHAUSTED"]
    assert unlimited["codes"] == {"OPEN": 120}
    assert limited["node"]["alive"] and unlimited["node"]["alive"]
