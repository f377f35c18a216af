"""The figures a node reports for placement before it is measured."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swarmpipe.config import RunConfig, load_config
from swarmpipe.node import calibration
from swarmpipe.node.stage_runtime import StageRuntime


def _config(*extra: str) -> RunConfig:
    return load_config(
        None,
        [
            "model.n_layers=4",
            "model.d_model=32",
            "model.n_heads=2",
            "model.context=16",
            "pipeline.stages=3",
            "train.microbatch=2",
            *extra,
        ],
    )


@pytest.mark.parametrize("extra", [(), ("model.bottleneck=8",)])
def test_a_calibration_pass_runs_every_stage_and_leaves_its_state_alone(
    extra: tuple[str, ...],
) -> None:
    config = _config(*extra)
    for stage in range(3):
        runtime = StageRuntime(config, stage)
        before = runtime.parameter_digest()
        made = calibration.calibration_inputs(runtime)
        assert made is not None
        calibration.calibration_pass(runtime, *made)
        assert all(p.grad is None for p in runtime.module.parameters())
        assert runtime.parameter_digest() == before and runtime.saved_count == 0


def test_stage_costs_follow_the_layers_a_stage_holds() -> None:
    config = _config()
    flops = [calibration.stage_flops_per_sample(StageRuntime(config, s)) for s in range(3)]
    # Stage 1 holds two blocks, the others one each beside the embedding or the head.
    block = 12 * 32 * 32 * 6 * 16  # 12 d^2 weights per block, 6 multiply-adds, 16 tokens
    assert flops[1] == pytest.approx(2 * block, rel=0.01)
    assert flops[0] < flops[1] and flops[2] > flops[0]  # the head's vocabulary matmul
    runtime = StageRuntime(config, 1)
    params = sum(p.numel() for p in runtime.module.parameters())
    assert calibration.stage_state_bytes(runtime) == 3 * 4 * params


def test_a_factory_stage_past_the_first_has_no_known_input_shape() -> None:
    config = _config()
    runtime = StageRuntime(config, 1)
    runtime.config = replace(config, model=replace(config.model, factory="pkg.mod:layers"))
    assert calibration.calibration_inputs(runtime) is None
