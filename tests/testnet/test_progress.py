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


def test_the_bar_shows_steps_loss_rate_and_nodes_and_ends_on_its_own_line() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    with ProgressBar(console) as bar:
        for done, now in [(0, 0.0), (3, 1.0), (10, 2.0)]:
            bar.update(status(done, 10), now)
    text = out.getvalue()
    frames = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text))
    last = [frame for frame in frames if frame.strip()][-1]  # the bar as it stays on screen
    assert "done" in last and "10/10" in last and "loss 3.1000" in last, last
    assert "320.0 samples/s" in last and "nodes 1/2" in last and "lost 0" in last
    assert "5.00 MB/s" in last  # 10 MB over the last 2 s
    assert text.endswith("\n\x1b[?25h")  # a new line after the bar, and the cursor back
