"""What a node tells the coordinator's placement about its stage before it is measured.

A node that has served no traffic has no measured rate, and the placement policy would have
to guess. So right after it builds its stage, before it takes traffic, it runs a few
forward-plus-backward passes of the stage on a made-up microbatch of the run's shape, on its
compute thread (so a testnet's slowdown is in the figure, as it is in every job), and
reports the samples/s in its telemetry (`calibrated_samples_per_second`). The passes take
gradients with `torch.autograd.grad`, which returns them instead of adding them to the
parameters' `.grad`: the stage's state is untouched.

It also reports its stage's compute per sample (`stage_flops_per_sample`: multiply-adds of
its linear layers, times 6 for forward and backward, times the tokens of a sample), from
which the coordinator derives each stage's relative cost, and its state's size
(`stage_state_bytes`: parameters and AdamW's two moments), what a node moving onto the stage
downloads.
"""

from __future__ import annotations

import torch
from torch import nn

from swarmpipe.node.stage_runtime import StageRuntime

CALIBRATION_PASSES = 3
"""Timed passes after one untimed warm-up (allocations, kernel selection): enough for a
figure within the ±3 % the policy's hysteresis absorbs on the testnet's small stages, and a
fraction of a second on them."""


def stage_flops_per_sample(runtime: StageRuntime) -> float:
    """Forward plus backward multiply-adds per sample of the stage's linear layers (the
    attention scores and element-wise work are left out: the same share on every block)."""
    weights = sum(m.weight.numel() for m in runtime.module.modules() if isinstance(m, nn.Linear))
    if weights == 0:  # a factory model without nn.Linear: its parameter count stands in
        weights = sum(p.numel() for p in runtime.module.parameters())
    return 6.0 * weights * runtime.config.model.context


def stage_state_bytes(runtime: StageRuntime) -> float:
    """Bytes of the stage's parameters and the optimizer's two moments."""
    return 3.0 * sum(p.numel() * p.element_size() for p in runtime.module.parameters())


def calibration_inputs(runtime: StageRuntime) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A made-up microbatch for the stage (inputs, token ids), or None when its input shape
    is not known from the config (a later stage of a factory model)."""
    cfg = runtime.config
    batch, context, vocab = cfg.train.microbatch, cfg.model.context, cfg.model.vocab
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, context), generator=generator)
    if runtime.is_first:
        return tokens, None
    if cfg.model.factory:
        return None
    x = torch.randn(batch, context, runtime.input_width, generator=generator)
    return x, tokens if runtime.needs_tokens else None


def calibration_pass(
    runtime: StageRuntime, inputs: torch.Tensor, tokens: torch.Tensor | None
) -> None:
    """One forward and backward of the stage, its gradients returned and dropped."""
    x = inputs if not inputs.is_floating_point() else inputs.detach().requires_grad_(True)
    out = runtime.module(x, tokens)
    wrt: list[torch.Tensor] = [p for p in runtime.module.parameters() if p.requires_grad]
    if x.requires_grad:
        wrt.append(x)
    torch.autograd.grad(out.float().square().mean(), wrt)
