"""train.precision: bf16 autocast over fp32 master weights trains; fp32 is exact as before.

The stages here are driven in one process the way the nodes drive them (forward down,
the last stage's loss and backward, gradients back up, then apply_step on each), so the
arithmetic is the pipeline's without processes or sockets.
"""

from __future__ import annotations

import pytest
import torch

from swarmpipe.config import RunConfig, load_config
from swarmpipe.data import Corpus
from swarmpipe.model.reference import train_single_process
from swarmpipe.node.stage_runtime import StageRuntime

pytestmark = pytest.mark.slow  # seconds of CPU training each (bf16 autocast is slow on a CPU)

SMALL = [
    "model.n_layers=4",
    "model.d_model=32",
    "model.n_heads=2",
    "model.context=32",
    "train.global_batch=8",
    "train.microbatch=4",
    "pipeline.stages=3",
    "data.max_bytes=262144",  # reading the default 64 MiB of text is most of the time
]


def _train_stages(cfg: RunConfig, steps: int) -> tuple[list[float], list[StageRuntime]]:
    stages = [StageRuntime(cfg, s) for s in range(cfg.pipeline.stages)]
    t = cfg.train
    corpus = Corpus.load(cfg.data, cfg.model.context, t.seed)
    losses = []
    for step in range(steps):
        loss_sum, tokens = 0.0, 0
        for offset in range(0, t.global_batch, t.microbatch):
            mb = f"{step}-{offset}"
            x, y = corpus.samples(step * t.global_batch + offset, t.microbatch)
            act = x
            for runtime in stages[:-1]:
                act = runtime.forward(mb, mb, act)
            result = stages[-1].forward_last(mb, act, y)
            grad = result.grad_input
            for runtime in reversed(stages[:-1]):
                assert grad is not None
                grad = runtime.backward(mb, grad)
            loss_sum += result.loss_sum
            tokens += result.tokens
        for runtime in stages:
            runtime.apply_step(step)
        losses.append(loss_sum / tokens)
    return losses, stages


def test_fp32_stages_match_single_process_training_exactly() -> None:
    cfg = load_config(None, SMALL)
    got, _ = _train_stages(cfg, 5)
    want = train_single_process(cfg, steps=5)
    assert all(abs(g - w) <= 1e-5 * w for g, w in zip(got, want, strict=True)), (got, want)


def test_bf16_trains_with_fp32_master_weights_and_optimizer_state() -> None:
    cfg = load_config(None, [*SMALL, "train.precision=bf16"])
    losses, stages = _train_stages(cfg, 25)
    assert losses[-1] < losses[0] * 0.85, losses
    for runtime in stages:
        for p in runtime.module.parameters():
            assert p.dtype == torch.float32
            state = runtime.optimizer.state[p]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # Autocast really ran: the first loss is the same model's, rounded differently.
    fp32 = train_single_process(load_config(None, SMALL), steps=1)[0]
    assert losses[0] != fp32 and abs(losses[0] - fp32) < 0.02 * fp32


def test_single_process_bf16_follows_the_stages() -> None:
    cfg = load_config(None, [*SMALL, "train.precision=bf16"])
    got, _ = _train_stages(cfg, 5)
    want = train_single_process(cfg, steps=5)
    # The same casts in the same places; only where bf16 rounds the activations
    # crossing a stage boundary may the two differ.
    assert all(abs(g - w) <= 2e-2 * w for g, w in zip(got, want, strict=True)), (got, want)
