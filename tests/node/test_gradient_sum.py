"""A stage's gradient sum over a step does not depend on the order its microbatches'
gradients came back in (node/stage_runtime.py sums them in float64)."""

from __future__ import annotations

import torch

from swarmpipe.config import load_config
from swarmpipe.node.stage_runtime import StageRuntime

CONFIG = load_config(
    None,
    [
        "model.n_layers=4",
        "model.d_model=32",
        "model.n_heads=2",
        "model.context=16",
        "pipeline.stages=2",
        "train.microbatch=2",
    ],
)


def _microbatches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(2, 16, 32, generator=generator),
            torch.randint(0, 256, (2, 16), generator=generator),
        )
        for _ in range(count)
    ]


def _after(order: list[int], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StageRuntime:
    runtime = StageRuntime(CONFIG, 1)  # the last stage: forward, loss and backward at once
    for i in order:
        x, labels = batches[i]
        runtime.forward_last(f"mb{i}", x, labels)
    return runtime


def test_any_order_of_a_steps_microbatches_gives_the_same_bits() -> None:
    batches = _microbatches(12)
    orders = [list(range(12)), list(reversed(range(12))), [5, 0, 11, 3, 8, 1, 10, 2, 7, 4, 9, 6]]
    runtimes = [_after(order, batches) for order in orders]
    sums = [r.local_gradient()[0] for r in runtimes]
    assert all(torch.equal(sums[0], other) for other in sums[1:])
    # ...and so does the step taken with them.
    for r in runtimes:
        r.apply_step(0)
    digests = {r.parameter_digest() for r in runtimes}
    assert len(digests) == 1
    # The float32 running sum the node kept before depends on the order, here: each
    # microbatch's gradient alone, added up in each order.
    alone = StageRuntime(CONFIG, 1)
    each = []
    for i, (x, labels) in enumerate(batches):
        alone.forward_last(f"mb{i}", x, labels)
        each.append(alone.local_gradient()[0].clone())
        alone._clear_sum()
    float32_sums = []
    for order in orders:
        total = torch.zeros_like(sums[0])
        for i in order:
            total += each[i]
        float32_sums.append(total)
    assert not all(torch.equal(float32_sums[0], other) for other in float32_sums[1:])


def test_a_step_starts_its_sum_from_zero() -> None:
    batches = _microbatches(2)
    runtime = _after([0, 1], batches)
    runtime.apply_step(0)
    assert bool((runtime.local_gradient()[0] == 0).all())
    x, labels = batches[0]
    runtime.forward_last("again", x, labels)
    alone = _after([0], batches)
    # Parameters moved, so compare shapes and that the sum holds one microbatch's worth.
    assert runtime.local_gradient()[1] == alone.local_gradient()[1]


def test_a_step_trained_again_after_its_reduce_sums_only_the_new_attempt() -> None:
    # A held APPLY taken back: the same microbatch ids come again. Whatever this replica got
    # the first time, only what it gets the second time counts (a replica alone in its
    # stage too: it takes its sum for the reduce as its peers do).
    batches = _microbatches(3)
    runtime = _after([0, 1, 2], batches)
    first, tokens, samples = runtime.gradient_for_reduce(0, 0)
    assert (tokens, samples) == (96, 6)
    x, labels = batches[1]
    runtime.forward_last("mb1", x, labels)  # attempt 1: one microbatch here, the rest elsewhere
    again, tokens, samples = runtime.gradient_for_reduce(0, 0)
    alone = _after([1], batches).local_gradient()
    assert (tokens, samples) == (32, 2) and torch.equal(again, alone[0])
    # Attempt 2 brings it nothing: nothing counts.
    nothing, tokens, samples = runtime.gradient_for_reduce(0, 0)
    assert (tokens, samples) == (0, 0) and not nothing.any()
    assert not torch.equal(first, again)
