"""A link's one-way delay: each message arrives its delay after the limit releases it, and
the delay never costs throughput. Run on a virtual clock that jumps to the next wake-up."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from swarmpipe.errors import ConfigError
from swarmpipe.node import link_limit, links
from swarmpipe.node.links import Links
from swarmpipe.node.transport import EncodeOptions

MB = 1_000_000


class VirtualTime:
    """A clock plus an `asyncio.sleep` stand-in: sleepers wake in time order, and time jumps
    to the next wake-up once every task is blocked."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._real_sleep = asyncio.sleep

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(seconds, 0.0), next(self._order), future))
        await future

    async def run(self, *coroutines: Coroutine[Any, Any, Any]) -> list[Any]:
        tasks = [asyncio.ensure_future(c) for c in coroutines]
        while not all(t.done() for t in tasks):
            for _ in range(20):  # let every runnable task reach its next sleep
                await self._real_sleep(0)
            if self._sleepers:
                wake, _, future = heapq.heappop(self._sleepers)
                self.now = max(self.now, wake)
                future.set_result(None)
            elif not all(t.done() for t in tasks):
                raise RuntimeError("tasks are blocked on something other than the clock")
        return [t.result() for t in tasks]


@pytest.fixture
def vt(monkeypatch: pytest.MonkeyPatch) -> VirtualTime:
    clock = VirtualTime()
    fake: Callable[[float], Awaitable[None]] = clock.sleep
    monkeypatch.setattr(link_limit.asyncio, "sleep", fake)
    monkeypatch.setattr(links.asyncio, "sleep", fake)
    return clock


def _links(vt: VirtualTime, *, rate: float, latency_s: float) -> Links:
    node_links = Links(clock=vt, wall_clock=vt)
    node_links.configure(limit_bytes_per_second=rate, options=EncodeOptions(), latency_s=latency_s)
    return node_links


async def _send(
    node_links: Links, vt: VirtualTime, peer: str, sizes: list[int]
) -> list[tuple[float, float]]:
    """One tensor's messages; (asked, delivered) times of each."""
    times = []
    async with node_links.transfer(peer, "activation") as link:
        for size in sizes:
            asked = vt.now
            await link.pace(size)
            times.append((asked, vt.now))
    return times


async def test_each_message_arrives_its_delay_after_its_release(vt: VirtualTime) -> None:
    node_links = _links(vt, rate=1 * MB, latency_s=0.5)
    start = vt.now
    [times] = await vt.run(_send(node_links, vt, "n1", [100_000] * 4))
    delivered = [t - start for _, t in times]
    # Released at 0.1, 0.2, 0.3, 0.4 s by the limit; each arrives 0.5 s later. Not 0.6,
    # 1.2, 1.8, 2.4 (the delay paid again by every message of the tensor).
    assert delivered == pytest.approx([0.6, 0.7, 0.8, 0.9])


async def test_without_a_limit_the_delay_is_paid_once_per_tensor(vt: VirtualTime) -> None:
    node_links = _links(vt, rate=0.0, latency_s=0.08)
    start = vt.now
    [times] = await vt.run(_send(node_links, vt, "n1", [1 << 20] * 5))
    assert [t - start for _, t in times] == pytest.approx([0.08] * 5)


async def test_concurrent_tensors_overlap_their_delays(vt: VirtualTime) -> None:
    # Eight tensors in flight on a 1 MB/s line with 1 s one way: the line stays busy, so
    # the last arrives after 8 x 0.2 s of sending plus one delay, as on a real long line.
    node_links = _links(vt, rate=1 * MB, latency_s=1.0)
    start = vt.now
    results = await vt.run(*(_send(node_links, vt, "n1", [100_000, 100_000]) for _ in range(8)))
    last = max(t for times in results for _, t in times) - start
    assert last == pytest.approx(8 * 0.2 + 1.0)
    # Every message arrived exactly its delay after some slot of the line, and no two
    # messages shared a slot: the delay took no throughput.
    released = sorted(t - start - 1.0 for times in results for _, t in times)
    assert released == pytest.approx([0.1 * (i + 1) for i in range(16)])


async def test_the_meter_sees_the_line_rate_not_the_delay(vt: VirtualTime) -> None:
    node_links = _links(vt, rate=2 * MB, latency_s=0.2)
    for _ in range(3):
        await vt.run(_send(node_links, vt, "n1", [50_000, 50_000]))
    assert node_links.bytes_per_second("n1") == pytest.approx(2 * MB)


async def test_a_new_delay_reaches_new_transfers_and_spares_those_under_way(
    vt: VirtualTime,
) -> None:
    node_links = _links(vt, rate=0.0, latency_s=0.1)

    async def change_later() -> None:
        await vt.sleep(0.05)
        node_links.set_latency(None, 0.3)

    start = vt.now
    old, _ = await vt.run(_send(node_links, vt, "n1", [10, 10]), change_later())
    assert [t - start for _, t in old] == pytest.approx([0.1, 0.1])
    assert node_links.latency("n1") == pytest.approx(0.3)
    assert node_links.latency("never-seen") == pytest.approx(0.3)
    start = vt.now
    [new] = await vt.run(_send(node_links, vt, "n2", [10]))
    assert new[0][1] - start == pytest.approx(0.3)
    node_links.set_latency("n2", 0.0)
    start = vt.now
    [none] = await vt.run(_send(node_links, vt, "n2", [10]))
    assert none[0][1] == start


async def test_a_lone_message_waits_the_delay(vt: VirtualTime) -> None:
    node_links = _links(vt, rate=0.0, latency_s=0.25)
    start = vt.now
    await vt.run(node_links.propagate("n1"))
    assert vt.now - start == pytest.approx(0.25)


def test_a_delay_out_of_range_is_refused() -> None:
    node_links = Links()
    for seconds in (-0.001, 11.0, float("nan")):
        with pytest.raises(ConfigError, match="out of range"):
            node_links.set_latency(None, seconds)
    assert node_links.latency_s == 0.0


async def test_a_transfer_closed_while_its_first_message_sleeps_out_the_delay(
    vt: VirtualTime,
) -> None:
    """A Reduce stream's messages are read by gRPC's own task: a call that fails (its peer
    died) closes the transfer while that task still waits in `pace`. The meter stays
    balanced, and the link measures again afterwards (a node once crashed here)."""
    node_links = _links(vt, rate=2 * MB, latency_s=0.5)

    async def call_fails_mid_delay() -> None:
        transfer = node_links.transfer("n1", "reduce")
        await transfer.__aenter__()
        pacing = asyncio.ensure_future(transfer.pace(100))
        await vt.sleep(0.1)  # the reader is in the delay, the meter released
        await transfer.__aexit__(None, None, None)
        await pacing

    await vt.run(call_fails_mid_delay())
    for _ in range(3):
        await vt.run(_send(node_links, vt, "n1", [50_000, 50_000]))
    assert node_links.bytes_per_second("n1") == pytest.approx(2 * MB)
