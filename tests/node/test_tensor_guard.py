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


def test_a_stages_only_replica_is_not_refused_for_scale_and_the_window_restarts() -> None:
    # Nobody could take its place: refusing would stop the run. A stage restored from its
    # checkpoint behind the others sent gradients 130-165x the median, every one refused.
    guard = _guard()
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        guard.check("gradient", torch.randn(4, 8, generator=g), sender="a", step=0)
    shifted = torch.randn(4, 8, generator=g) * 150
    guard.check("gradient", shifted, sender="solo", step=1, sole=True)
    assert guard.refused == 0 and guard.rebaselined == 1
    # The window starts again from it: the new scale passes from anyone (past the warm-up).
    for _ in range(8):
        guard.check("gradient", torch.randn(4, 8, generator=g) * 150, sender="b", step=2)
    # ...and a sole sender's non-finite values are still refused.
    bad = torch.full((4, 8), float("nan"))
    with pytest.raises(PoisonedTensor):
        guard.check("gradient", bad, sender="solo", step=2, sole=True)
    # A sender with another replica beside it is still refused for scale.
    with pytest.raises(PoisonedTensor):
        guard.check("gradient", torch.randn(4, 8, generator=g) * 1e5, sender="b", step=3)
