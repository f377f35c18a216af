"""Single-process training of the same model, data order and global batch: the baseline.

It follows the pipeline's arithmetic exactly (summed token losses per
microbatch, gradients divided by the step's token count) so the two agree to
floating-point rounding when the codec is lossless.
"""

from __future__ import annotations

import torch
from torch import nn

from swarmpipe.config import RunConfig
from swarmpipe.data import Corpus
from swarmpipe.model.partition import build_full_model, token_loss_sum


def train_single_process(cfg: RunConfig, steps: int | None = None) -> list[float]:
    """Train cfg's model in this process; return the mean token loss of each step."""
    model = build_full_model(cfg)
    corpus = Corpus.load(cfg.data, cfg.model.context, cfg.train.seed)
    t = cfg.train
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay
    )
    losses = []
    for step in range(steps if steps is not None else t.steps):
        base = step * t.global_batch
        loss_sum, tokens = 0.0, 0
        for offset in range(0, t.global_batch, t.microbatch):
            count = min(t.microbatch, t.global_batch - offset)
            x, y = corpus.samples(base + offset, count)
            loss = token_loss_sum(model(x), y)
            torch.autograd.backward(loss)
            loss_sum += float(loss.detach())
            tokens += y.numel()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / tokens)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / tokens)
    return losses


@torch.no_grad()
def evaluate(model: nn.Module, corpus: Corpus, count: int) -> float:
    """Mean token loss on the first `count` held-out samples."""
    x, y = corpus.heldout(count)
    return float(token_loss_sum(model(x), y)) / y.numel()
