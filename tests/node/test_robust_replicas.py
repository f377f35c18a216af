"""Three real replicas over real gRPC, one hostile: every replica drops the same sender."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import torch

from swarmpipe.node.hostile import Hostile, parse
from swarmpipe.node.transport import encode
from swarmpipe.protos import stage_pb2, tensor_pb2
from tests.node.test_replica_sync import Replica, _plan


@pytest.fixture
async def trio() -> AsyncIterator[tuple[Replica, Replica, Replica]]:
    # The direction screen is opt-in (robust.direction_sigmas); these replicas turn it on.
    screen = ["robust.direction_sigmas=3"]
    replicas = Replica("a", screen), Replica("b", screen), Replica("x", screen)
    try:
        for r in replicas:
            await r.start()
        plan = _plan({r.ctx.node_id: r.address for r in replicas})
        for r in replicas:
            r.ctx.router.set_plan(plan)
        yield replicas
    finally:
        for r in replicas:
            await r.close()


async def test_a_scaled_contribution_is_dropped_by_every_replica_alike(
    trio: tuple[Replica, Replica, Replica], caplog: pytest.LogCaptureFixture
) -> None:
    a, b, x = trio
    grad_a, grad_b = a.train_on(1), b.train_on(2)
    x.train_on(3)
    x.replica_sync.hostile = Hostile("scale", 1000.0)
    with caplog.at_level(logging.WARNING):
        results = await asyncio.gather(*(r.replica_sync.reduce(0) for r in trio))
    for total, accepted in results:
        assert total is not None and accepted == 2
        # Exactly what two replicas without x sum: a's then b's, over their tokens only.
        assert torch.equal(total[0], torch.zeros_like(grad_a) + grad_a + grad_b)
        assert total[1:] == (32, 4)
    assert "dropped x's contribution: norm" in caplog.text
    assert "this replica's own contribution was dropped" in caplog.text  # x's own verdict


async def test_noise_of_the_same_norm_is_dropped_by_every_replica_alike(
    trio: tuple[Replica, Replica, Replica], caplog: pytest.LogCaptureFixture
) -> None:
    a, b, x = trio
    grad_a, grad_b = a.train_on(1), b.train_on(2)
    x.train_on(3)
    x.replica_sync.hostile = Hostile("noise")
    with caplog.at_level(logging.WARNING):
        results = await asyncio.gather(*(r.replica_sync.reduce(0) for r in trio))
    for total, accepted in results:
        assert total is not None and accepted == 2
        assert torch.equal(total[0], torch.zeros_like(grad_a) + grad_a + grad_b)
    # The tensor-scale screen (on by default) judges it first: its tensors are equally large.
    assert "dropped x's contribution: its 29 parameter tensors have as equal a" in caplog.text


async def test_noise_beside_one_honest_gradient_at_step_0_is_dropped_by_every_replica(
    trio: tuple[Replica, Replica, Replica], caplog: pytest.LogCaptureFixture
) -> None:
    # b idle: two with traffic and no optimizer moments yet, the case where the noise of
    # `bench hostile` used to go into the sum (nothing told which of the two was noise).
    a, _, x = trio
    grad_a = a.train_on(1)
    x.train_on(3)
    x.replica_sync.hostile = Hostile("noise")
    with caplog.at_level(logging.WARNING):
        results = await asyncio.gather(*(r.replica_sync.reduce(0) for r in trio))
    for total, accepted in results:
        assert total is not None and accepted == 2  # a and idle b
        assert torch.equal(total[0], torch.zeros_like(grad_a) + grad_a)
        assert total[1:] == (16, 2)
    assert caplog.text.count("dropped x's contribution: its 29 parameter tensors") == 2


async def test_three_honest_replicas_take_the_same_centred_clip_step(
    trio: tuple[Replica, Replica, Replica],
) -> None:
    grads = [r.train_on(seed) for r, seed in zip(trio, (1, 2, 3), strict=True)]
    results = await asyncio.gather(*(r.replica_sync.reduce(0) for r in trio))
    first = results[0][0]
    assert first is not None and results[0][1] == 3
    for total, _ in results[1:]:
        assert total is not None and torch.equal(total[0], first[0]) and total[1:] == first[1:]
    plain = grads[0] + grads[1] + grads[2]
    # Close to the plain sum (the clip shortens the farthest offsets a little), not equal.
    assert float((first[0] - plain).norm()) < 0.5 * float(plain.norm())


async def test_a_sender_telling_replicas_different_things_is_dropped_by_all(
    trio: tuple[Replica, Replica, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, x = trio
    grad_a, grad_b = a.train_on(1), b.train_on(2)
    grad_x = x.train_on(3)
    sync = x.replica_sync
    honest_send = sync._send_contribution

    async def equivocate(
        peer: str,
        address: str,
        header: stage_pb2.ReduceHeader,
        encoded: object,
        retry_until: float = 0.0,
    ) -> bool:
        if peer == "b":  # b gets a slightly different vector than a does
            encoded = await encode(
                grad_x * 1.01, tensor_pb2.CODEC_LOSSLESS, x.ctx.links.options, role="reduce"
            )
        return await honest_send(peer, address, header, encoded, retry_until=retry_until)  # type: ignore[arg-type]

    monkeypatch.setattr(sync, "_send_contribution", equivocate)
    (sum_a, n_a), (sum_b, n_b), _ = await asyncio.gather(*(r.replica_sync.reduce(0) for r in trio))
    assert sum_a is not None and sum_b is not None and n_a == n_b == 2
    assert torch.equal(sum_a[0], sum_b[0])
    assert torch.equal(sum_a[0], torch.zeros_like(grad_a) + grad_a + grad_b)


def test_the_switch_names_its_node_and_refuses_nonsense() -> None:
    assert parse("scale:1000", "n1") == Hostile("scale", 1000.0)
    assert parse("n2=noise", "n2") == Hostile("noise")
    assert parse("n2=noise", "n1") is None
    assert parse("", "n1") is None
    with pytest.raises(ValueError, match=r"\[NODE=\]scale:FACTOR"):
        parse("scale:lots", "n1")


async def test_diloco_deltas_times_1000_are_dropped_and_the_others_stay_identical() -> None:
    replicas = [Replica(n, ["pipeline.sync=diloco", "train.steps=4"]) for n in ("a", "b", "x")]
    try:
        for r in replicas:
            await r.start()
        plan = _plan({r.ctx.node_id: r.address for r in replicas})
        for r in replicas:
            r.ctx.router.set_plan(plan)
        for r, seed in zip(replicas, (1, 2, 3), strict=True):
            r.train_on(seed)
            r.ctx.runtime.apply_step(0, None, advance=False)  # a local inner step
        replicas[2].replica_sync.hostile = Hostile("scale", 1000.0)
        counts = await asyncio.gather(*(r.replica_sync.average_parameters(0) for r in replicas))
        assert counts == [2, 2, 2]
        digests = {r.ctx.runtime.parameter_digest() for r in replicas}
        assert len(digests) == 1  # x applied the same outer step: its delta was dropped there too
    finally:
        for r in replicas:
            await r.close()
