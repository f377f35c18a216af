"""train.step_overlap in the stage runtime: steps in flight on several parameter versions give
the gradients each would give alone, and the optimizer step never touches an open graph."""

from __future__ import annotations

import copy

import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.errors import PeerError
from swarmpipe.node.stage_runtime import StageRuntime

SETTINGS = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.context=16",
    "pipeline.stages=2",
    "train.microbatch=2",
]
OVERLAP = load_config(None, [*SETTINGS, "train.step_overlap=true"])
PLAIN = load_config(None, SETTINGS)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    return tokens, torch.randint(0, 256, (2, 16), generator=g)


class Pipe:
    """Stage 0 and stage 1 of the model in this process; a microbatch in two halves, so
    microbatches of two steps can interleave with an optimizer step between."""

    def __init__(self, overlap: bool | int) -> None:
        if isinstance(overlap, bool):
            config = OVERLAP if overlap else PLAIN
        else:
            config = load_config(None, [*SETTINGS, f"train.step_overlap={overlap}"])
        self.stages = [StageRuntime(config, 0), StageRuntime(config, 1)]

    def start(self, name: str, seed: int, step: int, trains_on: int) -> tuple[torch.Tensor, ...]:
        tokens, labels = _batch(seed)
        out = self.stages[0].forward(name, name, tokens, step=step, trains_on=trains_on)
        return out, labels

    def finish(
        self, name: str, started: tuple[torch.Tensor, ...], step: int, trains_on: int
    ) -> None:
        out, labels = started
        last = self.stages[1].forward_last(name, out, labels, step=step, trains_on=trains_on)
        assert last.grad_input is not None
        self.stages[0].backward(name, last.grad_input)

    def run(self, name: str, seed: int, step: int, trains_on: int) -> None:
        self.finish(name, self.start(name, seed, step, trains_on), step, trains_on)

    def sums(self, step: int, trains_on: int) -> list[torch.Tensor]:
        return [s.local_gradient(step, trains_on)[0] for s in self.stages]

    def apply(
        self,
        step: int,
        trains_on: int,
        reduced: list[tuple[torch.Tensor, int, int]] | None = None,
    ) -> None:
        for i, s in enumerate(self.stages):
            s.apply_step(step, None if reduced is None else reduced[i], trains_on=trains_on)

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for s in self.stages for p in s.module.parameters()]


def test_two_steps_interleaved_on_two_versions_equal_each_computed_alone() -> None:
    pipe = Pipe(overlap=True)
    # Step 0 (a drain point) and step 1 (opened ahead) both train on version 0. Step 1's
    # first microbatch is half way through when step 0 is applied.
    pipe.run("a", 1, step=0, trains_on=0)
    c = pipe.start("c", 3, step=1, trains_on=0)
    pipe.run("b", 2, step=0, trains_on=0)
    step0 = pipe.sums(0, 0)
    pipe.apply(0, 0)  # version 1: the optimizer changes the module's parameters
    pipe.finish("c", c, step=1, trains_on=0)  # its graph was built on version 0
    # Step 2 opens ahead on version 1 while step 1 still trains on version 0.
    e = pipe.start("e", 5, step=2, trains_on=1)
    pipe.run("d", 4, step=1, trains_on=0)
    step1 = pipe.sums(1, 0)
    pipe.apply(1, 0)
    pipe.finish("e", e, step=2, trains_on=1)
    step2 = pipe.sums(2, 1)

    # Each step alone, on a pipeline without overlap holding that version.
    at_v0 = Pipe(overlap=False)
    at_v0.run("a", 1, 0, 0)
    at_v0.run("b", 2, 0, 0)
    for ours, alone in zip(step0, at_v0.sums(0, 0), strict=True):
        assert torch.equal(ours, alone)
    fresh = Pipe(overlap=False)
    fresh.run("c", 3, 0, 0)
    fresh.run("d", 4, 0, 0)
    for ours, alone in zip(step1, fresh.sums(0, 0), strict=True):
        assert torch.equal(ours, alone)
    # Version 1 is AdamW(version 0, step 0's gradient); step 2's gradient is taken there.
    at_v0.apply(0, 0)
    expected_g1 = [s.local_gradient(0, 0) for s in fresh.stages]
    at_v0.run("e", 5, 1, 1)
    for ours, alone in zip(step2, at_v0.sums(1, 1), strict=True):
        assert torch.equal(ours, alone)
    # Version 2 = AdamW(version 1, step 1's gradient taken at version 0): the delayed update.
    at_v0.stages[0]._sums.clear()
    at_v0.stages[1]._sums.clear()
    at_v0.apply(1, 1, expected_g1)
    for ours, alone in zip(pipe.parameters(), at_v0.parameters(), strict=True):
        assert torch.equal(ours, alone)


def test_versions_no_open_step_trains_on_are_freed_and_refused() -> None:
    pipe = Pipe(overlap=True)
    stage = pipe.stages[1]
    pipe.run("a", 1, step=0, trains_on=0)
    pipe.apply(0, 0)
    stage.check_step(1, 0)  # step 1 opened ahead on version 0: still held
    stage.check_step(2, 1)  # step 2 on version 1, the module's parameters now
    pipe.run("c", 3, step=1, trains_on=0)
    pipe.apply(1, 0)
    assert set(stage._versions) <= {1, 2}  # version 0 is freed: no open step trains on it
    with pytest.raises(PeerError, match="parameters of step 0"):
        stage.check_step(2, 0)
    with pytest.raises(PeerError, match="step 1"):
        stage.check_step(1, 0)  # applied already
    with pytest.raises(PeerError, match="step 4"):
        stage.check_step(4, 3)  # two steps ahead


def test_without_overlap_the_step_must_be_the_current_one() -> None:
    stage = StageRuntime(PLAIN, 1)
    stage.check_step(0, 0)
    with pytest.raises(PeerError, match="this node is at step 0"):
        stage.check_step(1, 0)


def test_at_depth_3_steps_on_three_versions_at_once_equal_each_computed_alone() -> None:
    # Depth 3 in its steady state: step s trains on version max(0, s - 3). Microbatches of
    # steps 2 to 5 are in flight on versions 0, 1 and 2 at once, each cut in two halves with
    # optimizer steps between them.
    depth, steps = 3, 6
    trains_on = [max(0, s - depth) for s in range(steps)]
    seeds = {s: (10 * s + 1, 10 * s + 2) for s in range(steps)}
    pipe = Pipe(overlap=depth)
    held: dict[int, set[int]] = {}

    def start(s: int, i: int) -> tuple[torch.Tensor, ...]:
        return pipe.start(f"{s}{i}", seeds[s][i], step=s, trains_on=trains_on[s])

    def finish(s: int, i: int, started: tuple[torch.Tensor, ...]) -> None:
        pipe.finish(f"{s}{i}", started, step=s, trains_on=trains_on[s])

    def run(s: int, i: int) -> None:
        finish(s, i, start(s, i))

    sums: dict[int, list[torch.Tensor]] = {}

    def apply(s: int) -> None:
        sums[s] = pipe.sums(s, trains_on[s])
        pipe.apply(s, trains_on[s])
        held[s] = set(pipe.stages[0]._versions)

    half = {(s, 0): start(s, 0) for s in range(4)}  # steps 0-3 open, all on version 0
    finish(0, 0, half.pop((0, 0)))
    run(0, 1)
    apply(0)  # version 1
    half[4, 0] = start(4, 0)  # step 4 opens on version 1
    finish(1, 0, half.pop((1, 0)))
    run(1, 1)
    apply(1)  # version 2
    half[5, 0] = start(5, 0)  # step 5 opens on version 2: versions 0, 1, 2 all in flight
    assert set(pipe.stages[0]._versions) == {0, 1, 2}
    finish(2, 0, half.pop((2, 0)))
    run(2, 1)
    apply(2)
    finish(4, 0, half.pop((4, 0)))
    finish(3, 0, half.pop((3, 0)))
    run(3, 1)
    apply(3)
    run(4, 1)
    apply(4)
    finish(5, 0, half.pop((5, 0)))
    run(5, 1)
    apply(5)
    # Versions are freed once no open step can train on them (steps 4, 5 on 1, 2 after 3).
    assert held[2] == {0, 1, 2} and held[3] == {1, 2, 3} and held[5] == {3, 4, 5}

    # The same rule one step at a time, without overlap: step s's gradient taken alone on a
    # copy of version trains_on[s], applied to the newest parameters.
    newest = Pipe(overlap=False)
    versions = [copy.deepcopy(newest)]
    for s in range(steps):
        at = copy.deepcopy(versions[trains_on[s]])
        v = trains_on[s]
        at.run(f"{s}0", seeds[s][0], v, v)
        at.run(f"{s}1", seeds[s][1], v, v)
        for ours, alone in zip(sums[s], at.sums(v, v), strict=True):
            assert torch.equal(ours, alone)
        newest.apply(s, s, [stage.local_gradient(v, v) for stage in at.stages])
        versions.append(copy.deepcopy(newest))
    for ours, alone in zip(pipe.parameters(), newest.parameters(), strict=True):
        assert torch.equal(ours, alone)


def test_at_depth_3_a_hop_is_refused_beyond_the_depth_or_on_a_version_gone() -> None:
    stage = Pipe(overlap=3).stages[1]
    stage.check_step(3, 0)  # three steps ahead, on the current parameters
    with pytest.raises(PeerError, match="step 4"):
        stage.check_step(4, 0)  # four ahead
    for s in range(3):
        stage.apply_step(s)
    stage.check_step(5, 2)
    stage.check_step(3, 0)  # version 0 is still held: step 3 may train on it
    with pytest.raises(PeerError, match="on the parameters of step 1;"):
        stage.check_step(5, 1)  # more than three steps old
    stage.apply_step(3)
    assert set(stage._versions) == {1, 2, 3}  # no step open now can train on version 0
    with pytest.raises(PeerError, match="step 4 on the parameters of step 0"):
        stage.check_step(4, 0)
