"""The stage runtime: one stage's layers, their saved activations, gradients and optimizer.

Every method here runs on the compute worker's thread, never on the event loop.
Loss convention: the last stage backpropagates the *summed* token loss of each
microbatch, every node accumulates those gradients together with the number of
tokens they came from, and `apply_step` divides by that count before AdamW.
That makes a step's update independent of how the global batch was cut into
microbatches, which is what lets the pipeline match single-process training.

The sum over microbatches is taken in float64 (each microbatch's float32 gradient added
to a float64 accumulator, rounded to float32 once, at the step's end), so it does not
depend on the order the microbatches' gradients came back in, which the links' timing
decides: a stage served by one replica takes the same step, bit for bit, whatever the
timing (plaintext or TLS, loaded machine or not). Exact unless one parameter's gradients
in a step span more than about 2**24 in magnitude, and even then the float64 rounding
changes the float32 result with a chance of about 1e-9. It costs 8 bytes a parameter.

Overlapping steps (train.step_overlap, a depth k): up to k+1 steps may be open at once, on
up to k+1 parameter versions (a version is named by the optimizer steps applied to it; the
coordinator says which one each step trains on, and every hop carries it). The optimizer's
parameters (the module's) are then never used for compute: each version a step trains on
is a frozen copy of them, made the first time a microbatch needs it or, at the latest, just
before the optimizer step that would overwrite it, and forward and backward run on it
through `torch.func.functional_call`. So an optimizer step never changes tensors an open
step's graph holds. Gradient sums are kept per (step, version): the reduce of step s takes
step s's alone while steps s+1 ... s+k keep accumulating. A step s+j opened while step
s+j-k at the earliest was the current one, on its parameters, so after step s is applied
only versions s+1-k and later can still be trained on; older copies and sums are freed.
Without overlap the module's parameters are used directly, as before.

A microbatch contributes to this node's gradients at most once per step: when
a sender resends one after a failure further up (the downstream part already
ran), the repeat only computes the input gradient the sender needs.

With `model.bottleneck` on, a stage after the first starts with an up-projection
that re-adds token embeddings: it takes k-wide activations and the microbatch's
token ids, and its input gradient is k wide too.

Device and precision: the stage's parameters, gradients and AdamW state live on
`device` (node/device.py picks it) in fp32. Every method takes tensors wherever
they are (decoded on the host or on the device) and moves them there; what it
returns stays on the device, so the codec encodes it there and only the
payload crosses to the host. With `train.precision = "bf16"` forward runs under
bfloat16 autocast (backward follows the same casts); parameters, their
gradients and the optimizer stay fp32, and the loss is summed in fp32.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from swarmpipe.config import RunConfig
from swarmpipe.errors import PeerError
from swarmpipe.model import build_optimizer, build_stage, token_loss_sum
from swarmpipe.node.device import to_device
from swarmpipe.node.diloco import OuterOptimizer
from swarmpipe.node.stage_state import ReceivedState, StateSnapshot, take_snapshot

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Saved:
    microbatch_id: str
    inputs: torch.Tensor
    outputs: torch.Tensor
    step: int
    trains_on: int
    params: list[torch.Tensor]
    """The tensors its graph was built on: the module's parameters, or a frozen version."""


@dataclass(slots=True)
class _StepSum:
    """One step's gradient sum on one parameter version."""

    summed: list[torch.Tensor] | None = None
    """Float64, one per parameter (None: nothing yet)."""
    tokens: int = 0
    samples: int = 0
    contributed: set[str] = field(default_factory=set)
    reduced: bool = False
    """Taken for the replicas' reduce. A microbatch of the step after that means the
    coordinator took the step back (a held APPLY that benched a replica) and trains it
    again on the same parameters: the sum starts afresh."""


@dataclass(frozen=True, slots=True)
class LastStageResult:
    grad_input: torch.Tensor | None
    loss_sum: float
    tokens: int


class StageRuntime:
    """Forward, backward, accumulation and the optimizer step of one pipeline stage."""

    def __init__(self, config: RunConfig, stage: int, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.stage = stage
        self.device = torch.device(device)
        self.num_stages = config.pipeline.stages
        self.is_first = stage == 0
        self.is_last = stage == self.num_stages - 1
        # Built on the host (each layer from its own seeded CPU generator, so every device
        # starts from the same numbers), then moved before the optimizer sees it.
        self.module = build_stage(config, stage).to(self.device)
        self.module.train()
        # Whether forward needs the microbatch's token ids beside the activations.
        self.needs_tokens = self.module.needs_tokens
        m = config.model
        # What arrives from the previous stage is k wide after a bottleneck boundary.
        self.input_width = m.bottleneck if m.bottleneck and not self.is_first else m.d_model
        self.optimizer = build_optimizer(self.module, config)
        self.step = 0
        self.duplicates_skipped = 0
        self._saved: dict[str, _Saved] = {}
        self._sums: dict[tuple[int, int], _StepSum] = {}
        """(step, version it trains on) -> its gradient sum so far."""
        self.depth = config.train.overlap_depth
        """train.step_overlap: how many steps may be open ahead of the current one."""
        self.overlap = self.depth > 0
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        """train.step_overlap: frozen parameter versions open steps train on, by version."""
        p = config.pipeline
        self.outer: OuterOptimizer | None = None
        if p.sync == "diloco":
            self.outer = OuterOptimizer(
                list(self.module.parameters()),
                lr=p.diloco_outer_lr,
                momentum=p.diloco_outer_momentum,
            )

    # -- input checks (called before any compute) ------------------------

    def check_activation_header(self, shape: Sequence[int], sample_count: int) -> None:
        """Refuse a microbatch whose declared size this stage would not take, before any of
        its payload is buffered: at most train.microbatch samples (every lease, training or
        evaluation, is cut to that), and an activation of [B, T, D], or [B, T, k] after a
        bottleneck boundary (a custom model factory declares only its batch dimension)."""
        if self.is_first:
            raise PeerError("stage 0 takes token ids from its own data, not activations")
        most = self.config.train.microbatch
        if not 1 <= sample_count <= most:
            raise PeerError(
                f"sample_count {sample_count} is out of range: this run's microbatches hold "
                f"1 to {most} samples (train.microbatch)"
            )
        if self.config.model.factory:
            if not shape or shape[0] != sample_count:
                raise PeerError(
                    f"activation of {len(shape)} dimensions does not start with the "
                    f"microbatch's {sample_count} samples"
                )
            return
        want = [sample_count, self.config.model.context, self.input_width]
        if len(shape) != len(want) or list(shape) != want:
            # Only the first dimensions are shown: a header can carry a million.
            shown = ", ".join(str(n) for n in list(shape[:8])) + (", ..." if len(shape) > 8 else "")
            raise PeerError(f"activation of shape [{shown}] is not the expected {want}")

    def check_activation(self, x: torch.Tensor, sample_count: int) -> None:
        """Reject an activation this stage cannot take, with a message naming the problem."""
        if self.is_first:
            raise PeerError("stage 0 takes token ids from its own data, not activations")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise PeerError(f"activation dtype {x.dtype} is not a floating type")
        if x.ndim < 1 or x.shape[0] != sample_count:
            raise PeerError(
                f"activation shape {list(x.shape)} does not start with the microbatch's "
                f"{sample_count} samples"
            )
        if not self.config.model.factory:
            want = [sample_count, self.config.model.context, self.input_width]
            if list(x.shape) != want:
                raise PeerError(f"activation shape {list(x.shape)} is not the expected {want}")
        if not bool(torch.isfinite(x).all()):
            raise PeerError("activation contains NaN or infinite values")

    def check_tokens(self, tokens: torch.Tensor | None) -> None:
        """Reject a microbatch without token ids when this stage re-adds token embeddings.

        Their range is checked where they are decoded (node/token_ids.py).
        """
        if self.needs_tokens and tokens is None:
            raise PeerError(
                "this stage re-adds token embeddings (model.bottleneck) and needs the "
                "microbatch's token ids (MicrobatchHeader.first_tokens); the sender sent none"
            )

    # -- compute -----------------------------------------------------------

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        x = to_device(x, self.device)
        if self.is_first:
            return x
        return x.detach().float().requires_grad_(True)

    def _on_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else to_device(t, self.device)

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        """bfloat16 autocast on the stage's device under train.precision = "bf16"."""
        enabled = self.config.train.precision == "bf16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled):
            yield

    # -- parameter versions (train.step_overlap) -----------------------------

    def check_step(self, step: int, trains_on: int) -> None:
        """Refuse (PeerError) a microbatch of `step` on version `trains_on` that this node
        cannot compute: without overlap only the current step, on its own parameters; with
        it the current step or one of the `depth` after it, on a version this node holds
        that is at most `depth` steps older than the step."""
        if not self.overlap:
            if step != self.step or trains_on != step:
                raise PeerError(f"microbatch is for step {step}; this node is at step {self.step}")
            return
        depth = self.depth
        if not self.step <= step <= self.step + depth or not step - depth <= trains_on <= step:
            raise PeerError(
                f"microbatch is for step {step} on the parameters of step {trains_on}; this "
                f"node is at step {self.step}"
            )
        if trains_on not in self._versions and trains_on != self.step:
            raise PeerError(
                f"the parameters of step {trains_on} are no longer held here "
                f"(this node is at step {self.step})"
            )

    def _version(self, trains_on: int) -> dict[str, torch.Tensor]:
        """The frozen parameters of version `trains_on` (made from the module's parameters,
        which are that version, the first time it is asked for)."""
        version = self._versions.get(trains_on)
        if version is None:
            if trains_on != self.step:
                raise PeerError(
                    f"the parameters of step {trains_on} are not held here (this node is at "
                    f"step {self.step})"
                )
            version = self._versions[trains_on] = self._freeze()
        return version

    def _freeze(self) -> dict[str, torch.Tensor]:
        return {
            name: p.detach().clone().requires_grad_(p.requires_grad)
            for name, p in self.module.named_parameters()
        }

    def _run(
        self, inputs: torch.Tensor, tokens: torch.Tensor | None, trains_on: int | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The stage's output and the parameter tensors it was computed from."""
        with self._autocast():
            if not self.overlap:
                out: torch.Tensor = self.module(inputs, self._on_device(tokens))
                return out, list(self.module.parameters())
            version = self._version(self.step if trains_on is None else trains_on)
            out = functional_call(self.module, version, (inputs, self._on_device(tokens)))
            return out, list(version.values())

    def forward(
        self,
        key: str,
        microbatch_id: str,
        x: torch.Tensor,
        tokens: torch.Tensor | None = None,
        *,
        step: int | None = None,
        trains_on: int | None = None,
    ) -> torch.Tensor:
        """Run the stage and keep the graph under `key` until backward or discard.

        `tokens` [B, T] are the microbatch's ids, needed after a bottleneck boundary.
        `step` (default: the current one) is the step whose sum the gradient joins and
        `trains_on` (default: `step`) the parameter version it is computed on.
        """
        step = self.step if step is None else step
        trains_on = step if trains_on is None else trains_on
        inputs = self._prepare(x)
        outputs, params = self._run(inputs, tokens, trains_on)
        self._saved[key] = _Saved(microbatch_id, inputs, outputs, step, trains_on, params)
        return outputs.detach()

    def backward(self, key: str, grad_output: torch.Tensor) -> torch.Tensor | None:
        """Backpropagate the gradient from downstream; return the input's gradient."""
        saved = self._saved.pop(key, None)
        if saved is None:
            raise PeerError("the microbatch's step was applied while its gradient came back")
        if grad_output.shape != saved.outputs.shape:
            raise PeerError(
                f"gradient shape {list(grad_output.shape)} does not match the output "
                f"shape {list(saved.outputs.shape)}"
            )
        if not bool(torch.isfinite(grad_output).all()):
            raise PeerError("gradient contains NaN or infinite values")
        grad = to_device(grad_output, self.device).to(saved.outputs.dtype)
        return self._backprop(saved, saved.outputs, grad)

    def forward_last(
        self,
        microbatch_id: str,
        x: torch.Tensor,
        labels: torch.Tensor,
        tokens: torch.Tensor | None = None,
        *,
        step: int | None = None,
        trains_on: int | None = None,
    ) -> LastStageResult:
        """The last stage: forward, loss, and backward at once (`step` and `trains_on` as
        in `forward`)."""
        step = self.step if step is None else step
        trains_on = step if trains_on is None else trains_on
        inputs = self._prepare(x)
        labels = to_device(labels, self.device)
        logits, params = self._run(inputs, tokens, trains_on)
        loss = token_loss_sum(logits, labels)
        saved = _Saved(microbatch_id, inputs, logits, step, trains_on, params)
        grad_input = self._backprop(saved, loss, None)
        return LastStageResult(grad_input, float(loss.detach()), labels.numel())

    @torch.no_grad()
    def forward_eval(
        self, x: torch.Tensor, tokens: torch.Tensor | None = None, *, trains_on: int | None = None
    ) -> torch.Tensor:
        """Forward only, for evaluation: nothing is saved and no gradient will come back.
        `trains_on` is the version measured (default: the current parameters)."""
        x = to_device(x, self.device)
        out, _ = self._run(x if self.is_first else x.float(), tokens, trains_on)
        return out

    @torch.no_grad()
    def evaluate_last(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        tokens: torch.Tensor | None = None,
        *,
        trains_on: int | None = None,
    ) -> LastStageResult:
        """The last stage of an evaluation: forward and the summed token loss, no backward."""
        logits = self.forward_eval(x, tokens, trains_on=trains_on)
        loss = token_loss_sum(logits, to_device(labels, self.device))
        return LastStageResult(None, float(loss), labels.numel())

    def _backprop(
        self, saved: _Saved, outputs: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        key = (saved.step, saved.trains_on)
        total = self._sums.get(key)
        if total is None or total.reduced:
            total = self._sums[key] = _StepSum()
        first_time = saved.microbatch_id not in total.contributed
        if first_time:
            torch.autograd.backward(outputs, grad)
            self._add_to_sum(total, saved.params)
            total.contributed.add(saved.microbatch_id)
            tokens = saved.inputs.shape[0] * (saved.inputs.shape[1] if saved.inputs.ndim > 1 else 1)
            total.tokens += int(tokens)
            total.samples += int(saved.inputs.shape[0])
            return None if self.is_first else saved.inputs.grad
        self.duplicates_skipped += 1
        logger.debug("microbatch %s already contributed this step", saved.microbatch_id)
        if self.is_first:
            return None
        (grad_input,) = torch.autograd.grad(outputs, saved.inputs, grad)
        return grad_input

    @staticmethod
    def _add_to_sum(total: _StepSum, params: list[torch.Tensor]) -> None:
        """Move this microbatch's gradients (alone in `.grad`) into the float64 sum."""
        if total.summed is None:
            total.summed = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        for p, acc in zip(params, total.summed, strict=True):
            if p.grad is not None:
                acc.add_(p.grad)
                p.grad = None

    def _clear_sum(self) -> None:
        """Zero every gradient sum's values (their counts stay)."""
        for total in self._sums.values():
            for acc in total.summed or []:
                acc.zero_()

    def _sum_of(self, step: int | None, trains_on: int | None) -> _StepSum:
        step = self.step if step is None else step
        return self._sums.get((step, step if trains_on is None else trains_on), _StepSum())

    @property
    def tokens_accumulated(self) -> int:
        """Tokens in the current step's gradient sum (on its own parameters)."""
        return self._sum_of(None, None).tokens

    @property
    def samples_accumulated(self) -> int:
        return self._sum_of(None, None).samples

    def gradient_sum(
        self, step: int | None = None, trains_on: int | None = None
    ) -> list[torch.Tensor]:
        """A step's gradient sum so far (default: the current step on its own parameters),
        one float32 tensor per parameter (zeros if none)."""
        summed = self._sum_of(step, trains_on).summed
        if summed is None:
            return [torch.zeros_like(p, dtype=torch.float32) for p in self.module.parameters()]
        return [total.float() for total in summed]

    def discard(self, key: str) -> None:
        self._saved.pop(key, None)

    @property
    def saved_count(self) -> int:
        return len(self._saved)

    def local_gradient(
        self, step: int | None = None, trains_on: int | None = None
    ) -> tuple[torch.Tensor, int, int]:
        """This replica's gradient sum of a step (default: the current one, on its own
        parameters) as one flat fp32 vector, with its token and sample counts."""
        total = self._sum_of(step, trains_on)
        flat = torch.cat([g.reshape(-1) for g in self.gradient_sum(step, trains_on)])
        return flat, total.tokens, total.samples

    def gradient_for_reduce(self, step: int, trains_on: int) -> tuple[torch.Tensor, int, int]:
        """`local_gradient`, taken for the replicas' reduce of `step`. Taken a second time,
        the step began again (a held APPLY taken back): only what came since counts, and a
        replica that got none of the step's microbatches the second time has nothing."""
        key = (step, trains_on)
        total = self._sums.get(key)
        if total is None or total.reduced:
            total = self._sums[key] = _StepSum()
        total.reduced = True
        return self.local_gradient(step, trains_on)

    @property
    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def apply_step(
        self,
        step: int,
        reduced: tuple[torch.Tensor, int, int] | None = None,
        *,
        advance: bool = True,
        trains_on: int | None = None,
    ) -> int:
        """Average the gradients, step AdamW, and move to step+1.

        `reduced` is the (flat gradient sum, tokens, samples) over every replica
        of the stage, summed in the same order on each, so replicas take
        bit-identical steps; None means this replica is the stage's only one.
        Returns the samples that contributed. Idempotent per step, so a repeated
        APPLY announcement (MQTT delivers at least once) steps only once.
        `advance=False` (a DiLoCo round's last step) leaves the step number for
        `outer_step` to move, so the state is never seen between the two.
        `trains_on` is the version the coordinator says the step trained on (default:
        `step`): only that sum is applied; a sum of another version (a step the coordinator
        began again) is dropped. Microbatches of the next step keep their graphs and sums.
        """
        if step != self.step:
            return 0
        own = self._sums.get((step, step if trains_on is None else trains_on), _StepSum())
        if reduced is not None:
            flat, tokens, samples = reduced
            offset = 0
            for p in self.module.parameters():
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).to(p.device, p.dtype, copy=True)
                offset += n
        else:
            tokens, samples = own.tokens, own.samples
            if own.summed is not None:
                for p, total in zip(self.module.parameters(), own.summed, strict=True):
                    p.grad = total.to(p.dtype)
        if self.overlap:
            # Steps open ahead may train on these parameters: keep them before they change.
            self._version(step)
        if tokens:
            scale = 1.0 / tokens
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.outer is not None:
            self.outer.round_samples += samples
        # What later steps still train on stays: graphs and sums of later steps, and the
        # versions they may use (`step + 1 - depth` and newer: a step open now opened while
        # at most `depth` steps before it were, on the current one's parameters).
        self._sums = {k: v for k, v in self._sums.items() if k[0] > step}
        self._saved = {k: v for k, v in self._saved.items() if v.step > step}
        oldest = step + 1 - self.depth
        self._versions = {v: t for v, t in self._versions.items() if v >= oldest}
        if advance:
            self.step = step + 1
        return samples

    def outer_round_ends(self, step: int) -> bool:
        """DiLoCo: whether the replicas average their parameters after applying `step`."""
        h = self.config.pipeline.diloco_inner_steps
        return self.outer is not None and (
            (step + 1) % h == 0 or step + 1 == self.config.train.steps
        )

    def parameter_delta(self) -> tuple[torch.Tensor, int, int]:
        """DiLoCo: this replica's scaled delta of the round, as a reduce contribution."""
        assert self.outer is not None
        delta, samples = self.outer.local_delta()
        return delta, 0, samples

    def outer_step(self, step: int, reduced: tuple[torch.Tensor, int, int]) -> None:
        """DiLoCo: apply the replicas' summed scaled deltas (same on every replica).

        Ends `step` (its inner step was applied with advance=False).
        """
        assert self.outer is not None
        self.outer.step(to_device(reduced[0], self.device), reduced[2])
        self.step = step + 1

    def nudge_for_test(self) -> None:
        """Add 1e-3 to one parameter (node/fault_points.py `apply.drift`): this replica then
        differs from its stage's others, as after a fault the reduce cannot see."""
        with torch.no_grad():
            next(iter(self.module.parameters())).view(-1)[0] += 1e-3

    def parameter_digest(self) -> str:
        """A short hash of the parameters: equal on replicas that stayed in step."""
        h = hashlib.sha256()
        for p in self.module.parameters():
            host = p.detach().reshape(-1).contiguous().cpu()
            h.update(host.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    # -- state transfer and checkpoints (compute thread) -----------------

    def export_state(self, *, node_id: str) -> StateSnapshot:
        """Clone the stage's parameters, AdamW state and step number at this step boundary."""
        return take_snapshot(
            self.module,
            self.optimizer,
            step=self.step,
            run_id=self.config.run_id,
            stage=self.stage,
            num_stages=self.num_stages,
            node_id=node_id,
            run_config=self.config.to_json(),
        )

    def import_state(self, state: ReceivedState, *, step: int | None = None) -> None:
        """Replace the stage's state with a checked one; `step` overrides its step number
        (a checkpoint from an earlier step resumes at the swarm's current step)."""
        state.load_into(self.module, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self._sums.clear()
        self._versions.clear()
        self._saved.clear()
        self.step = state.step if step is None else step
        if self.outer is not None:
            # The state stream does not carry DiLoCo's anchor and outer momentum
            # yet: start a round from what arrived, which matches the others only
            # at a round boundary and with no outer momentum.
            momentum = self.outer.momentum
            self.outer = OuterOptimizer(
                list(self.module.parameters()), lr=self.outer.lr, momentum=momentum
            )
            mid_round = self.step % self.config.pipeline.diloco_inner_steps != 0
            if self.step and (mid_round or momentum):
                logger.warning(
                    "joined a running DiLoCo run at step %d: the anchor and outer momentum are "
                    "not transferred yet, so this replica may drift from the others",
                    self.step,
                )
