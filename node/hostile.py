"""A test-only switch that makes a node a hostile replica, to show the robust reduce works.

    SWARMPIPE_HOSTILE="scale:1000"      every node started with it
    SWARMPIPE_HOSTILE="n2=noise"        only node n2 (so one testnet environment can carry it)

At every reduce the node replaces what it sends (its gradient sum, or its
DiLoCo delta) by `scale:F` (the sum times F) or `noise` (Gaussian noise of
the same norm, seeded by node and step). It holds and lists the same tampered
vector as the others receive, so the defence under test is the screen and the
clip, not the manifest's digest check. Unset (every real deployment), nothing
changes.

    SWARMPIPE_RECORD_REDUCE=DIR

makes a node save each reduce's agreed contributions and verdict to
DIR/<node>/step-<N>.pt, so a test can replay the run without the dropped
sender and compare parameters.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `bench hostile --help` stays light
    import torch

ENV = "SWARMPIPE_HOSTILE"
RECORD_ENV = "SWARMPIPE_RECORD_REDUCE"


@dataclass(frozen=True, slots=True)
class Hostile:
    """How a hostile replica tampers with what it sends."""

    mode: str  # "scale" or "noise"
    factor: float = 1.0

    def tamper(self, flat: torch.Tensor, *, node_id: str, step: int) -> torch.Tensor:
        import torch

        if self.mode == "scale":
            return flat * self.factor
        seed = int.from_bytes(hashlib.sha256(f"{node_id}:{step}".encode()).digest()[:8], "little")
        noise = torch.randn(flat.shape, generator=torch.Generator().manual_seed(seed))
        norm = float(torch.linalg.vector_norm(flat))
        scale = norm / max(float(torch.linalg.vector_norm(noise)), 1e-30)
        return (noise * scale).to(flat.dtype)


def parse(text: str, node_id: str) -> Hostile | None:
    """The switch for `node_id`, or None; ValueError naming the expected form."""
    text = text.strip()
    if not text:
        return None
    target, sep, spec = text.partition("=")
    if not sep:
        target, spec = "", text
    if target and target != node_id:
        return None
    mode, _, arg = spec.partition(":")
    if mode == "noise" and not arg:
        return Hostile("noise")
    if mode == "scale":
        try:
            return Hostile("scale", float(arg))
        except ValueError:
            pass
    raise ValueError(f"{ENV}={text!r} must be [NODE=]scale:FACTOR or [NODE=]noise")


def from_env(node_id: str) -> Hostile | None:
    return parse(os.environ.get(ENV, ""), node_id)


def record(
    step: int,
    node_id: str,
    contributions: Mapping[str, tuple[torch.Tensor, int, int]],
    *,
    accepted: tuple[str, ...],
    rejected: Mapping[str, str],
) -> None:
    """Save one reduce's inputs and verdict when a test asked for it (see the module)."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    import torch

    path = Path(folder) / node_id / f"step-{step}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        # The step began again (a held APPLY that benched a replica): keep the reduce it
        # took back beside the one that counts.
        back = path.parent / "taken-back"
        back.mkdir(exist_ok=True)
        path.rename(back / path.name)
    payload = {
        "step": step,
        "contributions": {n: (c[0].clone(), c[1], c[2]) for n, c in contributions.items()},
        "accepted": list(accepted),
        "rejected": dict(rejected),
    }
    torch.save(payload, path)
