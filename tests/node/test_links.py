"""A node's links: transfers feed the meter, auto mode follows the link, changes are recorded."""

from __future__ import annotations

import time

import pytest
import torch

from swarmpipe.compression import CODECS_BY_NAME
from swarmpipe.errors import ConfigError
from swarmpipe.node.links import MAX_CHANGES, Links
from swarmpipe.node.transport import EncodeOptions
from swarmpipe.protos import tensor_pb2

ACTIVATION = torch.randn(8, 64, 128)  # 256 KiB lossless, 33 KiB int4


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _links() -> tuple[Links, FakeClock]:
    clock = FakeClock(100.0)
    links = Links(clock=clock, wall_clock=lambda: clock.now + 1e9)
    links.configure(limit_bytes_per_second=0.0, options=EncodeOptions(block_size=256))
    return links, clock


async def _send(links: Links, clock: FakeClock, peer: str, nbytes: int, rate: float) -> None:
    """One transfer whose bytes take nbytes / rate seconds to leave."""
    async with links.transfer(peer, "activation") as link:
        await link.pace(nbytes)
        clock.now += nbytes / rate


def _name(codec: int) -> str:
    return next(name for name, c in CODECS_BY_NAME.items() if c.codec_id == codec)


async def test_auto_starts_lossless_then_follows_the_measured_link() -> None:
    links, clock = _links()
    auto = 0
    assert _name(links.codec_for("n1", "activation", ACTIVATION, step=0, requested=auto)) == (
        "lossless"
    )
    links.record_compute(0.05)
    lossless = ACTIVATION.numel() * 4
    # A slow link (1 MB/s): only int4's 33 KiB crosses within the 50 ms budget.
    await _send(links, clock, "n1", lossless, rate=1e6)
    assert links.bytes_per_second("n1") == pytest.approx(1e6)
    codec = links.codec_for("n1", "activation", ACTIVATION, step=1, requested=auto)
    assert _name(codec) == "int4"
    # The link speeds up a hundredfold: back to lossless once the estimate has followed and
    # the chooser has seen it stay fast.
    codecs = []
    for _ in range(12):
        await _send(links, clock, "n1", lossless, rate=1e8)
        codecs.append(links.codec_for("n1", "activation", ACTIVATION, step=5, requested=auto))
    assert _name(codecs[-1]) == "lossless" and _name(codecs[0]) == "int4"
    [estimate] = links.snapshot()
    assert estimate.peer == "n1" and estimate.direction == "activation"
    assert estimate.wire_bytes == 13 * lossless
    timeline = [(c.step, _name(c.codec)) for c in estimate.changes]
    assert timeline == [(0, "lossless"), (1, "int4"), (5, "lossless")]
    assert estimate.changes[1].bytes_per_second == pytest.approx(1e6)
    assert estimate.changes[1].budget_seconds == pytest.approx(0.05)
    assert estimate.changes[1].timestamp > 1e9


async def test_each_direction_chooses_from_its_own_ladder() -> None:
    links, clock = _links()
    ladders = EncodeOptions(block_size=256, auto_gradient=("lossless", "int8", "int4", "topk"))
    links.configure(limit_bytes_per_second=0.0, options=ladders)
    links.record_compute(0.05)
    # A link so slow (100 kB/s) that not even int4's 33 KiB crosses in the 50 ms budget.
    await _send(links, clock, "n1", 100_000, rate=1e5)
    activation = links.codec_for("n1", "activation", ACTIVATION, step=1, requested=0)
    gradient = links.codec_for("n1", "gradient", ACTIVATION, step=1, requested=0)
    assert (_name(activation), _name(gradient)) == ("int4", "topk")


async def test_a_requested_codec_is_used_as_it_is_and_recorded() -> None:
    links, _ = _links()
    int8 = tensor_pb2.CODEC_BLOCKWISE_INT8
    assert links.codec_for("n0", "gradient", ACTIVATION, step=3, requested=int8) == int8
    [estimate] = links.snapshot()
    assert estimate.codec == int8 and [c.step for c in estimate.changes] == [3]


async def test_links_to_different_peers_are_measured_apart() -> None:
    links, clock = _links()
    await _send(links, clock, "fast", 1 << 20, rate=1e9)
    await _send(links, clock, "slow", 1 << 20, rate=1e6)
    assert links.bytes_per_second("fast") == pytest.approx(1e9)
    assert links.bytes_per_second("slow") == pytest.approx(1e6)
    assert links.bytes_per_second("never") is None


async def test_the_codec_history_is_bounded() -> None:
    links, _ = _links()
    codecs = [tensor_pb2.CODEC_LOSSLESS, tensor_pb2.CODEC_FP16]
    for step in range(MAX_CHANGES * 2):
        links.codec_for("n1", "activation", ACTIVATION, step=step, requested=codecs[step % 2])
    [estimate] = links.snapshot()
    assert len(estimate.changes) == MAX_CHANGES
    assert estimate.changes[-1].step == MAX_CHANGES * 2 - 1


async def test_a_limited_link_paces_its_transfers() -> None:
    links = Links()
    links.configure(limit_bytes_per_second=200_000.0, options=EncodeOptions(block_size=256))
    start = time.monotonic()
    async with links.transfer("n1", "activation") as link:
        for _ in range(8):
            await link.pace(10_000)  # 50 ms each at 200 kB/s
    elapsed = time.monotonic() - start
    assert elapsed >= 8 * 0.05 - 1e-3
    # Measured over the same transfer: never faster than the limit (a loaded machine may
    # make it slower, never faster).
    rate = links.bytes_per_second("n1")
    assert rate is not None and rate <= 200_000.0 * 1.001
    [estimate] = links.snapshot()
    assert estimate.wire_bytes == 80_000 and estimate.limit_bytes_per_second == 200_000.0


async def test_set_limit_changes_existing_links_and_the_default_for_new_ones() -> None:
    links, clock = _links()
    await _send(links, clock, "n1", 1000, rate=1e9)
    links.codec_for("n1", "activation", ACTIVATION, step=0, requested=0)
    assert links.limit("n1") == 0.0
    links.set_limit(None, 250_000.0)
    assert links.limit("n1") == links.limit("n2") == 250_000.0
    links.set_limit("n1", 1_000_000.0)  # one peer apart
    assert (links.limit("n1"), links.limit("n2")) == (1_000_000.0, 250_000.0)
    [estimate] = links.snapshot()
    assert estimate.limit_bytes_per_second == 1_000_000.0
    links.set_limit(None, 0.0)  # lifted everywhere
    assert links.limit("n1") == links.limit("n9") == 0.0
    assert links.snapshot()[0].limit_bytes_per_second == 0.0


def test_set_limit_refuses_a_limit_out_of_range_and_keeps_the_old_one() -> None:
    links, _ = _links()
    links.set_limit(None, 125_000.0)
    for bad in (-1.0, float("nan"), 1.0):
        with pytest.raises(ConfigError, match="out of range"):
            links.set_limit(None, bad)
    assert links.limit("n1") == 125_000.0


async def test_auto_follows_a_link_that_slows_down_and_recovers() -> None:
    links, clock = _links()
    links.record_compute(0.05)
    lossless = ACTIVATION.numel() * 4

    async def send_and_choose(rate: float, step: int) -> str:
        codec = links.codec_for("n1", "activation", ACTIVATION, step=step, requested=0)
        await _send(links, clock, "n1", lossless if _name(codec) == "lossless" else 34_000, rate)
        return _name(codec)

    fast = [await send_and_choose(1e8, step) for step in range(4)]
    slow = [await send_and_choose(1e6, step) for step in range(4, 8)]
    freed = [await send_and_choose(1e8, step) for step in range(8, 24)]
    assert fast == ["lossless"] * 4
    # The second slow sample restarts the meter; the choice follows on the next tensor.
    assert slow[:2] == ["lossless", "lossless"] and slow[2:] == ["int4", "int4"]
    assert freed[-1] == "lossless" and freed.index("lossless") <= 11  # 2 samples + 8 votes
    [estimate] = links.snapshot()
    assert [(c.step, _name(c.codec)) for c in estimate.changes] == [
        (0, "lossless"),
        (6, "int4"),
        (8 + freed.index("lossless"), "lossless"),
    ]
