"""The live view's pieces: the node timeline and the terminal progress bar (no processes)."""

from __future__ import annotations

import io
import re

from rich.console import Console

from swarmpipe.protos import coordinator_pb2
from swarmpipe.testnet.node_timeline import NodeTimeline
from swarmpipe.testnet.progress import ProgressBar


def node(
    node_id: str, stage: int, online: bool = True, serving: bool = True
) -> coordinator_pb2.NodeRecord:
    return coordinator_pb2.NodeRecord(node_id=node_id, stage=stage, online=online, serving=serving)


def test_the_timeline_keeps_only_changes() -> None:
    timeline = NodeTimeline()
    timeline.observe(10.0, 0, [node("n0", 0, online=False), node("n1", 1)])
    timeline.observe(10.25, 1, [node("n0", 0), node("n1", 1)])
    timeline.observe(10.5, 2, [node("n0", 0), node("n1", 1)])
    timeline.observe(10.75, 3, [node("n0", 1, serving=False), node("n1", 1)])
    assert timeline.records(origin=10.25) == [
        {"seconds": -0.25, "step": 0, "node": "n0", "stage": 0, "online": False,
         "serving": True},
        {"seconds": -0.25, "step": 0, "node": "n1", "stage": 1, "online": True,
         "serving": True},
        {"seconds": 0.0, "step": 1, "node": "n0", "stage": 0, "online": True, "serving": True},
        {"seconds": 0.5, "step": 3, "node": "n0", "stage": 1, "online": True,
         "serving": False},
    ]  # fmt: skip


def status(done_steps: int, total: int) -> coordinator_pb2.StatusReply:
    reply = coordinator_pb2.StatusReply(
        total_steps=total, phase="training" if done_steps < total else "done"
    )
    for i in range(done_steps):
        reply.steps.add(step=i, loss=4.0 - i * 0.1, samples=16, seconds=0.05)
    reply.nodes.extend([node("n0", 0), node("n1", 1, online=False)])
    reply.links.add(src_node="n0", dst_node="n1", bytes=1_000_000 * done_steps)
    return reply


def test_the_bar_shows_steps_eta_and_the_figures_and_ends_on_its_own_lines() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    with ProgressBar(console) as bar:
        for done, now in [(0, 0.0), (3, 1.0), (10, 2.0)]:
            bar.update(status(done, 10), now)
    text = out.getvalue()
    frames = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text))
    line, figures = [frame for frame in frames if frame.strip()][-2:]  # as it stays on screen
    assert line.startswith("done") and "10/10" in line and "elapsed" in line and "eta" in line
    assert figures.startswith("loss 3.1000 | 320.0 samples/s | 5.00 MB/s | nodes 1/2")
    assert figures.endswith("lost 0")  # 5.00 MB/s: 10 MB over the last 2 s
    assert text.endswith("\n\x1b[?25h")  # a new line after the bar, and the cursor back


def test_a_narrow_terminal_cuts_the_figures_not_the_bar() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=60, color_system=None)
    with ProgressBar(console) as bar:
        bar.update(status(3, 10), 0.0)
    frames = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()))
    line, figures = [frame for frame in frames if frame.strip()][-2:]
    assert "━" in line and "3/10" in line and "eta" in line
    assert len(figures) == 60 and figures.endswith("…")
