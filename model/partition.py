"""Cutting the model into pipeline stages, and the loss the last stage computes.

The model is a list of layers: the built-in GPT (embedding, blocks, head) or
whatever a user factory `model.factory = "pkg.mod:fn"` returns. A stage is a
contiguous range of that list, and every stage builds the same parameters for
its layers as the whole model would, so the pipeline starts where the
single-process baseline starts. With `model.bottleneck` on, each cut between
stages also gets a learned boundary (model/bottleneck.py): a down-projection
ends the stage before it and an up-projection starts the stage after it, in
the pipeline and in the single-process baseline alike.

The built-in GPT is cut where each stage gets the same compute by a cost model
(model/stage_cost.py); a factory's layers, whose cost nothing here knows, are cut
into equal counts.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from swarmpipe.config import RunConfig
from swarmpipe.errors import ConfigError
from swarmpipe.model.bottleneck import BottleneckUp, build_bottleneck_down, build_bottleneck_up
from swarmpipe.model.gpt import build_gpt_layer
from swarmpipe.model.stage_cost import gpt_stage_ranges


class StageModule(nn.Sequential):
    """Layers run in order, handing the microbatch's token ids to those that re-add them.

    Only a bottleneck's up-projection takes token ids. A module whose input is the
    ids themselves (stage 0, the whole model) finds them there; a later stage is
    handed them beside its activations.
    """

    def forward(self, input: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if tokens is None and not input.is_floating_point():
            tokens = input  # [B, T] token ids: this module starts at the embedding
        x = input
        for layer in self:
            if isinstance(layer, BottleneckUp):
                if tokens is None:
                    raise ValueError(
                        "this stage starts with a bottleneck up-projection and needs the "
                        "microbatch's token ids beside its activations"
                    )
                x = layer(x, tokens)
            else:
                x = layer(x)
        return x

    @property
    def needs_tokens(self) -> bool:
        """Whether a layer here re-adds token embeddings (so the ids must travel with the input)."""
        return any(isinstance(layer, BottleneckUp) for layer in self)


def stage_layer_ranges(n_layers_total: int, stages: int) -> list[range]:
    """Split layers 0..n-1 into `stages` contiguous, non-empty, balanced ranges."""
    if not 1 <= stages <= n_layers_total:
        raise ConfigError(
            f"cannot cut {n_layers_total} layers into {stages} stages; "
            f"use between 1 and {n_layers_total} pipeline.stages"
        )
    base, extra = divmod(n_layers_total, stages)
    sizes = [base] * stages
    # Extra layers go to the middle stages first: the first and last stages
    # already carry the embedding and the head with its vocabulary matmul.
    order = [*range(1, stages - 1), 0, stages - 1] if stages > 2 else list(range(stages))
    for s in order[:extra]:
        sizes[s] += 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _factory_layers(cfg: RunConfig) -> list[nn.Module]:
    """Call the user's factory under the run's seed and check what it returns."""
    spec = cfg.model.factory
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"model.factory={spec!r} must look like 'package.module:fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model.factory={spec!r}: cannot import {module_name!r} ({exc}); "
            "is it installed or on PYTHONPATH on every node?"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model.factory={spec!r}: {module_name} has no function {attr!r}")
    # The factory initialises from the global RNG; seeding it first makes every
    # node build the same parameters.
    torch.manual_seed(cfg.train.seed)
    layers = fn(cfg.model)
    if not isinstance(layers, list | tuple) or not layers:
        got = "an empty list" if isinstance(layers, list | tuple) else type(layers).__name__
        raise ConfigError(
            f"model.factory={spec!r} must return a non-empty list of torch.nn.Module, got {got}"
        )
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ConfigError(
                f"model.factory={spec!r} must return a non-empty list of torch.nn.Module; "
                f"item {i} is a {type(layer).__name__}"
            )
    return list(layers)


def n_model_layers(cfg: RunConfig) -> int:
    """How many layers the run's model has (a factory's list is built to count it)."""
    if cfg.model.factory:
        return len(_factory_layers(cfg))
    return cfg.model.n_layers + 2


def _gpt_stage_modules(cfg: RunConfig, stage: int, ranges: list[range]) -> list[nn.Module]:
    """Stage `stage` of the built-in GPT: its layers, between its bottleneck boundaries if any."""
    m, seed = cfg.model, cfg.train.seed
    modules: list[nn.Module] = [build_gpt_layer(m, i, seed) for i in ranges[stage]]
    if m.bottleneck:
        if stage > 0:
            modules.insert(0, build_bottleneck_up(m, seed, stage - 1))
        if stage < len(ranges) - 1:
            modules.append(build_bottleneck_down(m, seed, stage))
    return modules


def build_stage(cfg: RunConfig, stage: int) -> StageModule:
    """Only the modules of `stage`, with the parameters the whole model would give them."""
    stages = cfg.pipeline.stages
    if not 0 <= stage < stages:
        raise ConfigError(f"stage {stage} is outside the run's pipeline.stages={stages}")
    if cfg.model.factory:
        # A factory can only build its whole list; the other stages' layers are dropped.
        layers = _factory_layers(cfg)
        mine = stage_layer_ranges(len(layers), stages)[stage]
        return StageModule(*layers[mine.start : mine.stop])
    ranges = gpt_stage_ranges(cfg.model, stages)
    return StageModule(*_gpt_stage_modules(cfg, stage, ranges))


def stage_module_counts(cfg: RunConfig) -> list[int]:
    """How many modules each stage holds, in order: the whole model is their concatenation,
    so stage s's module i is module `sum(counts[:s]) + i` of `build_full_model`."""
    stages = cfg.pipeline.stages
    if cfg.model.factory:
        return [len(r) for r in stage_layer_ranges(n_model_layers(cfg), stages)]
    counts = [len(r) for r in gpt_stage_ranges(cfg.model, stages)]
    if cfg.model.bottleneck:  # a down-projection ends, an up-projection starts, each cut
        counts = [n + (s > 0) + (s < stages - 1) for s, n in enumerate(counts)]
    return counts


def build_full_model(cfg: RunConfig) -> StageModule:
    """Every module in one, the bottleneck boundaries included: the single-process baseline."""
    if cfg.model.factory:
        return StageModule(*_factory_layers(cfg))
    ranges = gpt_stage_ranges(cfg.model, cfg.pipeline.stages)
    return StageModule(*[m for s in range(len(ranges)) for m in _gpt_stage_modules(cfg, s, ranges)])


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every token: logits [B, T, V], labels [B, T] -> scalar.

    A sum, not a mean: each node adds up its microbatches' gradients and
    divides by the step's token count once, so how the batch is cut into
    microbatches does not change the update. fp32 so a half-precision stage
    does not round the loss.
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),  # [B*T, V]
        labels.reshape(-1),  # [B*T]
        reduction="sum",
    )
