"""report.png: one testnet run at a glance, drawn from its report.json.

`swarmpipe testnet` draws it at the end of every run, next to report.json. To
redraw it (after changing this module, or from a report copied off another
machine):

    python -m swarmpipe.testnet.picture RUN/report.json [--png OUT.png]

The left column tells the run in wall-clock time, one shared x axis: training
and held-out loss, samples/s, and which stage each node served (solid while
serving, hatched while it downloads its stage's state, blank while offline).
The right column has the loss against steps and the bytes each link sent, by
codec. Churn events (kills, starts, link limits) are vertical lines across
every panel with a time or step axis, named in the timeline beside the node
they hit. Times are the coordinator's (seconds since step 0 opened); the
testnet's own records are moved onto that clock (see _on_step_clock).

Needs matplotlib, the `report` extra (`pip install 'swarmpipe[report]'`); without
it the testnet prints a one-line note and still writes report.json. Drawing
uses the Agg canvas directly (no pyplot), so it never needs a display and
leaves matplotlib's global backend alone in a notebook.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes

INSTALL_HINT = "pip install 'swarmpipe[report]'"

CHURN_STYLE: dict[str, tuple[str, Literal["-", "--", "-.", ":"]]] = {
    "kill": ("#d62728", "-"),
    "died": ("#8c1c13", "-."),
    "start": ("#2ca02c", "--"),
    "link": ("#9467bd", ":"),
}
"""Colour and line style of each kind of churn event; the same in every panel."""

PERFORMED = {"killed", "started", "withdrawn"}
"""Churn outcomes that changed something ("limited to ..." too); the rest are not drawn."""

CODEC_COLOURS = {
    "lossless": "#8c8c8c",
    "fp16": "#1b9e77",
    "bf16": "#66a61e",
    "int8": "#e6ab02",
    "int4": "#d95f02",
    "topk": "#7570b3",
    "lowrank": "#a6761d",
}
"""Each codec's bar colour, least lossy first (the legend's order), apart from the stage
colours (C0, C1, ...) and the churn lines; other codecs get greys."""

MAX_LABELLED_EVENTS = 16
"""Past this many churn events their names would overlap: only the lines are drawn."""

MAX_LINK_BARS = 24
"""Past this many (link, direction) bars, bytes are summed per direction instead."""


def write_picture(report: dict[str, Any], path: Path) -> Path | None:
    """Draw `report` into `path` and print where; without matplotlib, print why not."""
    try:
        draw(report, path)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        print(f"no report.png: matplotlib is not installed ({INSTALL_HINT} draws it)")
        return None
    print(f"picture: {path}")
    return path


def draw(report: dict[str, Any], path: Path) -> None:
    """Draw the run's picture into the PNG file `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    nodes = _node_names(report)
    timeline_height = 0.9 + 0.28 * max(len(nodes), 1)
    fig = Figure(figsize=(14, 6.4 + timeline_height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, 2, width_ratios=[1.7, 1], height_ratios=[1, 1, timeline_height])
    loss_time = fig.add_subplot(grid[0, 0])
    rate = fig.add_subplot(grid[1, 0], sharex=loss_time)
    stages = fig.add_subplot(grid[2, 0], sharex=loss_time)
    loss_step = fig.add_subplot(grid[0, 1])
    links = fig.add_subplot(grid[1:, 1])

    report = _on_step_clock(report)
    churn = [c for c in report.get("churn", []) if _performed(c)]
    _loss(loss_time, report, x="elapsed_s")
    _samples_per_second(rate, report)
    stage_handles = _stage_timeline(stages, report, nodes)
    _loss(loss_step, report, x="step")
    _link_bytes(links, report)
    for ax in (loss_time, rate, stages):
        _churn_lines(ax, churn, x="at_seconds")
    _churn_lines(loss_step, churn, x="step")
    start, end = _time_span(report)
    _churn_labels(stages, churn, {name: row for row, name in enumerate(nodes)}, end - start)
    handles = [*stage_handles, *_churn_handles(churn)]
    if handles:
        # Under the timeline, whose colours and lines it names, not over its bars.
        fig.legend(handles=handles, loc="outside lower left", ncols=len(handles), fontsize=9)
    loss_time.set_xlim(start, end)
    fig.suptitle(_title(report), fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def _on_step_clock(report: dict[str, Any]) -> dict[str, Any]:
    """The report with churn and node_timeline times moved onto the steps' clock.

    Steps' `elapsed_s` count from when the coordinator opened step 0; churn and
    node_timeline count from the testnet's first poll that saw training, up to a poll
    (0.25 s) later, which is a visible shift in a run of a few seconds. A step seen
    finished at `seen_at_seconds` on the testnet's clock ended at `elapsed_s` on the
    coordinator's, no later, so the clocks differ by at least elapsed_s - seen_at_seconds;
    the step that ended just before a poll makes that bound tight.
    """
    gaps = [s["elapsed_s"] - s["seen_at_seconds"] for s in report.get("steps", [])
            if "seen_at_seconds" in s]  # fmt: skip
    offset = max([0.0, *gaps])
    if not offset:
        return report
    moved = dict(report)
    moved["churn"] = [
        {**c, "at_seconds": c["at_seconds"] + offset} for c in report.get("churn", [])
    ]
    if "node_timeline" in report:
        moved["node_timeline"] = [
            {**t, "seconds": t["seconds"] + offset} for t in report["node_timeline"]
        ]
    return moved


def _title(report: dict[str, Any]) -> str:
    steps = report.get("steps", [])
    config = report.get("config", {})
    pipeline = config.get("pipeline", {})
    counters = report.get("counters", {})
    final = report.get("final_loss")
    held_out = report.get("final_eval_loss")
    losses = "" if final is None else f", loss {final:.3f}"
    if held_out is not None:
        losses += f" (held-out {held_out:.3f})"
    training = steps[-1]["elapsed_s"] if steps else 0.0
    codecs = f"{pipeline.get('activation_codec', '?')}/{pipeline.get('gradient_codec', '?')}"
    return (
        f"testnet {report.get('started_at', '')}: {report.get('nodes', '?')} nodes, "
        f"{pipeline.get('stages', '?')} stages, codecs {codecs} (act/grad)\n"
        f"{len(steps)} steps in {training:.1f} s of training "
        f"({report.get('wall_seconds', 0):.0f} s with start and stop){losses}, "
        # report.json's figure: samples over the steps' own seconds, so without the gaps
        # between steps that the throughput panel's delivered line includes.
        f"{report.get('samples_per_second', 0):.0f} samples/s within steps, "
        f"replayed {counters.get('replayed', 0)}, lost {counters.get('lost', 0)} samples"
    )


def _performed(record: dict[str, Any]) -> bool:
    outcome = str(record.get("outcome", ""))
    # "killed by SIGKILL from outside the testnet": a node that died without the testnet.
    return outcome in PERFORMED or outcome.startswith(("limited", "killed by", "set "))


def _churn_label(record: dict[str, Any]) -> str:
    if record["action"] == "link":
        mbit = record.get("mbit")
        # None withdraws the organiser's limit; 0 sets "no limit" (see churn.py).
        setting = "off" if mbit is None else "unlimited" if mbit == 0 else f"{mbit:g} Mbit/s"
        return f"link {record['node']} {setting}"
    return f"{record['action']} {record['node']}"


def _churn_lines(ax: Axes, churn: list[dict[str, Any]], *, x: str) -> None:
    """A vertical line per churn event."""
    for record in churn:
        colour, line = CHURN_STYLE.get(record["action"], CHURN_STYLE["link"])
        ax.axvline(record[x], color=colour, linestyle=line, linewidth=1.1, alpha=0.8, zorder=1)


def _churn_labels(ax: Axes, churn: list[dict[str, Any]], rows: dict[str, int], span: float) -> None:
    """Each event's name beside its line, in the row of the node it hit (the top row for
    `all`): the loss and throughput panels above keep their lines clear."""
    if len(churn) > MAX_LABELLED_EVENTS:
        return
    # Events on one row closer than a label's width (about a tenth of the axis) would
    # overlap, e.g. a kill and its restart a second apart: such runs of labels alternate
    # above and below the row's middle.
    runs: list[list[dict[str, Any]]] = []
    last_run: dict[int, list[dict[str, Any]]] = {}
    for record in sorted(churn, key=lambda r: r["at_seconds"]):
        row = rows.get(record["node"], 0)
        run = last_run.get(row)
        if run is not None and record["at_seconds"] - run[-1]["at_seconds"] < 0.12 * span:
            run.append(record)
        else:
            last_run[row] = [record]
            runs.append(last_run[row])
    for run in runs:
        for i, record in enumerate(run):
            height = 0.0 if len(run) == 1 else (-0.2 if i % 2 == 0 else 0.2)
            colour, _ = CHURN_STYLE.get(record["action"], CHURN_STYLE["link"])
            ax.annotate(
                _churn_label(record),
                xy=(record["at_seconds"], rows.get(record["node"], 0) + height),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                color=colour,
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "alpha": 0.85,
                      "linewidth": 0},
            )  # fmt: skip


def _churn_handles(churn: list[dict[str, Any]]) -> list[Artist]:
    """A legend entry for each kind of churn line drawn."""
    from matplotlib.lines import Line2D

    names = {
        "kill": "kill (SIGKILL)",
        "died": "died (killed from outside)",
        "start": "start",
        "link": "link limit",
    }
    kinds = sorted({r["action"] for r in churn}, key=list(CHURN_STYLE).index)
    return [
        Line2D([], [], color=CHURN_STYLE[k][0], linestyle=CHURN_STYLE[k][1], linewidth=1.5,
               label=names[k])
        for k in kinds
    ]  # fmt: skip


def _time_span(report: dict[str, Any]) -> tuple[float, float]:
    """From the first node online (before step 0: nodes join first) to the last event."""
    times = [0.0]
    times += [s["elapsed_s"] for s in report.get("steps", [])]
    times += [e["elapsed_s"] for e in report.get("evals", [])]
    times += [c["at_seconds"] for c in report.get("churn", [])]
    times += [t["seconds"] for t in report.get("node_timeline", []) if t["online"]]
    start, end = min(times), max(times)
    pad = 0.01 * max(end - start, 1.0)
    return start - pad, end + pad


def _loss(ax: Axes, report: dict[str, Any], *, x: str) -> None:
    steps = report.get("steps", [])
    evals = report.get("evals", [])
    ax.plot(
        [s[x] for s in steps],
        [s["loss"] for s in steps],
        linewidth=1.0,
        color="#1f77b4",
        label="training loss (each step's samples)",
    )
    if evals:
        ax.plot(
            [e[x] for e in evals],
            [e["loss"] for e in evals],
            marker="o",
            markersize=3.5,
            linewidth=1.5,
            color="#ff7f0e",
            label="held-out loss",
        )
    if x == "step":
        ax.set_xlabel("optimizer step")
        ax.set_title("loss against steps", fontsize=10)
    else:
        ax.set_title("loss against wall-clock time", fontsize=10)
        ax.tick_params(labelbottom=False)
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)  # where the curves are not: fast enough for 10⁴ steps


def _headroom(ax: Axes, fraction: float) -> None:
    """Room above the data for a legend, so it never hides a line."""
    low, high = ax.get_ylim()
    ax.set_ylim(low, high + fraction * (high - low))


def _samples_per_second(ax: Axes, report: dict[str, Any]) -> None:
    """Throughput as the swarm delivered it: samples over the wall-clock time of a window
    of steps, gaps between steps (a stall after a kill, an evaluation) included."""
    steps = report.get("steps", [])
    window = max(1, round(len(steps) / 50))
    ends = [s["elapsed_s"] for s in steps]
    delivered = []
    for i, s in enumerate(steps):
        first = max(0, i - window + 1)
        began = ends[first - 1] if first > 0 else 0.0
        samples = sum(t["samples"] for t in steps[first : i + 1])
        delivered.append(samples / max(s["elapsed_s"] - began, 1e-9))
    ax.plot(
        ends,
        [s["samples_per_second"] for s in steps],
        linestyle="none",
        marker=".",
        markersize=2.5,
        color="#7f7f7f",
        alpha=0.5,
        label="each step, first lease to optimizer step",
    )
    ax.plot(
        ends,
        delivered,
        linewidth=1.5,
        color="#1f77b4",
        label=f"delivered, over {window} step{'s' if window > 1 else ''}",
    )
    ax.set_ylim(bottom=0)
    _headroom(ax, 0.3)
    ax.set_ylabel("samples/s")
    ax.set_title("throughput", fontsize=10)
    ax.tick_params(labelbottom=False)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, ncols=2)  # over the headroom


def _node_names(report: dict[str, Any]) -> list[str]:
    names = {t["node"] for t in report.get("node_timeline", [])}
    names |= {m["node_id"] for m in report.get("members", [])}
    # n2 before n10
    return sorted(
        names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)]
    )


def _stage_timeline(ax: Axes, report: dict[str, Any], nodes: list[str]) -> list[Artist]:
    """One row per node: a bar in its stage's colour while it is online; returns the
    legend entries of the colours used."""
    from matplotlib.patches import Patch

    timeline = report.get("node_timeline")
    _, end = _time_span(report)
    if timeline is None:
        # Reports from before node_timeline: only each member's final stage is known.
        timeline = [
            {"seconds": 0.0, "node": m["node_id"], "stage": m["stage"], "online": True,
             "serving": True}
            for m in report.get("members", [])
        ]  # fmt: skip
        ax.set_title("final stage of each node (no node_timeline in this report)", fontsize=10)
    else:
        ax.set_title("stage each node served (Status, polled every 0.25 s)", fontsize=10)
    colours = [f"C{i}" for i in range(10)]
    row = {name: i for i, name in enumerate(nodes)}
    seen_stages: set[int] = set()
    downloading = False
    by_node: dict[str, list[dict[str, Any]]] = {}
    for change in timeline:
        by_node.setdefault(change["node"], []).append(change)
    for node, changes in by_node.items():
        for change, after in zip(changes, [*changes[1:], None], strict=True):
            if not change["online"]:
                continue
            until = end if after is None else after["seconds"]
            colour = colours[change["stage"] % len(colours)]
            seen_stages.add(change["stage"])
            serving = change.get("serving", True)
            downloading |= not serving
            ax.broken_barh(
                [(change["seconds"], until - change["seconds"])],
                (row[node] - 0.35, 0.7),
                facecolors=colour if serving else "white",
                edgecolors=colour,
                hatch=None if serving else "////",
                linewidth=0.8,
            )
    ax.set_yticks(range(len(nodes)), nodes)
    ax.set_ylim(len(nodes) - 0.5, -0.5)
    ax.set_xlabel("wall-clock seconds since training began (step 0)")
    ax.grid(axis="x", alpha=0.3)
    handles: list[Artist] = [
        Patch(facecolor=colours[s % len(colours)], label=f"stage {s}") for s in sorted(seen_stages)
    ]
    if downloading:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////",
                             label="online, downloading its stage's state"))  # fmt: skip
    return handles


def _link_bytes(ax: Axes, report: dict[str, Any]) -> None:
    """What each link sent in each direction, stacked by codec."""
    links = report.get("links", [])
    bars: dict[str, dict[str, float]] = {}
    per_link = len({(k["src"], k["dst"], k["direction"]) for k in links}) <= MAX_LINK_BARS
    for link in sorted(links, key=lambda k: (k["direction"], k["src"], k["dst"])):
        name = f"{link['src']}→{link['dst']} {link['direction']}" if per_link else (
            f"every {link['direction']} link"
        )  # fmt: skip
        per_codec = bars.setdefault(name, {})
        per_codec[link["codec"]] = per_codec.get(link["codec"], 0.0) + link["bytes"] / 1e6
    names = list(bars)
    known = list(CODEC_COLOURS)
    codecs = sorted(
        {c for each in bars.values() for c in each},
        key=lambda c: (known.index(c) if c in known else len(known), c),
    )
    rows = {name: i for i, name in enumerate(names)}
    left = dict.fromkeys(names, 0.0)
    for i, codec in enumerate(codecs):
        # Only links that used the codec: an empty bar at a long bar's end would pin the
        # axis there (a bar's base is "sticky") and leave no margin.
        used = [n for n in names if bars[n].get(codec)]
        widths = [bars[n][codec] for n in used]
        colour = CODEC_COLOURS.get(codec, f"{0.2 + 0.15 * (i % 5):.2f}")
        ax.barh([rows[n] for n in used], widths, left=[left[n] for n in used], color=colour,
                label=codec)  # fmt: skip
        for n, width in zip(used, widths, strict=True):
            left[n] += width
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.margins(x=0.04)
    ax.set_xlabel("MB sent (10⁶ bytes, as encoded)")
    ax.set_title("bytes per link and direction, by codec", fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    if codecs:
        ax.legend(
            title="codec", fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08),
            ncols=min(len(codecs), 4), frameon=False,
        )  # fmt: skip
    else:
        ax.text(0.5, 0.5, "no link traffic recorded", ha="center", transform=ax.transAxes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarmpipe.testnet.picture",
        description="Redraw a testnet run's report.png from its report.json.",
    )
    parser.add_argument("report", type=Path, help="a testnet run's report.json")
    parser.add_argument("--png", type=Path, help="where to draw (default: beside the report)")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    written = write_picture(report, args.png or args.report.with_name("report.png"))
    return 0 if written is not None else 1


if __name__ == "__main__":
    sys.exit(main())
