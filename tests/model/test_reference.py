"""The single-process baseline learns, and neither the microbatch cut nor the stage cut
changes its losses: the property the pipeline's equivalence rests on."""

from __future__ import annotations

import torch

from swarmpipe.config import RunConfig, load_config
from swarmpipe.data import Corpus
from swarmpipe.model import build_full_model, build_stage, token_loss_sum
from swarmpipe.model.reference import evaluate, train_single_process

SMALL = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.context=32",
    "train.global_batch=8",
]


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(x) for x, y in zip(a, b, strict=True))


def test_reference_training_learns_and_ignores_the_microbatch_cut() -> None:
    a = train_single_process(load_config(None, [*SMALL, "train.microbatch=8"]), steps=20)
    b = train_single_process(load_config(None, [*SMALL, "train.microbatch=2"]), steps=20)
    c = train_single_process(load_config(None, [*SMALL, "train.microbatch=3"]), steps=20)
    assert len(a) == 20 and a[-1] < a[0] * 0.85
    assert _close(a, b, 1e-5) and _close(a, c, 1e-5)  # 3 leaves a last microbatch of 2


def _train_cut_into_stages(cfg: RunConfig, steps: int) -> list[float]:
    """What the pipeline does, in one process: a stage per module, gradients hop by hop."""
    stages = [build_stage(cfg, s) for s in range(cfg.pipeline.stages)]
    t = cfg.train
    optimizers = [
        torch.optim.AdamW(s.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        for s in stages
    ]
    corpus = Corpus.load(cfg.data, cfg.model.context, t.seed)
    losses = []
    for step in range(steps):
        loss_sum, tokens = 0.0, 0
        for offset in range(0, t.global_batch, t.microbatch):
            x, y = corpus.samples(step * t.global_batch + offset, t.microbatch)
            inputs, outputs = [], []
            for i, stage in enumerate(stages):
                inp = x if i == 0 else x.detach().requires_grad_(True)
                x = stage(inp)
                inputs.append(inp)
                outputs.append(x)
            loss = token_loss_sum(x, y)
            loss.backward()
            for i in range(len(stages) - 2, -1, -1):
                torch.autograd.backward(outputs[i], inputs[i + 1].grad)
            loss_sum += float(loss.detach())
            tokens += y.numel()
        for stage, optimizer in zip(stages, optimizers, strict=True):
            for p in stage.parameters():
                assert p.grad is not None
                p.grad.mul_(1.0 / tokens)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / tokens)
    return losses


def test_training_cut_into_stages_matches_the_baseline() -> None:
    cfg = load_config(None, [*SMALL, "train.microbatch=4", "pipeline.stages=3"])
    assert _close(train_single_process(cfg, steps=8), _train_cut_into_stages(cfg, 8), 1e-5)


def test_evaluate_takes_a_model_or_its_stages() -> None:
    cfg = load_config(None, [*SMALL, "pipeline.stages=2"])
    corpus = Corpus.load(cfg.data, cfg.model.context, cfg.train.seed)
    whole = evaluate(build_full_model(cfg), corpus, 4)
    assert abs(whole - evaluate([build_stage(cfg, 0), build_stage(cfg, 1)], corpus, 4)) < 1e-6
    assert 5.0 < whole < 6.0  # about ln(256) = 5.55 at init
