"""The embedded broker under concurrent joins: every client gets its subscriptions."""

from __future__ import annotations

import asyncio

import aiomqtt

from swarmpipe.control.bus import BrokerAddress, make_client
from swarmpipe.coordinator.broker import EmbeddedBroker


async def _join(address: BrokerAddress, name: str, delay: float) -> None:
    """What a node does on start: connect, subscribe to its own topics, announce itself."""
    await asyncio.sleep(delay)
    async with make_client(address, name) as client:
        await client.subscribe(f"run/{name}/plan", qos=1, timeout=10)
        await client.subscribe(f"run/{name}/step", qos=1, timeout=10)
        await client.publish(f"run/presence/{name}", b"online", qos=1, retain=True)


async def test_clients_joining_together_while_retained_messages_replay_all_get_in() -> None:
    """Regression: amqtt 0.12.1 dropped a connecting client when another one subscribed
    while the broker was replaying retained messages to it (a node died at startup).

    Large retained presence payloads keep each replay awaiting long enough, and joins
    5 ms apart put one client's SUBSCRIBE inside another's replay (without the fix
    about 20 of these 24 joins fail).
    """
    broker = EmbeddedBroker()
    address = await broker.start()
    try:
        async with make_client(address, "watcher") as watcher:
            await watcher.subscribe("run/presence/+", qos=1)
            for k in range(40):
                payload = bytes(256 * 1024)
                await watcher.publish(f"run/presence/old{k}", payload, qos=1, retain=True)
            for round_ in range(3):
                names = [f"r{round_}n{i}" for i in range(8)]
                results = await asyncio.gather(
                    *(_join(address, name, i * 0.005) for i, name in enumerate(names)),
                    return_exceptions=True,
                )
                failed = {n: r for n, r in zip(names, results, strict=True) if r is not None}
                assert not failed, f"clients dropped by the broker: {failed}"
    finally:
        await broker.stop()


async def test_a_client_still_gets_retained_messages_for_its_subscription() -> None:
    broker = EmbeddedBroker()
    address = await broker.start()
    try:
        async with make_client(address, "publisher") as publisher:
            await publisher.publish("run/plan", b"plan-v1", qos=1, retain=True)
        async with make_client(address, "reader") as reader:
            await reader.subscribe("run/plan", qos=1)
            async with asyncio.timeout(10):
                message: aiomqtt.Message = await anext(aiter(reader.messages))
            assert message.topic.matches("run/plan")
            assert message.payload == b"plan-v1"
    finally:
        await broker.stop()
