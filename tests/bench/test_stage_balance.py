"""`swarmpipe bench stage-balance` runs and reports both cuts; the figures are not asserted."""

from __future__ import annotations

import argparse
import json

import pytest

from swarmpipe.bench import stage_balance
from swarmpipe.errors import ConfigError


def _args(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    stage_balance.add_arguments(parser)
    return parser.parse_args(list(words))


def test_both_cuts_are_timed_and_the_cost_cut_is_predicted_more_even(
    capsys: pytest.CaptureFixture[str],
) -> None:
    small = ["--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.context=16"]
    assert stage_balance.serve(_args(*small, "--repeats", "1", "--microbatch", "2")) == 0
    report = json.loads(capsys.readouterr().out)
    cost, equal = report["cost_model"], report["equal_layers"]
    assert cost["layers"] == [[0, 3], [3, 5], [5, 8]]
    assert equal["layers"] == [[0, 3], [3, 6], [6, 8]]
    assert len(cost["seconds"]) == len(equal["seconds"]) == 3
    assert max(cost["predicted_share"]) < max(equal["predicted_share"])
    assert {"model_error", "speedup_bound", "device"} <= set(report)


def test_a_bottleneck_model_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="without a bottleneck"):
        stage_balance.serve(_args("--set", "model.bottleneck=8"))
