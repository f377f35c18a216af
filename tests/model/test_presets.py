"""Named shapes of the built-in GPT, and the cost model that cuts them into equal stages."""

from __future__ import annotations

import itertools
import random

import pytest

from swarmpipe.config import MODEL_PRESETS, ModelConfig, RunConfig, load_config
from swarmpipe.errors import ConfigError
from swarmpipe.model import build_full_model, build_stage
from swarmpipe.model.gpt import build_gpt_layer
from swarmpipe.model.stage_cost import balanced_ranges, gpt_layer_costs, gpt_stage_ranges

EXACT = {"tiny": 1_065_344, "small": 85_645_824, "medium": 353_482_752}


def _parameters(cfg: ModelConfig) -> int:
    """The whole model's parameter count, building one block instead of all of them."""

    def count(index: int) -> int:
        return sum(p.numel() for p in build_gpt_layer(cfg, index, 0).parameters())

    return count(0) + cfg.n_layers * count(1) + count(cfg.n_layers + 1)


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_each_preset_has_the_parameters_its_documentation_states(preset: str) -> None:
    cfg = load_config(None, [f"model.preset={preset}"]).model
    assert {k: getattr(cfg, k) for k in MODEL_PRESETS[preset]} == MODEL_PRESETS[preset]
    assert _parameters(cfg) == EXACT[preset]


def test_the_tiny_preset_builds_whole_and_in_stages_alike() -> None:
    cfg = load_config(None, ["model.preset=tiny", "pipeline.stages=3"])
    whole = sum(p.numel() for p in build_full_model(cfg).parameters())
    parts = sum(p.numel() for s in range(3) for p in build_stage(cfg, s).parameters())
    assert whole == parts == EXACT["tiny"]


def test_a_preset_survives_the_trip_to_the_nodes_as_json() -> None:
    cfg = load_config(None, ["model.preset=small"])
    assert RunConfig.from_json(cfg.to_json()) == cfg


def test_a_field_beside_a_preset_must_agree_with_it() -> None:
    assert load_config(None, ["model.preset=small", "model.n_layers=12"]).model.n_layers == 12
    with pytest.raises(ConfigError, match=r"n_layers=3 conflicts with model\.preset='small'"):
        load_config(None, ["model.preset=small", "model.n_layers=3"])
    with pytest.raises(ConfigError, match=r"model\.preset='huge' does not exist; use one of tiny"):
        load_config(None, ["model.preset=huge"])


def _brute_force_max(costs: list[int], stages: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def test_the_cut_minimises_the_most_expensive_stage() -> None:
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 9))]
        stages = rng.randint(1, len(costs))
        ranges = balanced_ranges(costs, stages)
        assert [i for r in ranges for i in r] == list(range(len(costs)))
        assert all(len(r) for r in ranges)
        assert max(sum(costs[i] for i in r) for r in ranges) == _brute_force_max(costs, stages)


def test_the_default_model_is_cut_by_compute_not_by_layer_count() -> None:
    # 6 blocks, an embedding that costs little and a head that costs a sixth of a block:
    # equal counts (3, 3, 2 layers) gave the middle stage 3 blocks; compute gives 2 each.
    cfg = ModelConfig()
    assert [len(r) for r in gpt_stage_ranges(cfg, 3)] == [3, 2, 3]
    costs = gpt_layer_costs(cfg)
    assert costs[0] < costs[-1] < costs[1]
    with pytest.raises(ConfigError, match="cannot cut 8 layers into 9 stages"):
        gpt_stage_ranges(cfg, 9)
