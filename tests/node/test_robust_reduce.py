"""The robust aggregate: screens, centred clip, determinism, and the plain sum it keeps."""

from __future__ import annotations

import random

import pytest
import torch

from swarmpipe.node.robust_reduce import Contribution, aggregate, centred_clip, plain_sum, screen

KW = {"norm_ratio": 10.0, "clip_radius": 1.0, "clip_iterations": 3}


def _honest(seed: int, n: int = 1000, tokens: int = 64) -> Contribution:
    """A gradient sum over `tokens` tokens: a shared direction plus per-replica noise."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.linspace(-1, 1, n)
    per_token = direction + 0.5 * torch.randn(n, generator=g)
    return per_token * tokens, tokens, tokens // 8


def _three() -> dict[str, Contribution]:
    return {"a": _honest(1), "b": _honest(2, tokens=32), "c": _honest(3, tokens=96)}


def test_a_non_finite_contribution_is_dropped_and_named() -> None:
    bad = _honest(4)[0].clone()
    bad[7] = float("nan")
    contributions = {**_three(), "d": (bad, 64, 8)}
    result = aggregate(contributions, per="tokens", **KW)
    assert set(result.rejected) == {"d"} and "NaN" in result.rejected["d"]
    assert result.accepted == ("a", "b", "c")
    inf = _honest(5)[0].clone()
    inf[0] = float("inf")
    assert (
        "infinite"
        in screen({"a": _honest(1), "x": (inf, 64, 8)}, per="tokens", norm_ratio=10).rejected["x"]
    )


def test_a_scaled_contribution_fails_the_median_bound_even_with_two_replicas() -> None:
    honest = _honest(1)
    scaled = (_honest(2)[0] * 1000, 64, 8)
    two = aggregate({"a": honest, "x": scaled}, per="tokens", **KW)
    assert set(two.rejected) == {"x"} and "the bound is 10x" in two.rejected["x"]
    assert torch.equal(two.total[0], honest[0]) and two.total[1:] == (64, 8)
    three = aggregate({**_three(), "x": scaled}, per="tokens", **KW)
    assert set(three.rejected) == {"x"}
    # The divisor loses the dropped sender's tokens.
    assert three.total[1] == 64 + 32 + 96
    # x1000 is far past what honest gradients reach (26x): conclusive. 20x is not.
    assert two.conclusive == three.conclusive == ("x",)
    odd = (_honest(2)[0] * 20, 64, 8)
    twenty = aggregate({**_three(), "x": odd}, per="tokens", **KW)
    assert set(twenty.rejected) == {"x"} and twenty.conclusive == ()


def test_norms_are_compared_per_token_so_uneven_traffic_passes() -> None:
    # c saw 12x the tokens of b: its raw sum is about 12x larger, its per-token norm is not.
    contributions = {
        "a": _honest(1, tokens=64),
        "b": _honest(2, tokens=8),
        "c": _honest(3, tokens=96),
    }
    assert screen(contributions, per="tokens", norm_ratio=10).rejected == {}


def test_an_inflated_token_count_is_dropped() -> None:
    flat, _, samples = _honest(4)
    liar = (flat * 1000, 64_000, samples)  # normal per-token norm, 1000x the weight
    rejected = screen({**_three(), "x": liar}, per="tokens", norm_ratio=10).rejected
    assert set(rejected) == {"x"} and "claims 64000 tokens" in rejected["x"]


def test_a_nonzero_sum_over_no_tokens_is_dropped_and_an_idle_replica_is_not() -> None:
    idle = (torch.zeros(1000), 0, 0)
    forged = (torch.ones(1000), 0, 0)
    rejected = screen({**_three(), "idle": idle, "x": forged}, per="tokens", norm_ratio=10).rejected
    assert set(rejected) == {"x"}


def test_one_or_two_contributions_are_the_plain_sum_bit_for_bit() -> None:
    a, b = _honest(1), _honest(2, tokens=32)
    one = aggregate({"a": a}, per="tokens", **KW)
    assert torch.equal(one.total[0], a[0]) and one.rejected == {}
    two = aggregate({"b": b, "a": a}, per="tokens", **KW)
    assert torch.equal(two.total[0], torch.zeros(1000) + a[0] + b[0])
    assert two.total[1:] == (96, 12) and two.clipped == ()


def test_the_centred_clip_of_close_contributions_is_their_weighted_mean() -> None:
    contributions = _three()
    (total, tokens, _), _ = centred_clip(contributions, per="tokens", radius=100.0, iterations=3)
    plain, plain_tokens, _ = plain_sum(contributions)
    assert tokens == plain_tokens
    torch.testing.assert_close(total, plain, rtol=1e-5, atol=1e-3)


def test_the_centred_clip_bounds_the_pull_of_noise_of_a_plausible_norm() -> None:
    honest = _three()
    flat, tokens, samples = _honest(9)
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    noise = noise * (flat.norm() / noise.norm())
    poisoned = {**honest, "x": (noise, tokens, samples)}
    assert screen(poisoned, per="tokens", norm_ratio=10).rejected == {}  # it passes the norm screen
    result = aggregate(poisoned, per="tokens", **KW)
    assert "x" in result.clipped
    clean_mean = plain_sum(honest)[0] / plain_sum(honest)[1]
    robust_mean = result.total[0] / result.total[1]
    naive = plain_sum(poisoned)
    naive_mean = naive[0] / naive[1]
    assert (robust_mean - clean_mean).norm() < (naive_mean - clean_mean).norm()


def test_the_aggregate_is_bit_identical_in_any_insertion_order_and_on_repeat() -> None:
    contributions = {**_three(), "d": _honest(4), "x": (_honest(5)[0] * 1000, 64, 8)}
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 300
    contributions["y"] = (noise, 64, 8)
    reference = aggregate(contributions, per="tokens", direction_sigmas=3.0, **KW)
    names = list(contributions)
    for seed in range(5):
        random.Random(seed).shuffle(names)
        shuffled = {n: (contributions[n][0].clone(), *contributions[n][1:]) for n in names}
        result = aggregate(shuffled, per="tokens", direction_sigmas=3.0, **KW)
        assert torch.equal(result.total[0], reference.total[0])
        assert result.total[1:] == reference.total[1:]
        assert result.rejected == reference.rejected and result.accepted == reference.accepted


def test_diloco_deltas_are_compared_per_sample() -> None:
    # A DiLoCo contribution is a delta scaled by its samples, with no tokens.
    a = (torch.full((100,), 0.01) * 10, 0, 10)
    b = (torch.full((100,), 0.012) * 40, 0, 40)
    c = (torch.full((100,), 0.011) * 20, 0, 20)
    x = (torch.full((100,), 5.0) * 10, 0, 10)
    result = aggregate({"a": a, "b": b, "c": c, "x": x}, per="samples", **KW)
    assert set(result.rejected) == {"x"} and "per sample" in result.rejected["x"]
    assert result.total[2] == 70


@pytest.mark.parametrize("bad_ratio", [0.5, 1.0])
def test_config_refuses_a_ratio_that_is_not_above_one(bad_ratio: float) -> None:
    from swarmpipe.config import ConfigError, RobustConfig

    with pytest.raises(ConfigError, match="reduce_norm_ratio must be > 1"):
        RobustConfig(reduce_norm_ratio=bad_ratio)


def test_an_idle_replica_does_not_turn_two_contributions_into_a_clip() -> None:
    a, b = _honest(1), _honest(2, tokens=32)
    result = aggregate({"a": a, "b": b, "idle": (torch.zeros(1000), 0, 0)}, per="tokens", **KW)
    assert result.accepted == ("a", "b", "idle") and result.clipped == ()
    assert torch.equal(result.total[0], torch.zeros(1000) + a[0] + b[0])


def test_noise_of_a_plausible_norm_fails_the_direction_screen_and_honest_ones_pass() -> None:
    honest = _three()
    flat, tokens, samples = _honest(9)
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    noise = noise * (flat.norm() / noise.norm())
    poisoned = {**honest, "x": (noise, tokens, samples)}
    result = aggregate(poisoned, per="tokens", direction_sigmas=3.0, **KW)
    assert set(result.rejected) == {"x"}
    assert "as unrelated to every other replica" in result.rejected["x"]
    assert aggregate(honest, per="tokens", direction_sigmas=3.0, **KW).rejected == {}
    # A sign-flipped gradient is related to the others (negatively): left to the clip.
    flipped = {**honest, "x": (-_honest(9)[0], tokens, samples)}
    assert screen(flipped, per="tokens", norm_ratio=10, direction_sigmas=3.0).rejected == {}
    assert "x" in aggregate(flipped, per="tokens", direction_sigmas=3.0, **KW).clipped


def _noise_like(c: Contribution, seed: int = 7) -> Contribution:
    flat, tokens, samples = c
    noise = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(seed))
    return noise * (flat.norm() / noise.norm()), tokens, samples


def test_two_with_traffic_are_judged_only_beside_a_momentum_they_can_relate_to() -> None:
    # One replica idle (4 microbatches among 3 replicas often leaves one so): the noise came
    # into the plain sum of the other two at steps 0 and 1 of `bench hostile`.
    momentum = torch.linspace(-1, 1, 1000)  # the shared direction of the recent gradients
    idle = (torch.zeros(1000), 0, 0)
    pair = {"a": _honest(1), "idle": idle, "x": _noise_like(_honest(2))}
    kw = {"per": "tokens", "direction_sigmas": 3.0, **KW}
    result = aggregate(pair, reference=momentum, **kw)  # type: ignore[arg-type]
    assert set(result.rejected) == {"x"} and "gradient momentum" in result.rejected["x"]
    assert result.accepted == ("a", "idle") and torch.equal(result.total[0], pair["a"][0])
    # Without a momentum (step 0) either could be the odd one: nobody is judged.
    assert aggregate(pair, **kw).rejected == {}  # type: ignore[arg-type]
    # Two honest ones unrelated to each other and to the momentum (small batches of a sparse
    # stage): no pair shows what relation looks like at this step, so nobody is dropped.
    unrelated = {"a": _noise_like(_honest(1), 3), "b": _noise_like(_honest(2), 4)}
    assert aggregate(unrelated, reference=momentum, **kw).rejected == {}  # type: ignore[arg-type]


def test_three_vectors_all_unrelated_drop_nobody() -> None:
    # The old screen dropped all three here: each was as unrelated to the others as noise.
    trio = {n: _noise_like(_honest(i), 10 + i) for i, n in enumerate(("a", "b", "c"))}
    assert screen(trio, per="tokens", norm_ratio=10, direction_sigmas=3.0).rejected == {}
    # Three with traffic and the momentum as a fourth witness: the noise is dropped.
    momentum = torch.linspace(-1, 1, 1000)
    mixed = {"a": _honest(1), "b": _honest(3), "x": _noise_like(_honest(2))}
    result = aggregate(mixed, reference=momentum, per="tokens", direction_sigmas=3.0, **KW)
    assert set(result.rejected) == {"x"} and "while the others relate" in result.rejected["x"]


def test_a_lone_contribution_is_judged_by_its_magnitudes_against_the_second_moment() -> None:
    # The fastest replica leases what it can, so a step's only traffic can be the hostile
    # replica's: nothing to compare its direction with, but AdamW's second moment says which
    # parameters have large gradients, and noise's magnitudes do not follow it.
    g = torch.Generator().manual_seed(5)
    scale = torch.cat([torch.full((500,), 1e-3), torch.full((500,), 1.0)])  # two "tensors"
    profile = scale.square() * (0.5 + torch.rand(1000, generator=g))  # exp_avg_sq
    honest = (scale * torch.randn(1000, generator=g) * 64, 64, 8)
    idle = (torch.zeros(1000), 0, 0)
    kw = {"per": "tokens", "direction_sigmas": 3.0, **KW}
    alone = {"a": idle, "b": idle, "x": _noise_like(honest)}
    result = aggregate(alone, profile=profile, **kw)  # type: ignore[arg-type]
    assert set(result.rejected) == {"x"} and "second moment" in result.rejected["x"]
    assert result.total[1] == 0  # the step applies nothing
    fine = aggregate({"a": idle, "b": idle, "h": honest}, profile=profile, **kw)  # type: ignore[arg-type]
    assert fine.rejected == {} and torch.equal(fine.total[0], torch.zeros(1000) + honest[0])
    # Off with the screen, and before the optimizer has a second moment (step 0).
    assert aggregate(alone, profile=profile, **{**kw, "direction_sigmas": 0.0}).rejected == {}  # type: ignore[arg-type]
    assert aggregate(alone, profile=torch.zeros(1000), **kw).rejected == {}  # type: ignore[arg-type]
