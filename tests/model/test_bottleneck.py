"""The learned bottleneck boundary: every stage builds its slice of the same model, and the
boundary narrows what crosses a cut to k numbers per token."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.errors import ConfigError
from swarmpipe.model import (
    BottleneckDown,
    BottleneckUp,
    build_full_model,
    build_optimizer,
    build_stage,
    token_loss_sum,
)

SMALL = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.context=16"]


@pytest.mark.parametrize(
    ("k", "stages", "recent"), [(4, 3, 1), (32, 3, 1), (1, 2, 1), (8, 6, 1), (4, 3, 4), (32, 2, 16)]
)
def test_stages_build_the_whole_bottleneck_model_and_compute_the_same(
    k: int, stages: int, recent: int
) -> None:
    config = load_config(
        None,
        [
            *SMALL,
            f"model.bottleneck={k}",
            f"pipeline.stages={stages}",
            f"model.bottleneck_recent={recent}",
        ],
    )
    full = build_full_model(config)
    parts = [build_stage(config, s) for s in range(stages)]
    # A down-projection ends every stage but the last, an up-projection starts every one but
    # the first, and the whole model holds exactly the stages' modules in order.
    for s, part in enumerate(parts):
        assert isinstance(part[0], BottleneckUp) == (s > 0)
        assert isinstance(part[-1], BottleneckDown) == (s < stages - 1)
    assert [type(m) for m in full] == [type(m) for part in parts for m in part]
    full_params = list(full.named_parameters())
    stage_params = [p for part in parts for p in part.parameters()]
    assert len(full_params) == len(stage_params)
    for (name, a), b in zip(full_params, stage_params, strict=True):
        assert torch.equal(a, b), name

    tokens = torch.randint(0, 256, (2, 16))
    labels = torch.randint(0, 256, (2, 16))
    x = tokens
    for s, part in enumerate(parts):
        x = part(x, tokens)
        if s < stages - 1:
            assert x.shape == (2, 16, k)  # all that crosses the cut
    assert torch.equal(x, full(tokens))
    token_loss_sum(x, labels).backward()
    token_loss_sum(full(tokens), labels).backward()
    for (name, a), b in zip(full_params, stage_params, strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


def test_the_full_width_twin_starts_as_identity_plus_a_re_added_embedding() -> None:
    config = load_config(None, [*SMALL, "model.bottleneck=32", "pipeline.stages=2"])
    down, up = build_stage(config, 0)[-1], build_stage(config, 1)[0]
    assert isinstance(down, BottleneckDown) and isinstance(up, BottleneckUp)
    x = torch.randn(2, 16, 32)
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(up(down(x), tokens), x + up.embed(tokens))


def test_a_boundary_re_embeds_exactly_the_latest_tokens_it_is_asked_for() -> None:
    one = load_config(None, [*SMALL, "model.bottleneck=4", "pipeline.stages=2"])
    four = load_config(None, [*SMALL, "model.bottleneck=4", "pipeline.stages=2",
                              "model.bottleneck_recent=4"])  # fmt: skip
    up1, up4 = build_stage(one, 1)[0], build_stage(four, 1)[0]
    assert isinstance(up1, BottleneckUp) and isinstance(up4, BottleneckUp)
    # R = 1 is the boundary as it always was; R = 4 adds a table of vocab + 1 rows for each
    # of the three earlier offsets and leaves the tables R = 1 had as they were.
    assert up1.recent is None and up4.recent is not None
    assert tuple(up4.recent.weight.shape) == (3 * 257, 32)
    for a, b in zip(up1.parameters(), [up4.up.weight, *up4.embed.parameters()], strict=True):
        assert torch.equal(a, b)
    z = torch.randn(1, 16, 4)
    tokens = torch.randint(0, 256, (1, 16))
    base = up4(z, tokens)
    # Position t sees tokens t-3..t: changing token 5 changes positions 5..8 and no other.
    changed = tokens.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 256
    moved = (up4(z, changed) != base).any(dim=2)[0]
    assert moved.nonzero().flatten().tolist() == [5, 6, 7, 8]
    # Before the first token an offset looks up its own "no token" row, not token 0's.
    zeros = torch.zeros(1, 16, dtype=torch.int64)
    table = up4.recent.weight
    expected = up4.embed(zeros)[0, 0] + table[256] + table[257 + 256] + table[2 * 257 + 256]
    assert torch.allclose(up4(torch.zeros(1, 16, 4), zeros)[0, 0], expected)


def test_a_narrow_boundary_starts_as_a_copy_of_k_coordinates() -> None:
    config = load_config(None, [*SMALL, "model.bottleneck=4", "pipeline.stages=2"])
    down, up = build_stage(config, 0)[-1], build_stage(config, 1)[0]
    assert isinstance(down, BottleneckDown) and isinstance(up, BottleneckUp)
    x = torch.randn(2, 16, 32)
    kept = up.up(down(x))  # [2, 16, 32]: k coordinates of x, zero elsewhere
    nonzero = (kept != 0).any(dim=(0, 1))
    assert int(nonzero.sum()) == 4
    assert torch.equal(kept[..., nonzero], x[..., nonzero])


def test_boundaries_differ_by_seed_and_by_position() -> None:
    three = [*SMALL, "model.bottleneck=4", "pipeline.stages=3"]
    a, b = build_stage(load_config(None, three), 1), build_stage(load_config(None, three), 1)
    assert torch.equal(a[-1].down.weight, b[-1].down.weight)  # built twice, the same
    other_seed = build_stage(load_config(None, [*three, "train.seed=1"]), 1)
    assert not torch.equal(a[0].embed.tok.weight, other_seed[0].embed.tok.weight)
    second = build_stage(load_config(None, three), 2)
    assert not torch.equal(a[0].embed.tok.weight, second[0].embed.tok.weight)


def test_a_stage_after_a_boundary_refuses_to_run_without_token_ids() -> None:
    config = load_config(None, [*SMALL, "model.bottleneck=4", "pipeline.stages=2"])
    stage = build_stage(config, 1)
    assert stage.needs_tokens and not build_stage(config, 0).needs_tokens
    with pytest.raises(ValueError, match="needs the microbatch's token ids"):
        stage(torch.randn(2, 16, 4))


@pytest.mark.parametrize("k", [4, 32])
def test_the_boundary_projections_learn_at_their_own_rate(k: int) -> None:
    config = load_config(
        None,
        [*SMALL, "pipeline.stages=3", f"model.bottleneck={k}", "model.bottleneck_lr_scale=0.25"],
    )
    model = build_full_model(config)
    optimizer = build_optimizer(model, config)
    rest, projections = optimizer.param_groups
    assert rest["lr"] == config.train.lr and projections["lr"] == 0.25 * config.train.lr
    # Two boundaries, a Down and an Up each; every other parameter (the Up's own embedding
    # included) learns at train.lr, and none is left out or counted twice.
    assert [tuple(p.shape) for p in projections["params"]] == [(k, 32), (32, k)] * 2
    counted = len(rest["params"]) + len(projections["params"])
    assert counted == len(list(model.parameters()))
    # Without boundaries there is one group, as before the option existed.
    plain = load_config(None, [*SMALL, "pipeline.stages=3"])
    assert len(build_optimizer(build_full_model(plain), plain).param_groups) == 1


def test_without_the_option_the_model_has_no_boundaries() -> None:
    config = load_config(None, [*SMALL, "pipeline.stages=3"])
    modules = list(build_full_model(config))
    assert len(modules) == 6
    assert not any(isinstance(m, BottleneckDown | BottleneckUp) for m in modules)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ["model.bottleneck=33"],
            r"model.bottleneck=33 must be 0 \(off\) or a width in 1..model.d_model=32",
        ),
        (["model.bottleneck=-1"], "must be 0"),
        (["model.bottleneck=4", "model.factory=pkg.mod:fn"], "built-in GPT only"),
        (["model.bottleneck_lr_scale=0"], "model.bottleneck_lr_scale=0.0 must be positive"),
        (["model.bottleneck_lr_scale=nan"], "must be positive"),
        (
            ["model.bottleneck_recent=0"],
            r"model.bottleneck_recent=0 must be in 1..model.context=16",
        ),
        (
            ["model.bottleneck=4", "model.bottleneck_recent=17"],
            "must be in 1..model.context=16",
        ),
        (["model.bottleneck_recent=4"], "model.bottleneck is 0; set model.bottleneck too"),
    ],
)
def test_bad_bottleneck_settings_are_config_errors(settings: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*SMALL, *settings])
