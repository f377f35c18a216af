"""Model factories for test_partition.py, imported by module path like a user's would be.

Not a test module (no test_ prefix); test_partition.py puts this directory on sys.path.
"""

from __future__ import annotations

from torch import nn

from swarmpipe.config import ModelConfig


def layers(cfg: ModelConfig) -> list[nn.Module]:
    """A tiny 3-layer model; torch's default init draws from the global RNG."""
    return [nn.Embedding(cfg.vocab, 8), nn.Linear(8, 8), nn.Linear(8, cfg.vocab)]


def not_a_list(cfg: ModelConfig) -> object:
    return "not a list"


def empty(cfg: ModelConfig) -> list[nn.Module]:
    return []


def not_modules(cfg: ModelConfig) -> list[object]:
    return [nn.Linear(2, 2), "oops"]


NOT_CALLABLE = 3
