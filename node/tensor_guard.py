"""The data plane's screen: activations and gradients with absurd values are refused.

A stage refuses an activation (server side of Stage.Forward) or a gradient
(coming back on a call it made) that is non-finite, or whose root-mean-square
value is more than `robust.data_norm_ratio` times the median of the last
`robust.data_norm_window` tensors of that kind it accepted. The bound is
relative because the scale of activations and gradients depends on the model,
its width and the phase of training: a hard bound would be either useless or
wrong for someone's model; the median of a window follows honest drift (and
gradients shrink by orders of magnitude over a run only over many windows)
while one tensor 1000 times too large stands out. Until 8 tensors of a kind have been
accepted only the finite check applies: a node starting among attackers has
nothing to compare with. Cost: one pass over the tensor, already decoded.

A refused tensor's sender is reported to the coordinator (ReportPeer, kind
DATA) in the background, at most one report in flight per sender; the refusal
itself is INVALID_ARGUMENT (server side) or a failed hop that is rerouted to
another replica (client side).

Except from a sender that is its stage's only replica in the plan: there is no
other replica to reroute to, so refusing its tensors for their scale only stops
the run (seen: a stage restored from its checkpoint four steps behind the others
sent gradients 130-165x the window's median, every microbatch was refused and
replayed for ever). Its tensor is accepted with a warning and the window of that
kind starts again from it: the scale has changed for everyone who sends it. Non-
finite values are refused from anyone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections import deque

import grpc
import torch

from swarmpipe.config import RobustConfig
from swarmpipe.errors import PeerError
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)

WARMUP = 8
NON_FINITE = "contains NaN or infinite values"
REPORT_TIMEOUT_S = 5.0


class PoisonedTensor(PeerError):
    """A tensor the guard refused; its sender is reported."""


class PeerReporter:
    """Sends ReportPeer for a refused sender, in the background, one call per sender at once."""

    def __init__(self, node_id: str, coordinator: coordinator_pb2_grpc.CoordinatorStub) -> None:
        self.node_id = node_id
        self.coordinator = coordinator
        self._pending: dict[str, asyncio.Task[None]] = {}

    def report(self, suspect: str, step: int, reason: str) -> None:
        if not suspect or suspect == self.node_id or suspect in self._pending:
            return
        request = coordinator_pb2.ReportPeerRequest(
            reporter=self.node_id,
            suspect=suspect,
            step=step,
            kind=coordinator_pb2.ReportPeerRequest.KIND_DATA,
            reason=reason,
        )
        task = asyncio.ensure_future(self._send(request))
        self._pending[suspect] = task
        task.add_done_callback(lambda _: self._pending.pop(suspect, None))

    async def _send(self, request: coordinator_pb2.ReportPeerRequest) -> None:
        try:
            await self.coordinator.ReportPeer(request, timeout=REPORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "could not report %s to the coordinator: %s", request.suspect, exc.details()
            )


class TensorGuard:
    """Running medians of accepted activations' and gradients' RMS, and the check against them."""

    def __init__(self, robust: RobustConfig, reporter: PeerReporter | None = None) -> None:
        self.ratio = robust.data_norm_ratio
        self.reporter = reporter
        self._seen: dict[str, deque[float]] = {
            kind: deque(maxlen=robust.data_norm_window) for kind in ("activation", "gradient")
        }
        self.refused = 0
        self.rebaselined = 0
        """Tensors accepted past the bound because their sender had no other replica."""

    def check(
        self, kind: str, tensor: torch.Tensor, *, sender: str, step: int, sole: bool = False
    ) -> None:
        """Accept `tensor` (a "activation" or "gradient") or raise PoisonedTensor, reporting.
        `sole`: the sender is its stage's only replica (see the module's docstring)."""
        reason = self._verdict(kind, tensor)
        if reason is None:
            return
        if sole and not reason.endswith(NON_FINITE):
            self.rebaselined += 1
            logger.warning(
                "accepted a%s from %s although %s: it is its stage's only replica; the "
                "window starts again from it",
                "n" if kind[0] in "aeiou" else "",
                sender,
                reason,
            )
            seen = self._seen[kind]
            seen.clear()
            seen.append(self._rms(tensor))
            return
        self.refused += 1
        logger.warning("refused a%s from %s: %s", "n" if kind[0] in "aeiou" else "", sender, reason)
        if self.reporter is not None:
            self.reporter.report(sender, step, reason)
        raise PoisonedTensor(reason)

    @staticmethod
    def _rms(tensor: torch.Tensor) -> float:
        norm = float(torch.linalg.vector_norm(tensor.double()).item())
        return norm / math.sqrt(tensor.numel())

    def _verdict(self, kind: str, tensor: torch.Tensor) -> str | None:
        if tensor.numel() == 0:
            return None
        if not bool(torch.isfinite(tensor).all()):
            return f"{kind} {NON_FINITE}"
        rms = self._rms(tensor)
        seen = self._seen[kind]
        if len(seen) >= WARMUP:
            median = statistics.median(seen)
            if median > 0 and rms > self.ratio * median:
                return (
                    f"{kind} root-mean-square {rms:.3g} is {rms / median:.3g}x the median of "
                    f"the last {len(seen)} this stage accepted ({median:.3g}); the bound is "
                    f"{self.ratio:g}x"
                )
        seen.append(rms)
        return None
