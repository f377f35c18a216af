"""`swarmpipe bench fuzz-decoders` refuses bad arguments in one line, before starting anything."""

from __future__ import annotations

import pytest

from swarmpipe.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--targets", "tensor-wire,nope"], "no fuzz target 'nope'; choose one of tensor-wire"),
        (["--targets", "codec:zip"], "no fuzz target 'codec:zip'"),
        (["--seconds", "0"], "--seconds must be > 0"),
        (["--timeout-s", "0"], "--timeout-s must be >= 1"),
    ],
)
def test_bad_arguments_are_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "fuzz-decoders", *args])
    text = str(exit_info.value.code)
    assert message in text
    assert "\n" not in text
    assert capsys.readouterr().out == ""  # no JSON, no fuzzing started
