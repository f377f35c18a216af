"""Run config: TOML and --set overrides into frozen dataclasses; unknown keys are errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from swarmpipe.config import RunConfig, codec_enum, codec_name, load_config
from swarmpipe.errors import ConfigError


def test_defaults_need_no_file() -> None:
    config = load_config()
    assert config.pipeline.stages == 3 and config.train.steps == 50


def test_toml_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('run_id = "exp1"\n[train]\nsteps = 7\n[data]\npaths = ["a.txt"]\n')
    config = load_config(path, ["train.lr=0.01", "pipeline.activation_codec=int8"])
    assert config.run_id == "exp1" and config.train.steps == 7 and config.train.lr == 0.01
    assert config.data.paths == ("a.txt",) and config.pipeline.activation_codec == "int8"
    assert RunConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stepz=3"], "unknown config key(s) stepz in [train]"),
        (["modle.n_layers=3"], "unknown config key(s) modle"),
        (["train.steps=abc"], "train.steps must be int"),
        (["model.n_heads=3"], "must divide"),
        (["pipeline.activation_codec=zip"], "is not one of"),
        (["pipeline.link_mbit=-1"], "pipeline.link_mbit=-1.0 is out of range: give 0"),
        (["pipeline.link_mbit=0.0001"], "pipeline.link_mbit=0.0001 is out of range"),
        (["pipeline.link_mbit=2e7"], "pipeline.link_mbit=20000000.0 is out of range"),
        (["pipeline.link_mbit=nan"], "pipeline.link_mbit=nan is out of range"),
        (["pipeline.topk_fraction=0"], "pipeline.topk_fraction=0.0 must be in (0, 1]"),
        (["pipeline.topk_fraction=1.5"], "must be in (0, 1]"),
        (["pipeline.lowrank_rank=0"], "pipeline.lowrank_rank=0 must be >= 1"),
        (
            ['pipeline.stochastic_rounding=["gradient", "weights"]'],
            "may name only activation, gradient, reduce ('weights' unknown)",
        ),
        (
            ['pipeline.int8_centered=["weights"]'],
            "pipeline.int8_centered=['weights'] may name only activation, gradient, reduce",
        ),
        (
            ["pipeline.activation_code_max=11"],
            'saves bytes only through zstd: add "activation" to pipeline.zstd',
        ),
        (
            ['pipeline.zstd=["activation"]', "pipeline.activation_code_max=-1"],
            "pipeline.activation_code_max=-1 must be 0",
        ),
        (
            ['pipeline.zstd=["activations"]'],
            "pipeline.zstd=['activations'] may name only activation, gradient, reduce",
        ),
        (["train.microbatch=64", "train.global_batch=8"], "exceeds"),
        (["pipeline.stages=99"], "exceeds the model"),
        (["steps"], "must look like section.key=value"),
        (["pipeline.sync=sometimes"], "pipeline.sync='sometimes' is not one of"),
        (["pipeline.reduce_codec=zip"], "pipeline.reduce_codec='zip' is not one of"),
        (["pipeline.hop_timeout_min_s=200"], "at most pipeline.hop_timeout_s"),
        (["pipeline.diloco_inner_steps=0"], "diloco_inner_steps must be >= 1"),
        (
            ["train.step_overlap=true", "pipeline.sync=diloco"],
            'train.step_overlap needs pipeline.sync = "every_step"',
        ),
        (["train.step_overlap=maybe"], "train.step_overlap must be bool"),
        (["train.step_overlap=9"], "train.step_overlap=9: give true, false or a depth from 0 to 8"),
        (["train.step_overlap=-1"], "train.step_overlap=-1: give true, false or a depth"),
        (["train.step_overlap=2", "pipeline.sync=diloco"], "needs pipeline.sync"),
        (["pipeline.diloco_outer_momentum=1.0"], "must be in [0, 1)"),
        (['pipeline.auto_gradient_codecs=["int8", "zip"]'], "('zip' unknown)"),
        (['pipeline.auto_activation_codecs=["int8", "int8"]'], "must list distinct codecs"),
        (["pipeline.auto_activation_codecs=[]"], "must list distinct codecs"),
        (["pipeline.auto_gradient_codecs=int8"], "auto_gradient_codecs must be a list"),
    ],
)
def test_bad_config_is_a_clear_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_codec_names_round_trip() -> None:
    for name in ("lossless", "fp16", "bf16", "int8", "int4", "topk", "lowrank"):
        assert codec_name(codec_enum(name)) == name
    assert codec_name(999) == "unknown"


def test_auto_codecs_and_a_link_limit_load() -> None:
    config = load_config(
        None,
        ["pipeline.activation_codec=auto", "pipeline.gradient_codec=auto", "pipeline.link_mbit=10"],
    )
    assert config.pipeline.activation_codec == "auto" and config.pipeline.link_mbit == 10.0
    assert codec_enum("auto") == 0  # CODEC_UNSPECIFIED: each sender chooses per link
    assert load_config().pipeline.link_mbit == 0.0  # unlimited unless asked
    ladder = load_config(None, ['pipeline.auto_gradient_codecs=["lossless", "int4", "topk"]'])
    assert ladder.pipeline.auto_gradient_codecs == ("lossless", "int4", "topk")
    assert ladder.pipeline.auto_activation_codecs == ("lossless", "fp16", "bf16", "int8", "int4")
    rounding = load_config(None, ['pipeline.stochastic_rounding=["gradient", "reduce"]'])
    assert rounding.pipeline.stochastic_rounding == ("gradient", "reduce")


def test_the_deploy_example_config_loads() -> None:
    config = load_config(Path(__file__).resolve().parent.parent / "deploy" / "run.toml")
    assert config.run_id == "community-gpt" and config.pipeline.activation_codec == "int8"


def test_in_flight_is_a_number_or_auto() -> None:
    assert load_config(None, []).pipeline.in_flight == "auto"
    fixed = load_config(None, ["pipeline.in_flight=4"])
    assert fixed.pipeline.in_flight == 4
    assert RunConfig.from_json(fixed.to_json()) == fixed
    auto = load_config(None, ["pipeline.in_flight=auto"])
    assert RunConfig.from_json(auto.to_json()) == auto
    for value, words in [
        ("many", "give a number >= 1 or 'auto'"),
        ("1.5", "must be int or str, got 1.5"),
        ("true", "must be int or str, got True"),
        ("0", "must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_config(None, [f"pipeline.in_flight={value}"])


def test_link_latency_is_checked() -> None:
    assert load_config(None, ["pipeline.link_latency_ms=50"]).pipeline.link_latency_ms == 50.0
    with pytest.raises(
        ConfigError, match=re.escape("pipeline.link_latency_ms=-1.0 is out of range")
    ):
        load_config(None, ["pipeline.link_latency_ms=-1"])


def test_step_overlap_is_a_switch_or_a_depth() -> None:
    # true and false keep their meaning (depth 1 and 0); a number is the depth itself.
    for value, depth in [("false", 0), ("true", 1), ("0", 0), ("1", 1), ("3", 3), ("8", 8)]:
        config = load_config(None, [f"train.step_overlap={value}"])
        assert config.train.overlap_depth == depth
        assert RunConfig.from_json(config.to_json()) == config
    assert load_config(None, []).train.overlap_depth == 0
    for value in ("1.5", '"2"'):
        with pytest.raises(ConfigError, match="must be bool or int"):
            load_config(None, [f"train.step_overlap={value}"])
