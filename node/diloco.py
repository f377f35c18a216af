"""The DiLoCo outer step: replicas train apart for H steps, then agree on one parameter update.

With `pipeline.sync = "diloco"` the replicas of a stage step AdamW on their
own gradients only (no reduce), and every `diloco_inner_steps` steps they
exchange their parameter deltas since the round began (anchor - current),
average them weighted by the samples each trained on, and apply that average
as a pseudo-gradient with SGD + Nesterov momentum to the shared anchor
(Douillard et al., "DiLoCo", 2023). Anchor, momentum and the averaged delta
are the same on every replica, so every replica ends the round with
bit-identical parameters; inner AdamW states stay local, as in the paper.

Everything runs on flat fp32 vectors on the compute thread.
"""

from __future__ import annotations

import torch


def flatten(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in parameters])


class OuterOptimizer:
    """Anchor parameters, outer momentum and the samples of the current round."""

    def __init__(self, parameters: list[torch.nn.Parameter], *, lr: float, momentum: float) -> None:
        self.parameters = parameters
        self.lr = lr
        self.momentum = momentum
        self.anchor = flatten(parameters)
        self.velocity = torch.zeros_like(self.anchor)
        self.round_samples = 0

    def local_delta(self) -> tuple[torch.Tensor, int]:
        """(anchor - current) scaled by this round's samples, and those samples.

        Scaling lets the replicas' sum divided by the summed samples be the
        sample-weighted mean delta: a replica that got little traffic pulls little.
        """
        delta = self.anchor - flatten(self.parameters)
        return delta * float(self.round_samples), self.round_samples

    def step(self, delta_sum: torch.Tensor, samples: int) -> None:
        """Apply the outer update from the replicas' summed scaled deltas; start a new round."""
        if samples > 0:
            delta = delta_sum / float(samples)
            self.velocity.mul_(self.momentum).add_(delta)
            update = delta + self.momentum * self.velocity  # Nesterov
            self.anchor.sub_(self.lr * update)
        offset = 0
        with torch.no_grad():
            for p in self.parameters:
                n = p.numel()
                p.copy_(self.anchor[offset : offset + n].view_as(p).to(p.dtype))
                offset += n
        self.round_samples = 0
