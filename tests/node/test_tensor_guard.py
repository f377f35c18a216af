"""The data plane's screen: finite, and within a ratio of the running median it accepted."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.config import RobustConfig
from swarmpipe.node.tensor_guard import PoisonedTensor, TensorGuard


def _guard() -> TensorGuard:
    return TensorGuard(RobustConfig(data_norm_ratio=100.0, data_norm_window=16))


def test_non_finite_is_refused_from_the_first_tensor() -> None:
    guard = _guard()
    bad = torch.ones(4, 8)
    bad[1, 2] = float("inf")
    with pytest.raises(PoisonedTensor, match="gradient contains NaN or infinite values"):
        guard.check("gradient", bad, sender="x", step=0)
    assert guard.refused == 1


def test_an_absurd_norm_is_refused_once_the_window_has_a_median() -> None:
    guard = _guard()
    g = torch.Generator().manual_seed(0)
    huge = torch.randn(4, 8, generator=g) * 1e4
    guard.check("activation", huge, sender="x", step=0)  # nothing to compare with yet
    for _ in range(8):
        guard.check("activation", torch.randn(4, 8, generator=g), sender="a", step=0)
    with pytest.raises(PoisonedTensor, match=r"activation root-mean-square .* the bound is 100x"):
        guard.check("activation", huge, sender="x", step=1)
    # Each kind has its own window: gradients are still warming up.
    guard.check("gradient", huge, sender="x", step=1)
    # Honest drift within the ratio passes, and a refused tensor does not enter the median.
    guard.check("activation", torch.randn(4, 8, generator=g) * 50, sender="a", step=1)
