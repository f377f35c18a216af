"""The DiLoCo outer step: replicas that trained apart end the round bit-identical."""

from __future__ import annotations

import torch

from swarmpipe.config import load_config
from swarmpipe.node.diloco import OuterOptimizer
from swarmpipe.node.stage_runtime import StageRuntime

TINY = ["model.n_layers=2", "model.d_model=16", "model.n_heads=2", "model.context=8"]


def _diloco(*extra: str) -> StageRuntime:
    config = load_config(
        None, [*TINY, "pipeline.stages=1", "pipeline.sync=diloco", "train.steps=4", *extra]
    )
    return StageRuntime(config, 0)


def _train_locally(runtime: StageRuntime, seed: int, steps: int) -> None:
    """Inner steps on this replica's own data only."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 8), generator=g)
        labels = torch.randint(0, 256, (2, 8), generator=g)
        runtime.forward_last(f"{runtime.step}:{seed}", tokens, labels)
        runtime.apply_step(runtime.step)


def test_replicas_that_diverged_end_the_round_identical() -> None:
    a, b = _diloco(), _diloco()
    assert a.parameter_digest() == b.parameter_digest()  # same seed, same start
    _train_locally(a, seed=1, steps=2)
    _train_locally(b, seed=2, steps=2)
    assert a.parameter_digest() != b.parameter_digest()
    assert a.outer is not None and a.outer.round_samples == 4
    contributions = [a.parameter_delta(), b.parameter_delta()]
    total = (
        contributions[0][0] + contributions[1][0],
        0,
        contributions[0][2] + contributions[1][2],
    )
    a.outer_step(a.step - 1, total)
    b.outer_step(b.step - 1, total)
    assert a.parameter_digest() == b.parameter_digest()
    assert a.outer.round_samples == 0


def test_outer_step_with_lr_one_and_no_momentum_is_the_weighted_average() -> None:
    first = torch.nn.Parameter(torch.zeros(3))
    outer = OuterOptimizer([first], lr=1.0, momentum=0.0)
    with torch.no_grad():
        first.copy_(torch.tensor([1.0, 2.0, 3.0]))
    outer.round_samples = 3
    mine, samples = outer.local_delta()  # anchor 0 - current
    other = torch.tensor([-2.0, -2.0, -2.0]) * 1.0  # a replica at +2 that trained 1 sample
    outer.step(mine + other, samples + 1)
    want = (3 * torch.tensor([1.0, 2.0, 3.0]) + 1 * torch.tensor([2.0, 2.0, 2.0])) / 4
    assert torch.allclose(first.detach(), want)


def test_nesterov_momentum_carries_into_the_next_round() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    outer = OuterOptimizer([p], lr=0.5, momentum=0.9)
    delta = torch.tensor([-1.0])  # every round the replicas moved +1
    outer.step(delta, 1)
    after_one = float(p.detach())
    assert abs(after_one - 0.5 * (1 + 0.9)) < 1e-6
    outer.step(delta, 1)
    velocity = 0.9 * 1 + 1
    assert abs(float(p.detach()) - (after_one + 0.5 * (1 + 0.9 * velocity))) < 1e-6


def test_round_ends_every_h_steps_and_at_the_last_step() -> None:
    runtime = _diloco("pipeline.diloco_inner_steps=3", "train.steps=7")
    assert [s for s in range(7) if runtime.outer_round_ends(s)] == [2, 5, 6]
