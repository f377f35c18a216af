"""Cutting the model into pipeline stages, and the loss the last stage computes."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from swarmpipe.config import RunConfig
from swarmpipe.errors import ConfigError
from swarmpipe.model.gpt import build_gpt_layer


def stage_layer_ranges(n_layers_total: int, stages: int) -> list[range]:
    """Split layers 0..n-1 into `stages` contiguous, non-empty, balanced ranges."""
    if not 1 <= stages <= n_layers_total:
        raise ConfigError(f"cannot cut {n_layers_total} layers into {stages} stages")
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
    spec = cfg.model.factory
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model.factory {spec!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model.factory {spec!r}: {module_name} has no function {attr!r}")
    torch.manual_seed(cfg.train.seed)
    layers = fn(cfg.model)
    if (
        not isinstance(layers, list | tuple)
        or not layers
        or not all(isinstance(x, nn.Module) for x in layers)
    ):
        raise ConfigError(f"model.factory {spec!r} must return a non-empty list of torch.nn.Module")
    return list(layers)


def n_model_layers(cfg: RunConfig) -> int:
    if cfg.model.factory:
        return len(_factory_layers(cfg))
    return cfg.model.n_layers + 2


def build_stage(cfg: RunConfig, stage: int) -> nn.Sequential:
    """Only the layers of `stage`, with the parameters the whole model would give them."""
    if cfg.model.factory:
        layers = _factory_layers(cfg)
        ranges = stage_layer_ranges(len(layers), cfg.pipeline.stages)
        return nn.Sequential(*[layers[i] for i in ranges[stage]])
    ranges = stage_layer_ranges(cfg.model.n_layers + 2, cfg.pipeline.stages)
    return nn.Sequential(*[build_gpt_layer(cfg.model, i, cfg.train.seed) for i in ranges[stage]])


def build_full_model(cfg: RunConfig) -> nn.Sequential:
    """Every layer in one module: the single-process baseline."""
    if cfg.model.factory:
        return nn.Sequential(*_factory_layers(cfg))
    n = cfg.model.n_layers + 2
    return nn.Sequential(*[build_gpt_layer(cfg.model, i, cfg.train.seed) for i in range(n)])


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every token: logits [B, T, V], labels [B, T] -> scalar."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum"
    )
