"""Cutting the model into stages changes nothing: same parameters, same outputs, same gradients."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.errors import ConfigError
from swarmpipe.model import (
    build_full_model,
    build_stage,
    n_model_layers,
    stage_layer_ranges,
    stage_module_counts,
    token_loss_sum,
)

SMALL = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.context=16"]
HERE = str(Path(__file__).resolve().parent)


@pytest.mark.parametrize(
    ("layers", "stages"), [(6, 3), (8, 3), (5, 2), (3, 3), (10, 4), (1, 1), (7, 7), (9, 1)]
)
def test_stage_ranges_cover_every_layer_once_and_are_balanced(layers: int, stages: int) -> None:
    ranges = stage_layer_ranges(layers, stages)
    assert len(ranges) == stages and all(len(r) > 0 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(layers))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_extra_layers_go_to_the_middle_stages_first() -> None:
    assert [len(r) for r in stage_layer_ranges(8, 3)] == [3, 3, 2]
    assert [len(r) for r in stage_layer_ranges(7, 3)] == [2, 3, 2]


@pytest.mark.parametrize(("layers", "stages"), [(3, 4), (3, 0)])
def test_impossible_cuts_are_config_errors(layers: int, stages: int) -> None:
    with pytest.raises(ConfigError, match="cannot cut"):
        stage_layer_ranges(layers, stages)


@pytest.mark.parametrize("stages", [1, 2, 3, 6])
def test_stages_hold_the_full_models_parameters_and_compute_the_same(stages: int) -> None:
    config = load_config(None, [*SMALL, f"pipeline.stages={stages}"])
    full = build_full_model(config)
    parts = [build_stage(config, s) for s in range(stages)]
    assert [len(p) for p in parts] == [len(r) for r in stage_layer_ranges(6, stages)]
    full_params = list(full.named_parameters())
    stage_params = [p for part in parts for p in part.parameters()]
    assert len(full_params) == len(stage_params)
    for (_, a), b in zip(full_params, stage_params, strict=True):
        assert torch.equal(a, b)

    tokens = torch.randint(0, 256, (2, 16))
    labels = torch.randint(0, 256, (2, 16))
    x = tokens
    for part in parts:
        x = part(x)
    assert x.shape == (2, 16, 256)
    assert torch.equal(x, full(tokens))
    token_loss_sum(x, labels).backward()
    token_loss_sum(full(tokens), labels).backward()
    for (name, a), b in zip(full_params, stage_params, strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


def test_a_different_seed_gives_different_parameters() -> None:
    a = build_full_model(load_config(None, [*SMALL, "train.seed=0"]))
    b = build_full_model(load_config(None, [*SMALL, "train.seed=1"]))
    assert not torch.equal(next(a.parameters()), next(b.parameters()))


def test_a_stage_outside_the_pipeline_is_a_config_error() -> None:
    config = load_config(None, [*SMALL, "pipeline.stages=2"])
    with pytest.raises(ConfigError, match="outside"):
        build_stage(config, 2)


def test_user_factory_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(HERE)
    config = load_config(None, ["model.factory=user_factory_models:layers", "pipeline.stages=2"])
    assert n_model_layers(config) == 3
    assert [len(build_stage(config, s)) for s in range(2)] == [2, 1]
    # Seeded before the factory runs, so every node builds the same parameters.
    torch.manual_seed(12345)
    last = build_stage(config, 1)[0]
    assert isinstance(last, torch.nn.Linear)
    assert torch.equal(last.weight, build_full_model(config)[2].weight)
    other_seed = load_config(
        None, ["model.factory=user_factory_models:layers", "pipeline.stages=2", "train.seed=1"]
    )
    assert not torch.equal(last.weight, build_stage(other_seed, 1)[0].weight)
    # A factory with fewer layers than stages cannot be cut.
    with pytest.raises(ConfigError, match="cannot cut"):
        build_stage(load_config(None, [f"model.factory={config.model.factory}",
                                       "pipeline.stages=4"]), 0)  # fmt: skip


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("user_factory_models:not_a_list", "non-empty list.*got str"),
        ("user_factory_models:empty", "got an empty list"),
        ("user_factory_models:not_modules", "item 1 is a str"),
        ("user_factory_models:nothing", "has no function 'nothing'"),
        ("user_factory_models:NOT_CALLABLE", "has no function"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        (":f", "must look like"),
        ("user_factory_models:", "must look like"),
    ],
)
def test_bad_factories_are_config_errors(
    monkeypatch: pytest.MonkeyPatch, factory: str, message: str
) -> None:
    monkeypatch.syspath_prepend(HERE)
    config = load_config(None, [f"model.factory={factory}", "pipeline.stages=1"])
    with pytest.raises(ConfigError, match=message):
        build_full_model(config)
    with pytest.raises(ConfigError, match=message):
        build_stage(config, 0)


def test_loss_is_a_token_sum() -> None:
    logits = torch.zeros(2, 3, 4)
    labels = torch.zeros(2, 3, dtype=torch.long)
    assert abs(float(token_loss_sum(logits, labels)) - 6 * math.log(4.0)) < 1e-5
    # Half-precision logits are summed in fp32.
    assert token_loss_sum(logits.half(), labels).dtype == torch.float32


@pytest.mark.parametrize(
    "settings",
    [
        ["pipeline.stages=1"],
        ["pipeline.stages=3"],
        ["pipeline.stages=4", "model.n_layers=3"],
        ["pipeline.stages=3", "model.bottleneck=4"],
        ["pipeline.stages=2", "model.factory=user_factory_models:layers"],
    ],
)
def test_stage_module_counts_cut_the_whole_model_as_the_stages_do(
    monkeypatch: pytest.MonkeyPatch, settings: list[str]
) -> None:
    # The exported model's names depend on it: stage s's module i is module sum(counts[:s]) + i.
    monkeypatch.syspath_prepend(HERE)
    config = load_config(None, settings)
    counts = stage_module_counts(config)
    assert counts == [len(build_stage(config, s)) for s in range(config.pipeline.stages)]
    assert sum(counts) == len(build_full_model(config))
