"""What a stateful codec remembers between tensors sent on one link in one role.

Top-k and low-rank drop part of every tensor they send. With error feedback the sender keeps
what was dropped (the residual) and adds it to the next tensor it sends in the same role on
the same link, so over many steps nothing is lost: the sum of what the receiver decodes tracks
the sum of what the sender meant to send. Low-rank also keeps its last right factor Q as the
warm start of the next power iteration, so one iteration per tensor converges over calls.

All of it lives here, on the sender, in an `EncoderState` the caller owns; payloads are
self-describing, so a receiver needs no state and a reroute to another peer corrupts nothing
(the residual rides along with the next tensor sent on that link, whoever receives it).

Known limits, on purpose:
- Memory is bounded: one fp32 residual the size of the last tensor and one [m, rank] factor.
  A tensor of another shape, dtype or device resets both (logged at DEBUG), so a state that
  alternates between shapes keeps no residual: use one state per tensor stream.
- A tensor that is encoded but never delivered (its call failed) has already moved its share
  into the residual, and resending it re-encodes it on top; error feedback then counts it
  twice. For a pipeline's activation gradients that is one microbatch's error, which training
  tolerates; the replica reduce, where exact sums matter, should `reset()` after a failed send.
- A tensor holding inf or NaN is sent as it is (top-k keeps them, low-rank sends it dense) and
  the residual is cleared: a broken step must not poison the link's later steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)


class EncoderState:
    """Error-feedback residual and low-rank warm start for one (link, tensor role).

    Make one per next-stage link and role ("activation", "gradient", "reduce") and pass it as
    `encode_tensor(..., state=state)`. `error_feedback` says whether dropped mass is carried
    into the next tensor: right for gradients (the receiver's sum over steps is what counts),
    wrong for activations (each microbatch's activation is a different input, and a residual
    from the last one would only add noise), which keep just the warm start.

    Thread-safe: encodings that share a state run one at a time, in the order they take it.
    """

    def __init__(self, *, error_feedback: bool) -> None:
        self.error_feedback = error_feedback
        """Whether dropped mass is added to the next tensor sent with this state."""
        self.resets = 0
        """How many times a change of shape, dtype or device cleared the state."""
        self._lock = threading.Lock()
        self._key: tuple[tuple[int, ...], torch.dtype, torch.device] | None = None
        self._residual: torch.Tensor | None = None
        self._warm_key: tuple[int, int, int] | None = None
        self._warm_q: torch.Tensor | None = None

    @property
    def residual(self) -> torch.Tensor | None:
        """The mass still owed to the receiver (flat fp32), or None; do not modify it."""
        return self._residual

    def reset(self) -> None:
        """Forget the residual and the warm start, e.g. after a send that did not arrive."""
        with self._lock:
            self._clear()

    @contextmanager
    def hold(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Iterator[EncoderState]:
        """Take the state for one encoding of a tensor of this shape, dtype and device,
        clearing it first if the last tensor differed; for codecs."""
        with self._lock:
            key = (shape, dtype, device)
            if self._key is not None and self._key != key:
                logger.debug(
                    "encoder state reset: tensor %s %s on %s after %s %s on %s", *key, *self._key
                )
                self._clear()
                self.resets += 1
            self._key = key
            yield self

    def with_residual(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (flat fp32, owned by the codec) plus the residual owed, in place; under `hold`."""
        if self.error_feedback and self._residual is not None:
            x.add_(self._residual)
        return x

    def keep_residual(self, residual: torch.Tensor) -> None:
        """What this encoding dropped (flat fp32, handed over), to add to the next tensor;
        cleared instead when it holds inf or NaN. Ignored without error feedback."""
        if not self.error_feedback:
            return
        if not bool(residual.isfinite().all()):
            self._residual = None
            return
        self._residual = residual

    def warm_start(self, n: int, m: int, rank: int) -> torch.Tensor | None:
        """The last Q factor [m, rank] of an [n, m] matrix at this rank, or None."""
        if self._warm_key == (n, m, rank):
            return self._warm_q
        return None

    def keep_warm_start(self, n: int, m: int, rank: int, q: torch.Tensor) -> None:
        """Remember Q [m, rank] as the next power iteration's start."""
        self._warm_key = (n, m, rank)
        self._warm_q = q

    def _clear(self) -> None:
        self._key = None
        self._residual = None
        self._warm_key = None
        self._warm_q = None
