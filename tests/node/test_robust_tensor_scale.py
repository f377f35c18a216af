"""The tensor-scale screen: noise has the same RMS in every tensor, real gradients do not."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from swarmpipe.config import ConfigError, RobustConfig, load_config
from swarmpipe.model import build_stage, token_loss_sum
from swarmpipe.node.hostile import Hostile
from swarmpipe.node.robust_reduce import (
    Aggregate,
    Contribution,
    aggregate,
    flatness_sigmas,
    tensor_mean_squares,
)

# The tests' model (tests/conftest.py TINY), one stage: 53 tensors, 68 288 parameters.
MODEL = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.context=32"]


@pytest.fixture(scope="module")
def model() -> tuple[list[int], list[Contribution]]:
    """The tensor sizes and four real gradient sums (4 samples each) at initialisation:
    step 0, where nothing but the gradients themselves can judge."""
    # The stage module alone, as StageRuntime builds it (the runtime's device probe is slow).
    module = build_stage(load_config(None, [*MODEL, "pipeline.stages=1"]), 0)
    sizes = [p.numel() for p in module.parameters()]
    g = torch.Generator().manual_seed(0)
    gradients = []
    for _ in range(4):
        x = torch.randint(0, 256, (4, 32), generator=g)
        y = torch.randint(0, 256, (4, 32), generator=g)
        module.zero_grad(set_to_none=True)
        token_loss_sum(module(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
        gradients.append((flat.detach().clone(), y.numel(), 4))
    return sizes, gradients


def _judge(
    contributions: dict[str, Contribution], sizes: list[int] | None, **screens: Any
) -> Aggregate:
    """The aggregate as the nodes take it, with the tensor-scale screen at its default."""
    settings: dict[str, Any] = {"tensor_sigmas": 10.0, **screens}
    return aggregate(
        contributions,
        per="tokens",
        norm_ratio=10.0,
        clip_radius=1.0,
        clip_iterations=3,
        sizes=sizes,
        **settings,
    )


def _noise(c: Contribution, node: str = "x", step: int = 0) -> Contribution:
    """What `SWARMPIPE_HOSTILE=noise` sends in place of the gradient `c`."""
    return Hostile("noise").tamper(c[0], node_id=node, step=step), c[1], c[2]


def test_noise_beside_one_honest_gradient_is_dropped_at_step_0(
    model: tuple[list[int], list[Contribution]],
) -> None:
    # Two with traffic and no optimizer moments: the direction and profile screens cannot
    # tell which of two unrelated vectors is the noise; the tensors' scales can.
    sizes, (a, b, *_) = model
    idle = (torch.zeros_like(a[0]), 0, 0)
    pair = {"a": a, "idle": idle, "x": _noise(b)}
    for direction in (0.0, 3.0):
        result = _judge(pair, sizes, direction_sigmas=direction)
        assert set(result.rejected) == {"x"}
        assert "53 parameter tensors have as equal a root-mean-square" in result.rejected["x"]
        assert "while a's differ" in result.rejected["x"]
        assert torch.equal(result.total[0], torch.zeros_like(a[0]) + a[0])
        assert result.total[1:] == a[1:]
    # Off (0), or without the tensors' sizes (DiLoCo deltas), nothing judges it.
    assert _judge(pair, sizes, tensor_sigmas=0.0).rejected == {}
    assert _judge(pair, None).rejected == {}


def test_honest_gradients_all_pass_and_sit_far_above_noise(
    model: tuple[list[int], list[Contribution]],
) -> None:
    sizes, gradients = model
    honest = dict(zip("abcd", gradients, strict=True))
    assert _judge(honest, sizes).rejected == {}
    for c in gradients:
        z = flatness_sigmas(tensor_mean_squares(c[0], sizes), sizes)
        assert z is not None and z > 100
        noise = flatness_sigmas(tensor_mean_squares(_noise(c)[0], sizes), sizes)
        assert noise is not None and abs(noise) < 10


def test_noise_among_three_is_dropped_and_the_clip_takes_the_rest(
    model: tuple[list[int], list[Contribution]],
) -> None:
    sizes, (a, b, c, d) = model
    result = _judge({"a": a, "b": b, "c": c, "x": _noise(d)}, sizes)
    assert set(result.rejected) == {"x"} and result.accepted == ("a", "b", "c")
    assert result.total[1] == a[1] + b[1] + c[1]
    # Honest gradients beside it show what honest looks like: the coordinator may bench at once.
    assert result.conclusive == ("x",)


def test_a_step_whose_contributions_are_all_flat_drops_nobody(
    model: tuple[list[int], list[Contribution]],
) -> None:
    # Nothing shows that honest tensors differ in scale here (a model whose do not would
    # look like this): nobody is dropped, as the direction screen does without evidence.
    sizes, (a, b, *_) = model
    flat = {"x": _noise(a, "x"), "y": _noise(b, "y")}
    assert _judge(flat, sizes).rejected == {}


def test_a_lone_contribution_is_judged_beside_the_second_moment_or_by_the_bound_alone(
    model: tuple[list[int], list[Contribution]],
) -> None:
    # The fastest replica leases what it can: a step's only traffic can be the hostile one's.
    sizes, (a, b, *_) = model
    idle = (torch.zeros_like(a[0]), 0, 0)
    alone = {"i": idle, "x": _noise(b)}
    second_moment = 0.05 * a[0].square() / a[1] ** 2  # what AdamW keeps after one step
    result = _judge(alone, sizes, profile=second_moment)
    assert set(result.rejected) == {"x"}
    assert "while the optimizer second moment's differ" in result.rejected["x"]
    assert result.total[1] == 0  # the step applies nothing
    assert result.conclusive == ("x",)
    # At step 0 nothing is beside it: the bound alone judges, and honest ones pass; with no
    # witness the verdict is not conclusive (a bench takes a second one).
    first = _judge(alone, sizes)
    assert set(first.rejected) == {"x"} and "nothing else at this step" in first.rejected["x"]
    assert first.conclusive == ()
    assert _judge({"i": idle, "b": b}, sizes).rejected == {}
    assert _judge({"b": b}, sizes, profile=second_moment).rejected == {}


def test_zeroing_tensors_does_not_make_noise_look_uneven(
    model: tuple[list[int], list[Contribution]],
) -> None:
    sizes, (a, b, *_) = model
    noise, tokens, samples = _noise(b)
    noise = noise.clone()
    noise[: sizes[0] + sizes[1]] = 0  # the embeddings, the largest tensors
    result = _judge({"a": a, "x": (noise, tokens, samples)}, sizes)
    assert set(result.rejected) == {"x"}
    # With a single nonzero tensor there is nothing to compare: not judged.
    lone = torch.zeros_like(noise)
    lone[-sizes[-1] :] = 1.0
    assert flatness_sigmas(tensor_mean_squares(lone, sizes), sizes) is None


def test_the_verdict_is_the_same_in_any_insertion_order(
    model: tuple[list[int], list[Contribution]],
) -> None:
    sizes, (a, b, c, d) = model
    contributions = {"a": a, "b": b, "c": c, "x": _noise(d), "y": (d[0] * 1000, *d[1:])}
    reference = _judge(contributions, sizes)
    assert set(reference.rejected) == {"x", "y"}
    names = list(contributions)
    for seed in range(3):
        random.Random(seed).shuffle(names)
        shuffled = {n: (contributions[n][0].clone(), *contributions[n][1:]) for n in names}
        result = _judge(shuffled, sizes)
        assert torch.equal(result.total[0], reference.total[0])
        assert result.rejected == reference.rejected and result.accepted == reference.accepted


def test_noise_of_the_models_tensor_sizes_stays_within_a_few_sigma(
    model: tuple[list[int], list[Contribution]],
) -> None:
    # The statistic is about N(0, 1) for isotropic noise (chi-squared with 52 degrees of
    # freedom, standardised): 40 seeded draws stay far inside the bound of 10.
    sizes, (a, *_) = model
    draws = [
        flatness_sigmas(tensor_mean_squares(_noise(a, "x", step)[0], sizes), sizes)
        for step in range(40)
    ]
    assert all(z is not None and abs(z) < 5 for z in draws)
    assert 0.3 < sum(abs(z) for z in draws if z is not None) / len(draws) < 1.5


def test_sizes_that_do_not_cut_the_vector_are_refused(
    model: tuple[list[int], list[Contribution]],
) -> None:
    _, (a, *_) = model
    with pytest.raises(ValueError, match="tensor sizes sum to 10 but the contribution has"):
        tensor_mean_squares(a[0], [5, 5])


def test_config_refuses_a_negative_bound() -> None:
    with pytest.raises(ConfigError, match=r"robust\.tensor_sigmas must be >= 0"):
        RobustConfig(tensor_sigmas=-1.0)
    assert RobustConfig().tensor_sigmas == 10.0


def test_honest_replicas_take_the_plain_mean_whoever_got_which_microbatch(
    model: tuple[list[int], list[Contribution]],
) -> None:
    # At the default radius nothing honest is clipped, so the step is single-process
    # training's, and two clean runs that dealt their microbatches differently agree.
    sizes, grads = model
    radius = RobustConfig().clip_radius

    def dealt(*groups: tuple[int, ...]) -> dict[str, Contribution]:
        return {
            f"n{i}": (
                sum((grads[k][0] for k in group), torch.zeros_like(grads[0][0])),
                sum(grads[k][1] for k in group),
                sum(grads[k][2] for k in group),
            )
            for i, group in enumerate(groups)
        }

    plain = sum((g[0] for g in grads), torch.zeros_like(grads[0][0]))
    for groups in [((0, 1), (2,), (3,)), ((0,), (1, 2), (3,)), ((3,), (0,), (1, 2))]:
        result = aggregate(
            dealt(*groups),
            per="tokens",
            norm_ratio=10.0,
            clip_radius=radius,
            clip_iterations=3,
            sizes=sizes,
            tensor_sigmas=10.0,
        )
        assert result.rejected == {} and result.clipped == ()
        assert result.total[1] == sum(g[1] for g in grads)
        torch.testing.assert_close(result.total[0], plain, rtol=1e-4, atol=1e-7)
