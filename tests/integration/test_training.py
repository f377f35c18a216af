"""The pipeline trains like one process: the real testnet against the single-process baseline."""

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
from swarmpipe.model.reference import train_single_process

pytestmark = pytest.mark.timeout(600)


def run_testnet(
    out: Path, tiny: list[str], steps: int, *settings: str, nodes: int = 3
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "swarmpipe",
        "testnet",
        "--quiet",
        "--nodes",
        str(nodes),
        "--stages",
        "3",
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
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
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def test_lossless_pipeline_matches_single_process(tmp_path: Path, tiny: list[str]) -> None:
    # Evaluation rides along: 10 held-out samples (not a multiple of the microbatch) before
    # steps 0 and 5 and after the last, forward only through the same pipeline.
    evaluation = ["train.eval_every=5", "train.eval_samples=10"]
    report = run_testnet(tmp_path, tiny, 10, *evaluation)
    want_evals: list[tuple[int, float]] = []
    config = load_config(None, [*tiny, *evaluation, "train.steps=10"])
    baseline = train_single_process(config, evals=want_evals)
    losses = [s["loss"] for s in report["steps"]]
    assert len(losses) == 10
    for step, (got, want) in enumerate(zip(losses, baseline, strict=True)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: {got} vs {want}"
    got_evals = [(e["step"], e["loss"]) for e in report["evals"]]
    assert [s for s, _ in got_evals] == [s for s, _ in want_evals] == [0, 5, 10]
    for (step, got), (_, want) in zip(got_evals, want_evals, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), f"eval at step {step}: {got} vs {want}"
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
