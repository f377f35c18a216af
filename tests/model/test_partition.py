"""Cutting the GPT into stages changes nothing: same parameters, same outputs."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch import nn

from swarmpipe.config import ModelConfig, load_config
from swarmpipe.errors import ConfigError
from swarmpipe.model import build_full_model, build_stage, stage_layer_ranges, token_loss_sum

SMALL = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.context=16"]


@pytest.mark.parametrize(("layers", "stages"), [(6, 3), (8, 3), (5, 2), (3, 3), (10, 4), (1, 1)])
def test_stage_ranges_cover_every_layer_once(layers: int, stages: int) -> None:
    ranges = stage_layer_ranges(layers, stages)
    assert len(ranges) == stages and all(len(r) > 0 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(layers))


def test_too_many_stages_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        stage_layer_ranges(3, 4)


def test_stages_hold_the_full_models_parameters_and_compute_the_same() -> None:
    config = load_config(None, [*SMALL, "pipeline.stages=3"])
    full = build_full_model(config)
    stages = [build_stage(config, s) for s in range(3)]
    full_params = [p for p in full.parameters()]
    stage_params = [p for st in stages for p in st.parameters()]
    assert len(full_params) == len(stage_params)
    for a, b in zip(full_params, stage_params, strict=True):
        assert torch.equal(a, b)
    tokens = torch.randint(0, 256, (2, 16))
    x = tokens
    for st in stages:
        x = st(x)
    assert torch.equal(x, full(tokens))
    assert x.shape == (2, 16, 256)


def test_a_different_seed_gives_different_parameters() -> None:
    a = build_full_model(load_config(None, [*SMALL, "train.seed=0"]))
    b = build_full_model(load_config(None, [*SMALL, "train.seed=1"]))
    assert not torch.equal(next(a.parameters()), next(b.parameters()))


def _user_layers(cfg: ModelConfig) -> list[nn.Module]:
    return [nn.Embedding(cfg.vocab, 8), nn.Linear(8, 8), nn.Linear(8, cfg.vocab)]


def test_user_factory_models(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("user_models")
    module.layers = _user_layers  # type: ignore[attr-defined]
    module.broken = lambda cfg: "not a list"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_models", module)
    config = load_config(None, ["model.factory=user_models:layers", "pipeline.stages=2"])
    assert [len(build_stage(config, s)) for s in range(2)] == [2, 1]
    # Seeded before the factory runs, so every node builds the same parameters.
    assert torch.equal(build_stage(config, 1)[0].weight, build_full_model(config)[2].weight)
    with pytest.raises(ConfigError, match="non-empty list"):
        build_full_model(load_config(None, ["model.factory=user_models:broken"]))
    with pytest.raises(ConfigError, match="has no function"):
        build_full_model(load_config(None, ["model.factory=user_models:nothing"]))
    with pytest.raises(ConfigError, match="cannot import"):
        build_full_model(load_config(None, ["model.factory=no_such_module_xyz:f"]))


def test_loss_is_a_token_sum() -> None:
    logits = torch.zeros(2, 3, 4)
    labels = torch.zeros(2, 3, dtype=torch.long)
    assert abs(float(token_loss_sum(logits, labels)) - 6 * math.log(4.0)) < 1e-5
