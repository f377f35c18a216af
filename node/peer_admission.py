"""Which callers a node's Stage server lets in: nodes of the current plan, by credential.

Every call but the health check needs a credential signed by the run's coordinator
(transport/auth.py), checked with the public key the node got at Join; before Join the
node admits nobody. Reflection shows every service to any node of the run (in the plan or
not) and the health service alone to anyone else. A caller must then be in the current
plan (a replica of any stage, or a node the plan moves), except for FetchState, which a
node admitted to this stage may call before it is in any plan (the stage its credential
names, or a move to this stage). A node the organiser revoked or drained is in no stage of
the plan, so its calls are refused from the plan that drops it. The Reduce and Forward
handlers check in turn that the sender a message names is the caller (`caller`).
"""

from __future__ import annotations

from typing import Any

from swarmpipe.protos import control_pb2
from swarmpipe.transport.auth import (
    REFLECTION,
    ROLE_COORDINATOR,
    Claim,
    Refusal,
    Verifier,
    caller_claim,
    denied,
)

FETCH_STATE = "/swarmpipe.v1.Stage/FetchState"


class PeerAdmission:
    """The Stage server's rule; the daemon gives it the run's key at Join and its stage."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.verifier: Verifier | None = None
        self.plan: control_pb2.Plan | None = None
        """The latest plan; the daemon sets it with the router's."""
        self.stage = -1
        """The stage this node serves (or is moving to)."""

    def policy(self, method: str, metadata: Any) -> Refusal | None:
        claim = caller_claim(self.verifier, metadata)
        if isinstance(claim, Refusal):
            return claim
        if claim.role == ROLE_COORDINATOR or method.startswith(REFLECTION):
            return None
        plan = self.plan
        if plan is None:
            return denied("this node has no plan yet: it serves nobody")
        if claim.node_id in plan.revoked or claim.node_id in plan.drained:
            return denied(f"node {claim.node_id!r} is out of the run")
        in_plan = any(r.node_id == claim.node_id for s in plan.stages for r in s.replicas)
        moving_to = {m.node_id: m.stage for m in plan.moves}
        if method == FETCH_STATE:
            if (
                in_plan
                or claim.stage == self.stage
                or moving_to.get(claim.node_id, -1) == self.stage
            ):
                return None
            return denied(f"node {claim.node_id!r} was not admitted to stage {self.stage}")
        if in_plan or claim.node_id in moving_to:
            return None
        return denied(f"node {claim.node_id!r} is not in the current plan")

    def caller(self, metadata: Any) -> str:
        """The node id of a call's (already checked) credential."""
        claim = caller_claim(self.verifier, metadata)
        return claim.node_id if isinstance(claim, Claim) else ""
