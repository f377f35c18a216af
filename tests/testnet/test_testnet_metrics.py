"""`swarmpipe testnet --metrics`: every daemon scraped while it runs, and the counters agree
with report.json exactly.

The test scrapes each daemon itself over HTTP while the run goes on and parses the text with
Prometheus' own parser. The exact comparison uses the testnet's last scrape of the
coordinator, which it takes between two Status replies with equal counters and builds the
report from the second (testnet/metrics_scrape.py): counters only grow, so that scrape must
show the report's numbers. Nodes leave by themselves when the run is done, so their scrapes
(the test's and the testnet's) can only be at most what the report says they finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmpipe.process.ready import read_ready_file

# About 6 s on a 2-core machine (four daemons importing torch is most of it), like the
# testnet test beside it; far more when other work shares the cores, hence the timeout.
pytestmark = pytest.mark.timeout(300)

DAEMONS = ("coordinator", "n0", "n1", "n2")
Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


def _samples(text: str) -> Samples:
    """Sample name (counters keep `_total`) -> labels -> value."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def _one(samples: Samples, name: str) -> float:
    (value,) = samples[name].values()
    return value


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def _scrape_while_running(popen: subprocess.Popen[str], out: Path) -> dict[str, list[str]]:
    """Scrape each daemon as soon as it says where it serves, until each has answered."""
    live: dict[str, list[str]] = {name: [] for name in DAEMONS}
    deadline = time.monotonic() + 120
    while popen.poll() is None and time.monotonic() < deadline:
        for name in DAEMONS:
            ready = read_ready_file(out / "logs" / f"{name}.ready.json")
            if ready and ready.get("metrics_port"):
                try:
                    live[name].append(_scrape(ready["metrics_port"]))
                except OSError:
                    pass  # a node that just left
        if all(live.values()) and len(live["coordinator"]) >= 2:
            break
        time.sleep(0.02)
    return live


@pytest.mark.slow
def test_scrapes_during_a_testnet_agree_with_its_report(tmp_path: Path, tiny: list[str]) -> None:
    cmd = [sys.executable, "-m", "swarmpipe", "testnet", "--out", str(tmp_path), "--quiet"]
    cmd.append("--no-picture")
    cmd += ["--steps", "10", "--nodes", "3", "--metrics"]
    for s in tiny:
        cmd += ["--set", s]
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        live = _scrape_while_running(popen, tmp_path)
        output, _ = popen.communicate(timeout=240)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, output
    assert all(live.values()), {name: len(texts) for name, texts in live.items()}
    report = json.loads((tmp_path / "report.json").read_text())

    # Where each daemon served, and how often the testnet scraped it.
    metrics = report["metrics"]
    assert set(metrics) == set(DAEMONS)
    assert all(m["url"].startswith("http://127.0.0.1:") for m in metrics.values())
    assert metrics["coordinator"]["after_done"] and metrics["coordinator"]["scrapes"] >= 2

    # The coordinator's last scrape shows the report's counters, exactly.
    final = _samples((tmp_path / metrics["coordinator"]["last_scrape"]).read_text())
    counters = report["counters"]
    for name, key in [
        ("leased", "leased"),
        ("committed", "committed"),
        ("replayed", "replayed"),
        ("duplicate", "duplicates"),
        ("lost", "lost"),
    ]:
        assert _one(final, f"swarmpipe_coordinator_{name}_samples_total") == counters[key], name
    assert _one(final, "swarmpipe_coordinator_outstanding_samples") == counters["outstanding"]
    assert _one(final, "swarmpipe_coordinator_steps_finished_total") == len(report["steps"]) == 10
    assert _one(final, "swarmpipe_coordinator_loss") == report["final_loss"]
    assert final["swarmpipe_coordinator_phase"][frozenset({("phase", "done")})] == 1
    # What nodes reported over telemetry, as the report lists it.
    node_samples = {
        dict(labels)["node"]: value
        for labels, value in final["swarmpipe_coordinator_node_samples_total"].items()
    }
    assert node_samples == {m["node_id"]: m["samples"] for m in report["members"]}
    link_bytes = {
        tuple(dict(labels)[k] for k in ("node", "peer", "direction", "codec")): value
        for labels, value in final["swarmpipe_coordinator_link_sent_bytes_total"].items()
    }
    report_links = {
        (link["src"], link["dst"], link["direction"], link["codec"]): link["bytes"]
        for link in report["links"]
    }
    assert link_bytes == report_links and report_links

    # Scrapes taken while the run went on: counters never above where they ended.
    for text in live["coordinator"]:
        seen = _samples(text)
        for name in ("leased", "committed", "replayed", "duplicate", "lost"):
            sample = f"swarmpipe_coordinator_{name}_samples_total"
            assert _one(seen, sample) <= _one(final, sample)
    members = {m["node_id"]: m for m in report["members"]}
    saved = [
        (tmp_path / metrics[n]["last_scrape"]).read_text()
        for n in DAEMONS[1:]
        if metrics[n]["last_scrape"]
    ]
    for text in [t for n in DAEMONS[1:] for t in live[n]] + saved:
        seen = _samples(text)
        ((labels, samples),) = seen["swarmpipe_node_samples_total"].items()
        node = dict(labels)["node"]
        assert dict(labels)["stage"] in ("", str(members[node]["stage"]))
        assert samples <= members[node]["samples"]
        for labels, sent in seen.get("swarmpipe_node_sent_bytes_total", {}).items():
            link = dict(labels)
            key = (node, link["peer"], link["direction"], link["codec"])
            assert sent <= report_links[key], key
