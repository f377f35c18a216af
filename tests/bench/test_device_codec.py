"""`swarmpipe bench device-codec` runs on the CPU too and refuses bad input in one line."""

from __future__ import annotations

import argparse
import json

import pytest

from swarmpipe.bench import device_codec
from swarmpipe.errors import ConfigError


def _args(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    device_codec.add_arguments(parser)
    return parser.parse_args(list(words))


@pytest.mark.slow  # seconds of codec warm-up on a loaded CPU
def test_it_times_encode_decode_and_both_copies(capsys: pytest.CaptureFixture[str]) -> None:
    words = ["--device", "cpu", "--shape", "16,64,64", "--repeats", "1"]
    assert device_codec.serve(_args(*words)) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["results"]
    assert report["device"] == "cpu" and row["shape"] == [16, 64, 64]
    assert set(row["gb_per_s"]) == {"encode", "decode", "copy_to_host", "copy_to_host_pageable"}
    assert row["payload_mib"] < row["tensor_mib"]  # int8 codes, a quarter of fp32 plus scales


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["--codec", "int9"], "unknown codec 'int9'"),
        (["--shape", "4,x"], "--shape '4,x': give sizes like"),
        (["--shape", "4,0"], "every size must be >= 1"),
        (["--device", "tpu"], "--device 'tpu' is not a device"),
    ],
)
def test_bad_input_is_one_config_error(words: list[str], said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")) as caught:
        device_codec.serve(_args(*words))
    assert "\n" not in str(caught.value)
