"""The metrics endpoint over real HTTP: built on the daemon's loop, never blocking it."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from swarmpipe.errors import ConfigError
from swarmpipe.process.metrics import serve_metrics


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


async def test_a_scrape_reads_the_state_on_the_loop_thread_while_the_loop_runs() -> None:
    threads: list[int] = []
    ticks = 0

    def families() -> list[Metric]:
        threads.append(threading.get_ident())
        return [CounterMetricFamily("demo_ticks", "Loop ticks so far.", ticks)]

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    ticker = asyncio.create_task(tick())
    server = serve_metrics("127.0.0.1", 0, families)
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        first = await asyncio.to_thread(_get, server.url)
        await asyncio.sleep(0.05)
        second = await asyncio.to_thread(_get, server.url)
    finally:
        server.close()
        ticker.cancel()
    values = [
        next(iter(text_string_to_metric_families(text))).samples[0].value
        for text in (first, second)
    ]
    assert 0 < values[0] < values[1]  # read at scrape time, not once
    assert threads == [threading.get_ident()] * 2  # built on the loop, not the HTTP thread


async def test_a_failing_scrape_is_a_503_and_one_log_line(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    def families() -> list[Metric]:
        raise RuntimeError("state is gone")

    server = serve_metrics("127.0.0.1", 0, families)
    try:
        with pytest.raises(urllib.error.HTTPError) as failed:
            await asyncio.to_thread(_get, server.url)
    finally:
        server.close()
    assert failed.value.code == 503
    assert [r.getMessage() for r in caplog.records] == [
        "a metrics scrape failed: RuntimeError('state is gone')"
    ]
    assert "Traceback" not in capfd.readouterr().err  # wsgiref prints none either


async def test_a_port_in_use_is_a_config_error_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}.*--metrics-port"):
            serve_metrics("127.0.0.1", port, list)
