"""Where a node's join token comes from: --token-file, $SWARMPIPE_TOKEN, --token (warned)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from swarmpipe.errors import ConfigError
from swarmpipe.node.main import TOKEN_ENV, join_token


def _args(token_file: str = "", token: str = "") -> argparse.Namespace:
    return argparse.Namespace(token_file=token_file, token=token)


def test_the_file_wins_then_the_environment_then_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "node.token"
    path.write_text("abc.file\n")
    monkeypatch.setenv(TOKEN_ENV, "abc.env")
    assert join_token(_args(str(path), "abc.flag")) == "abc.file"
    assert join_token(_args("", "abc.flag")) == "abc.env"
    monkeypatch.delenv(TOKEN_ENV)
    assert join_token(_args()) == ""


def test_a_token_on_the_command_line_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with caplog.at_level(logging.WARNING):
        assert join_token(_args("", "abc.flag")) == "abc.flag"
    assert "ps" in caplog.text


@pytest.mark.parametrize(("content", "words"), [(None, "No such file"), ("  \n", "is empty")])
def test_a_missing_or_empty_token_file_is_a_config_error(
    tmp_path: Path, content: str | None, words: str
) -> None:
    path = tmp_path / "node.token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=words):
        join_token(_args(str(path)))
