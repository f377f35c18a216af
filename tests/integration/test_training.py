"""The pipeline trains like one process: the real testnet against the single-process baseline,
and the model exported from a run is the model single-process training gives."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmpipe.compression import encode_tensor
from swarmpipe.config import load_config
from swarmpipe.model import build_full_model, load_exported
from swarmpipe.model.exported import read_exported_info
from swarmpipe.model.reference import train_single_process
from swarmpipe.storage.checkpoint_set import checkpoint_root, steps_by_stage

pytestmark = pytest.mark.timeout(600)


def run_testnet(
    out: Path, tiny: list[str] | tuple[str, ...], steps: int, *settings: str, nodes: int = 3
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "swarmpipe", "testnet", "--quiet", "--no-picture", "--nodes",
           str(nodes), "--stages", "3", "--steps", str(steps), "--out", str(out)]  # fmt: skip
    for s in [*tiny, *settings]:
        cmd += ["--set", s]
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = popen.communicate(timeout=500)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    text = output.decode(errors="replace")
    assert popen.returncode == 0, text
    assert f"report: {out / 'report.json'}" in text
    assert "picture:" not in text and not (out / "report.png").exists()  # --no-picture
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def assert_losses_match(
    report: dict[str, Any], baseline: list[float], want_evals: list[tuple[int, float]]
) -> list[tuple[int, float]]:
    """Every step's loss and every evaluation in a testnet's report within 1e-4 of
    single-process training's (`baseline`, `want_evals`), evaluations at steps 0, 5 and 10;
    the report's evaluations as (step, loss)."""
    losses = [s["loss"] for s in report["steps"]]
    for step, (got, want) in enumerate(zip(losses, baseline, strict=True)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: {got} vs {want}"
    got_evals = [(e["step"], e["loss"]) for e in report["evals"]]
    assert [s for s, _ in got_evals] == [s for s, _ in want_evals] == [0, 5, 10]
    for (step, got), (_, want) in zip(got_evals, want_evals, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), f"eval at step {step}: {got} vs {want}"
    return got_evals


TEN_STEP_SETTINGS = ("checkpoint.every_steps=5", "train.eval_every=5", "train.eval_samples=10")
"""Checkpoints and evaluations at steps 5 and 10, on 10 held-out samples (not a multiple of
the microbatch)."""


@pytest.fixture(scope="module")
def ten_step_run(tmp_path_factory: pytest.TempPathFactory, tiny_settings: tuple[str, ...]) -> Path:
    """The --out folder of one finished lossless testnet (3 nodes, 3 stages, 10 steps,
    TEN_STEP_SETTINGS), which both the training and the export tests below check: one run
    instead of one each (scripts/test.sh's --dist loadfile keeps a module on one worker)."""
    out = tmp_path_factory.mktemp("ten-step-run")
    run_testnet(out, tiny_settings, 10, *TEN_STEP_SETTINGS)
    return out


def test_lossless_pipeline_matches_single_process(ten_step_run: Path, tiny: list[str]) -> None:
    # Evaluation rides along: 10 held-out samples (not a multiple of the microbatch) before
    # steps 0 and 5 and after the last, forward only through the same pipeline. The run is
    # shared with the export test below (its checkpoints change no loss).
    report = json.loads((ten_step_run / "report.json").read_text())
    want_evals: list[tuple[int, float]] = []
    config = load_config(None, [*tiny, *TEN_STEP_SETTINGS, "train.steps=10"])
    baseline = train_single_process(config, evals=want_evals)
    assert len(report["steps"]) == 10
    got_evals = assert_losses_match(report, baseline, want_evals)
    assert want_evals[-1][1] < want_evals[0][1], "training did not lower the held-out loss"
    assert report["final_eval_loss"] == got_evals[-1][1]
    elapsed = [e["elapsed_s"] for e in report["evals"]]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= report["steps"][-1]["elapsed_s"]
    c = report["counters"]
    assert c["lost"] == 0 and c["committed"] == 10 * 16 and c["outstanding"] == 0
    # Every hop carried activations down and gradients up, losslessly.
    directions = {(link["direction"], link["codec"]) for link in report["links"]}
    assert directions == {("activation", "lossless"), ("gradient", "lossless")}


@pytest.mark.slow
def test_int8_pipeline_stays_within_three_percent_after_50_steps(
    tmp_path: Path, tiny: list[str]
) -> None:
    report = run_testnet(
        tmp_path, tiny, 50, "pipeline.activation_codec=int8", "pipeline.gradient_codec=int8"
    )
    baseline = train_single_process(load_config(None, [*tiny, "train.steps=50"]))
    got, want = report["steps"][-1]["loss"], baseline[-1]
    assert baseline[-1] < baseline[0] * 0.8, "the baseline did not learn; the test means nothing"
    assert abs(got - want) / want < 0.03, f"int8 loss {got} vs lossless {want}"
    assert {link["codec"] for link in report["links"]} == {"int8"}
    assert report["counters"]["lost"] == 0


@pytest.mark.slow
def test_replicated_stages_match_single_process_and_stay_equal(
    tmp_path: Path, tiny: list[str]
) -> None:
    report = run_testnet(tmp_path, tiny, 6, nodes=6)
    baseline = train_single_process(load_config(None, [*tiny, "train.steps=6"]))
    for got, want in zip([s["loss"] for s in report["steps"]], baseline, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    by_stage: dict[int, set[str]] = {}
    for m in report["members"]:
        assert m["last_step"] == 5
        by_stage.setdefault(m["stage"], set()).add(m["param_digest"])
    assert sorted(by_stage) == [0, 1, 2]
    assert all(len(digests) == 1 for digests in by_stage.values()), by_stage
    assert any(link["direction"] == "reduce" for link in report["links"])


def test_bottleneck_pipeline_matches_single_process_and_sends_k_wide_activations(
    tmp_path: Path, tiny: list[str]
) -> None:
    k, steps, context, microbatch = 4, 8, 32, 4
    # Re-embedding the last 3 tokens after each boundary needs every earlier id of a sample,
    # which the stages rebuild from the labels and the first ids the header carries.
    model = [f"model.bottleneck={k}", "model.bottleneck_recent=3"]
    report = run_testnet(tmp_path, tiny, steps, *model)
    baseline = train_single_process(load_config(None, [*tiny, *model, f"train.steps={steps}"]))
    assert baseline[-1] < baseline[0] * 0.9, "the baseline did not learn; the test means nothing"
    losses = [s["loss"] for s in report["steps"]]
    assert len(losses) == steps
    for step, (got, want) in enumerate(zip(losses, baseline, strict=True)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: {got} vs {want}"
    c = report["counters"]
    assert c["lost"] == 0 and c["committed"] == steps * 16
    # Both hops carried k fp32 numbers per token each way, not d_model of them.
    # (Per tensor: a hop retried on a loaded machine sends a microbatch twice.)
    for direction in ("activation", "gradient"):
        links = [link for link in report["links"] if link["direction"] == direction]
        sent, tensors = sum(x["bytes"] for x in links), sum(x["tensors"] for x in links)
        assert tensors >= c["committed"] // microbatch * 2, direction
        assert sent == tensors * microbatch * context * k * 4, direction


@pytest.mark.slow
def test_bottleneck_with_centered_int4_activations_trains_through_real_nodes(
    tmp_path: Path, tiny: list[str]
) -> None:
    # The bottleneck's recommended codec settings reach the nodes' encoders: int4 activations
    # in centred blocks (each also sends its midpoint), rounded to nearest; int4 gradients
    # rounded stochastically, not centred.
    k, steps, context, microbatch = 4, 8, 32, 4
    report = run_testnet(
        tmp_path,
        tiny,
        steps,
        f"model.bottleneck={k}",
        "pipeline.activation_codec=int4",
        "pipeline.gradient_codec=int4",
        'pipeline.int8_centered=["activation"]',
        'pipeline.stochastic_rounding=["gradient"]',
    )
    losses = [s["loss"] for s in report["steps"]]
    assert len(losses) == steps and losses[-1] < 0.95 * losses[0], losses
    c = report["counters"]
    assert c["lost"] == 0 and c["committed"] == steps * 16
    shape = (microbatch, context, k)
    sizes = {
        role: len(
            encode_tensor(torch.zeros(shape), "int4", channel_blocks=True, centered=centred)[1]
        )
        for role, centred in (("activation", True), ("gradient", False))
    }
    assert sizes["activation"] > sizes["gradient"]  # the midpoints
    # Every microbatch crossed both hops at least once (a hop retried on a loaded machine
    # sends one twice), each tensor at the codec's size.
    for direction, size in sizes.items():
        links = [link for link in report["links"] if link["direction"] == direction]
        sent, tensors = sum(x["bytes"] for x in links), sum(x["tensors"] for x in links)
        assert tensors >= c["committed"] // microbatch * 2, direction
        assert sent == tensors * size, direction


@pytest.mark.slow
def test_bottleneck_with_narrowed_zstd_activations_trains_through_real_nodes(
    tmp_path: Path, tiny: list[str]
) -> None:
    # int8 activations capped at code 11 and packed by zstd reach the nodes' encoders and
    # decode on the other side; gradients, neither narrowed nor packed, are plain int8.
    k, steps, context, microbatch = 4, 8, 32, 4
    report = run_testnet(
        tmp_path,
        tiny,
        steps,
        f"model.bottleneck={k}",
        "pipeline.activation_codec=int8",
        "pipeline.gradient_codec=int8",
        'pipeline.zstd=["activation"]',
        "pipeline.activation_code_max=11",
    )
    losses = [s["loss"] for s in report["steps"]]
    assert len(losses) == steps and losses[-1] < 0.95 * losses[0], losses
    c = report["counters"]
    assert c["lost"] == 0 and c["committed"] == steps * 16
    plain = len(encode_tensor(torch.zeros(microbatch, context, k), "int8", channel_blocks=True)[1])
    sent = {
        direction: sum(link["bytes"] for link in report["links"] if link["direction"] == direction)
        for direction in ("activation", "gradient")
    }
    hops = c["committed"] // microbatch * 2
    assert sent["gradient"] == hops * plain
    assert sent["activation"] < 0.75 * hops * plain  # 23 levels packed: about 4.6 bits a code


@pytest.mark.slow
def test_lowrank_activations_and_topk_gradients_train_end_to_end(
    tmp_path: Path, tiny: list[str]
) -> None:
    # The stateful codecs through real nodes: config keys reach the encoder, every tensor
    # decodes on the other side, and the run completes and learns something.
    report = run_testnet(
        tmp_path,
        tiny,
        12,
        "pipeline.activation_codec=lowrank",
        "pipeline.gradient_codec=topk",
        "pipeline.lowrank_rank=4",
        "pipeline.topk_fraction=0.1",
    )
    codecs = {(link["direction"], link["codec"]) for link in report["links"]}
    assert codecs == {("activation", "lowrank"), ("gradient", "topk")}
    assert report["counters"]["lost"] == 0
    losses = [s["loss"] for s in report["steps"]]
    assert all(math.isfinite(loss) for loss in losses)
    assert min(losses[-3:]) < losses[0]
    # [4 x 32 x 32] activations at rank 4: 4 + 4 * 4 * (128 + 32) bytes instead of 16 KiB.
    activation = [link for link in report["links"] if link["direction"] == "activation"]
    per_tensor = sum(link["bytes"] for link in activation) / sum(
        link["tensors"] for link in activation
    )
    assert per_tensor == 4 + 4 * 4 * (4 * 32 + 32)


@pytest.mark.slow
def test_bf16_trains_through_real_nodes_beside_single_process_bf16(
    tmp_path: Path, tiny: list[str]
) -> None:
    # With a bottleneck, what crosses each boundary is the down-projection's bf16 output
    # (autocast), so the wire and the receiving stage see bf16 tensors too.
    steps = 12
    settings = ["train.precision=bf16", "model.bottleneck=8"]
    report = run_testnet(tmp_path, tiny, steps, *settings)
    baseline = train_single_process(load_config(None, [*tiny, *settings, f"train.steps={steps}"]))
    losses = [s["loss"] for s in report["steps"]]
    assert baseline[-1] < baseline[0] * 0.9, "the baseline did not learn; the test means nothing"
    assert losses[-1] < losses[0] * 0.9, losses
    # Same casts in the same places; only the order of bf16 sums may differ between them.
    assert abs(losses[-1] - baseline[-1]) <= 0.02 * baseline[-1], (losses, baseline)
    activation_bytes = sum(
        link["bytes"] for link in report["links"] if link["direction"] == "activation"
    )
    assert activation_bytes == report["counters"]["committed"] * 2 * 32 * 8 * 2  # bf16: 2 bytes
    assert report["counters"]["lost"] == 0


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lossless_gpu_pipeline_matches_single_process_gpu(tmp_path: Path, tiny: list[str]) -> None:
    # Three nodes share the one GPU (train.device after tiny's cpu wins); fp32 throughout.
    on_gpu = ["train.device=cuda", "train.precision=fp32"]
    report = run_testnet(tmp_path, tiny, 10, *on_gpu)
    baseline = train_single_process(
        load_config(None, [*tiny, *on_gpu, "train.steps=10"]), device="cuda"
    )
    losses = [s["loss"] for s in report["steps"]]
    assert len(losses) == 10
    for step, (got, want) in enumerate(zip(losses, baseline, strict=True)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: {got} vs {want}"
    assert baseline[-1] < baseline[0], "the baseline did not learn; the test means nothing"
    for i in range(3):
        log = (tmp_path / "logs" / f"n{i}.log").read_text()
        assert "fp32 on cuda:0" in log, log[-2000:]
    assert report["counters"]["lost"] == 0


def _swarmpipe(*args: str, timeout: float = 120) -> str:
    popen = subprocess.Popen(
        [sys.executable, "-m", "swarmpipe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = popen.communicate(timeout=timeout)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, f"swarmpipe {args[0]} failed:\n{out}\n{err}"
    return out


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow  # two exports and two evals besides the shared 10-step testnet
def test_an_exported_testnet_run_equals_single_process_training(
    tmp_path: Path, tiny: list[str], ten_step_run: Path
) -> None:
    # The run that test_lossless_pipeline_matches_single_process checks, with checkpoints and
    # evaluations at steps 5 and 10 (TEN_STEP_SETTINGS).
    run = ten_step_run
    report: dict[str, Any] = json.loads((run / "report.json").read_text())
    run_evals = {e["step"]: e["loss"] for e in report["evals"]}
    state_dir = run / "coordinator-state"
    found = steps_by_stage(checkpoint_root(state_dir), "testnet")
    # The run is done only once every stage's final state (step 10) is stored.
    assert {stage: sorted(steps) for stage, steps in found.items()} == {
        stage: [5, 10] for stage in range(3)
    }, found
    newest = 10

    config = load_config(None, [*tiny, *TEN_STEP_SETTINGS, "train.steps=10"])
    for step, chosen in ((None, newest), (5, 5)):
        out = tmp_path / f"model-{chosen}.safetensors"
        line = _swarmpipe(
            "export", "--state-dir", str(state_dir), "--out", str(out),
            *(["--step", str(step)] if step is not None else []),
        )  # fmt: skip
        assert line.startswith(f"exported run 'testnet' at step {chosen} (3 stages, ")
        info = read_exported_info(out)
        assert info.step == chosen
        assert (info.config.model, info.config.train) == (config.model, config.train)

        want = build_full_model(config)
        train_single_process(config, steps=chosen, model=want)
        difference = _max_difference(load_exported(out).state_dict(), want.state_dict())
        print(f"step {chosen}: exported vs single-process parameters, max |diff| {difference:.3g}")
        assert difference <= 1e-4

        # The run evaluated at this step on the same held-out samples; eval must agree.
        result = json.loads(_swarmpipe("eval", "--model", str(out), "--threads", "1"))
        assert (result["step"], result["samples"]) == (chosen, 10)
        gap = abs(result["loss"] - run_evals[chosen])
        print(f"step {chosen}: eval {result['loss']} vs the run's {run_evals[chosen]}: {gap:.3g}")
        assert gap <= 1e-4 * run_evals[chosen]
