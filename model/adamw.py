"""AdamW for every stage and the baseline, without torch.optim's start-up cost.

torch.optim.AdamW computes the right thing, but every entry point of a torch.optim
optimizer (its constructor's `add_param_group`, `step`, `zero_grad`) first imports
`torch._dynamo`, to tell the compiler to leave it alone: 0.65 CPU-s on this project's
machines (sympy, torch.fx's symbolic shapes, torch.distributed's tensor ops), more than half
of what `import torch` costs, paid by every node at its first step for a compiler it never
uses. A volunteer's node starts that much sooner without it, and a testnet of N nodes saves
N times that on a shared machine.

So this is AdamW (decoupled weight decay; no amsgrad, maximize or capturable) in the few
tensor operations torch's own non-fused step runs, in the same order, grouped by torch's
`_foreach_*` kernels: on the CPU its parameters and moments match torch.optim.AdamW's bit
for bit (tests/model/test_adamw.py checks it), and on a GPU the tensors of a device step in
one kernel per operation, as torch's default there does. The state is torch's too: per
parameter a host float32 `step`, `exp_avg` and `exp_avg_sq`, in `state[param]`, which
node/stage_state.py streams and loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class AdamW:
    """AdamW over parameter groups, each a dict with "params" and optionally its own "lr"."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"AdamW learning rate {lr!r}: give 0 or more")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW betas {betas!r}: give two numbers in [0, 1)")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = []
        seen: set[int] = set()
        for group in groups:
            params = list(group["params"])
            if any(id(p) in seen for p in params):
                raise ValueError("a parameter appears in more than one AdamW group")
            seen.update(id(p) for p in params)
            self.param_groups.append({**defaults, **group, "params": params})
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        """Per parameter: `step` (a host float32 scalar), `exp_avg`, `exp_avg_sq`."""

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of every parameter that has a gradient."""
        for group in self.param_groups:
            by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_device.setdefault((p.device, p.dtype), []).append(p)
            for params in by_device.values():
                self._step_tensors(group, params)

    def _step_tensors(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr: float = group["lr"]
        beta1, beta2 = group["betas"]
        eps: float = group["eps"]
        weight_decay: float = group["weight_decay"]
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        steps: list[float] = []
        for p in params:
            assert p.grad is not None
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not take sparse gradients")
            state = self.state.get(p)
            if not state:
                state = self.state[p] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            state["step"] += 1
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"].item())
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        # Bias corrections in Python floats (double precision), as torch's own step.
        step_sizes = [-(lr / (1 - beta1**s)) for s in steps]
        bias_correction2_sqrt = [(1 - beta2**s) ** 0.5 for s in steps]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient (or zero it in place, `set_to_none=False`)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.requires_grad_(False)
                    p.grad.zero_()
