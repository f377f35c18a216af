"""Single-process training of the same model, data order and global batch: the baseline.

It follows the pipeline's arithmetic exactly (summed token losses per
microbatch, gradients divided by the step's token count) so the two agree to
floating-point rounding when the codec is lossless.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from swarmpipe.config import RunConfig
from swarmpipe.data import Corpus
from swarmpipe.model.bottleneck import build_optimizer
from swarmpipe.model.partition import StageModule, build_full_model, token_loss_sum


def train_single_process(
    cfg: RunConfig,
    steps: int | None = None,
    evals: list[tuple[int, float]] | None = None,
    *,
    model: nn.Module | None = None,
    device: torch.device | str = "cpu",
    trains_on: Sequence[int] | None = None,
) -> list[float]:
    """Train cfg's model in this process; return the mean token loss of each step.

    `model` is trained in place when given (a fresh `build_full_model(cfg)`, kept by a
    caller that compares parameters afterwards); by default one is built here. It trains on
    `device`, under bfloat16 autocast when train.precision is "bf16", as a stage does.

    Step s uses samples [s*G, (s+1)*G) with G = train.global_batch, cut into
    microbatches of train.microbatch (the last may be smaller); `steps`
    defaults to train.steps. When `evals` is a list and train.eval_every > 0,
    (step, held-out loss) is appended where the pipeline evaluates: before every
    eval_every-th step and after the last.

    `trains_on[s]` (train.step_overlap, as a run's report.json records it) names the
    parameters step s computes its gradient on, in optimizer steps applied: s, or fewer (up
    to the overlap depth) for a step the pipeline opened early. The gradient is applied to
    the newest parameters (W(s+1) = AdamW(W(s), g(s) at W(trains_on[s]))), and an
    evaluation at step s measures W(trains_on[s]). None: every step on its own parameters,
    as without overlap.
    """
    if model is None:
        model = build_full_model(cfg)
    device = torch.device(device)
    model.to(device).train()
    autocast = cfg.train.precision == "bf16"
    corpus = Corpus.load(cfg.data, cfg.model.context, cfg.train.seed)
    t = cfg.train
    optimizer = build_optimizer(model, cfg)
    losses = []
    total = t.steps if steps is None else steps
    # The parameters after each number of optimizer steps that a later step trains on,
    # kept until the last step that trains on them.
    on_of = list(range(total)) if trains_on is None else list(trains_on[:total])
    last_use = {on: step for step, on in enumerate(on_of) if on < step}
    versions: dict[int, nn.Module] = {}
    for step in range(total):
        on = on_of[step]
        if not 0 <= on <= step:
            raise ValueError(f"step {step} cannot train on the parameters of step {on}")
        if step in last_use:
            versions[step] = copy.deepcopy(model)  # a later step will train on these
        compute = model if on == step else versions[on]
        if evals is not None and t.eval_every and step % t.eval_every == 0:
            evals.append((step, evaluate(compute, corpus, t.eval_samples)))
        base = step * t.global_batch
        loss_sum, tokens = 0.0, 0
        for offset in range(0, t.global_batch, t.microbatch):
            count = min(t.microbatch, t.global_batch - offset)
            x, y = corpus.samples(base + offset, count)  # each [count, T]
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = compute(x)
            loss = token_loss_sum(logits, y)
            torch.autograd.backward(loss)
            loss_sum += float(loss.detach())
            tokens += y.numel()
        if compute is not model:
            # Taken on the older parameters, applied to the newest; the copy keeps no
            # gradient, since another step may train on it too (a depth above 1).
            for p, q in zip(model.parameters(), compute.parameters(), strict=True):
                p.grad, q.grad = q.grad, None
            if last_use[on] == step:
                del versions[on]
        # The same scaling, in the same order, as StageRuntime.apply_step.
        scale = 1.0 / tokens
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / tokens)
    if evals is not None and t.eval_every:
        evals.append((total, evaluate(model, corpus, t.eval_samples)))
    return losses


@torch.no_grad()
def evaluate(model_or_layers: nn.Module | Sequence[nn.Module], corpus: Corpus, count: int) -> float:
    """Mean token loss on the first `count` held-out samples (a model, its stages or layers)."""
    x, y = corpus.heldout(count)  # each [count, T]
    layers = [model_or_layers] if isinstance(model_or_layers, nn.Module) else model_or_layers
    device = next((p.device for layer in layers for p in layer.parameters()), x.device)
    x, y = x.to(device), y.to(device)
    out = x
    for layer in layers:
        # A stage may re-add token embeddings (model.bottleneck) and takes the ids too.
        out = layer(out, x) if isinstance(layer, StageModule) else layer(out)  # [count, T, V]
    return float(token_loss_sum(out, y)) / y.numel()
