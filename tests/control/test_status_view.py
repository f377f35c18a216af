"""`swarmpipe status`'s view of a Status reply, and its watch loop, in process."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest

from swarmpipe.control.admin import check_address, show_status
from swarmpipe.control.status_view import status_table, status_view
from swarmpipe.errors import ConfigError, CoordinatorUnavailable
from swarmpipe.protos import coordinator_pb2 as pb


def _node(node_id: str, stage: int, compute_s: float, **fields: Any) -> pb.NodeRecord:
    values: dict[str, Any] = {"online": True, "serving": True, "samples_per_second": 10.0}
    values.update(fields)
    return pb.NodeRecord(
        node_id=node_id,
        stage=stage,
        compute_seconds_per_microbatch=compute_s,
        last_step=7,
        **values,
    )


def _status(*nodes: pb.NodeRecord, done: bool = False) -> pb.StatusReply:
    return pb.StatusReply(
        run_id="r1",
        step=8,
        total_steps=100,
        phase="done" if done else "training",
        done=done,
        counters=pb.SampleCounters(leased=140, committed=128, replayed=4, outstanding=12),
        steps=[pb.StepRecord(step=s, loss=3.0 - s / 10, samples=16, seconds=0.5) for s in range(8)],
        evals=[pb.EvalRecord(step=5, loss=2.75)],
        nodes=list(nodes),
        links=[
            pb.LinkRecord(
                src_node="a", dst_node="b", direction="activation", codec="lossless", bytes=1000
            ),
            pb.LinkRecord(
                src_node="a", dst_node="b", direction="activation", codec="int8", bytes=500
            ),
            pb.LinkRecord(
                src_node="a", dst_node="c", direction="reduce", codec="lossless", bytes=2_500_000
            ),
        ],
        link_choices=[
            pb.LinkChoiceRecord(
                src_node="a",
                dst_node="b",
                direction="activation",
                codec="int8",
                bytes_per_second=1.25e6,
                wire_bytes=1600,
                changes=[pb.CodecChangeRecord(codec="int8")],
            ),
            pb.LinkChoiceRecord(
                src_node="a",
                dst_node="c",
                direction="reduce",
                codec="unknown",
                limit_bytes_per_second=250_000,
            ),
        ],
        joins=4,
        departures=1,
    )


SWARM = _status(
    _node("a", 0, 0.002),
    _node("c", 0, 0.002),
    _node("b", 1, 0.003),  # 333 microbatches/s against stage 0's 1000: the bottleneck
    _node("gone", 1, 0.0001, online=False, serving=False, samples_per_second=99.0),
)


def test_the_view_sums_serving_replicas_and_marks_the_slowest_stage() -> None:
    view = status_view(SWARM)
    assert [s["stage"] for s in view["stages"]] == [0, 1]
    s0, s1 = view["stages"]
    assert s0["serving"] == 2 and s0["samples_per_second"] == 20.0
    assert s0["microbatches_per_second"] == pytest.approx(1000)
    # The offline replica is listed but adds nothing, though it once was fast.
    assert s1["serving"] == 1 and s1["samples_per_second"] == 10.0
    assert s1["microbatches_per_second"] == pytest.approx(1000 / 3)
    assert [r["state"] for r in s1["replicas"]] == ["serving", "offline"]
    assert view["bottleneck_stage"] == 1 and s1["bottleneck"] and not s0["bottleneck"]
    assert view["samples_per_second"] == pytest.approx(16 * 5 / 2.5)
    assert view["loss"] == {
        "training": pytest.approx(2.3),
        "training_step": 7,
        "held_out": 2.75,
        "held_out_step": 5,
    }
    assert view["samples"]["outstanding"] == 12 and view["nodes_online"] == 3
    json.dumps(view, allow_nan=False)  # plain JSON, as --json prints it


def test_links_take_the_codec_in_use_now_and_sum_bytes_over_codecs() -> None:
    ab, ac = status_view(SWARM)["links"]
    assert (ab["src"], ab["dst"], ab["direction"]) == ("a", "b", "activation")
    assert ab["codec"] == "int8" and ab["bytes"] == 1500 and ab["codec_changes"] == 1
    assert ab["measured_mbit"] == pytest.approx(10.0) and ab["limit_mbit"] is None
    # A reduce names no codec choice; the one codec it used stands in.
    assert ac["codec"] == "lossless" and ac["limit_mbit"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ((_node("a", 0, 0.001), _node("b", 1, 0.001, serving=False)), 1),  # b still syncing
        ((_node("a", 0, 0.001), _node("b", 1, 0.0)), None),  # b's compute not measured
    ],
    ids=["a stage without a serving replica", "a compute time not measured yet"],
)
def test_the_bottleneck_is_a_stalled_stage_or_none_when_unknown(
    nodes: tuple[pb.NodeRecord, ...], expected: int | None
) -> None:
    view = status_view(_status(*nodes))
    assert view["bottleneck_stage"] == expected
    assert status_view(_status(*nodes, done=True))["bottleneck_stage"] is None


def test_the_table_shows_header_stages_replicas_and_links() -> None:
    text = "\n".join(status_table(status_view(SWARM)))
    assert text.startswith("run 'r1': training, step 8 of 100\n")
    assert "training 2.3000 (step 7), held-out 2.7500 (step 5)" in text
    assert "leased 140, committed 128, replayed 4, duplicates 0, lost 0, outstanding 12" in text
    assert "3 of 4 online, 4 joins, 1 departure" in text
    lines = text.splitlines()
    stage1 = next(line for line in lines if line.startswith("1 "))
    assert stage1.endswith("<- bottleneck: slowest compute")
    assert not any(line.startswith("0 ") and "bottleneck" in line for line in lines)
    gone = next(line for line in lines if " gone " in line)
    assert gone.split()[1:5] == ["offline", "-", "-", "-"]
    assert any(line.split()[:5] == ["a", "->", "b", "activation", "int8"] for line in lines)


def test_an_empty_swarm_and_a_nan_loss_still_render() -> None:
    status = pb.StatusReply(run_id="r", phase="waiting", total_steps=5)
    status.steps.append(pb.StepRecord(step=0, loss=math.nan, samples=1, seconds=1))
    view = status_view(status)
    assert view["loss"]["training"] is None and view["stages"] == []
    assert "no node has joined yet" in status_table(view)


class FakeConnection:
    """Answers Status from a script: a reply, or an error to raise."""

    def __init__(self, *answers: pb.StatusReply | Exception) -> None:
        self.answers = list(answers)

    def status(self) -> pb.StatusReply:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_watch_off_a_terminal_prints_tables_apart_and_stops_when_the_run_is_done() -> None:
    out = io.StringIO()
    down = CoordinatorUnavailable("no coordinator answers at h:1")
    connection = FakeConnection(SWARM, down, SWARM, _status(done=True))
    assert show_status(connection, as_json=False, watch=0.001, out=out) == 0
    text = out.getvalue()
    assert text.count("run 'r1'") == 3
    assert "\n\nrun 'r1': done" in text  # a blank line before each table after the first
    assert "no coordinator answers at h:1; asking again" in text
    assert "\x1b[" not in text


def test_watch_with_json_prints_one_object_a_line() -> None:
    out = io.StringIO()
    connection = FakeConnection(SWARM, _status(done=True))
    assert show_status(connection, as_json=True, watch=0.001, out=out) == 0
    objects = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [o["done"] for o in objects] == [False, True]


def test_a_coordinator_down_before_anything_was_drawn_is_an_error() -> None:
    connection = FakeConnection(CoordinatorUnavailable("no coordinator answers at h:1"))
    with pytest.raises(CoordinatorUnavailable):
        show_status(connection, as_json=False, watch=1, out=io.StringIO())


@pytest.mark.parametrize("address", ["host", "host:", ":7600", "host:0", "host:70000", "a b:1"])
def test_a_malformed_coordinator_address_is_a_config_error(address: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        check_address(address)


@pytest.mark.parametrize("address", ["127.0.0.1:7600", "coord.example.org:1", "[::1]:7600"])
def test_well_formed_addresses_pass(address: str) -> None:
    assert check_address(address) == address


def test_moves_are_listed_in_the_view_and_the_table() -> None:
    status = pb.StatusReply()
    status.CopyFrom(SWARM)
    status.moves.append(
        pb.MoveRecord(node_id="c", from_stage=0, to_stage=1, reason="moved by the operator", step=6)
    )
    view = status_view(status)
    assert view["moves"] == [
        {"node": "c", "from_stage": 0, "to_stage": 1, "step": 6, "reason": "moved by the operator"}
    ]
    status.moves.append(
        pb.MoveRecord(node_id="b", from_stage=1, to_stage=1, reason="re-sync: differs", step=7)
    )
    text = "\n".join(status_table(status_view(status)))
    assert "recent moves:\n  step 6: moved c from stage 0 to 1 (moved by the operator)" in text
    assert "  step 7: b re-synced stage 1 (re-sync: differs)" in text
    assert status_view(SWARM)["moves"] == []


def test_benched_nodes_are_listed_in_the_view_and_the_table() -> None:
    status = pb.StatusReply()
    status.CopyFrom(SWARM)
    status.reports = 2
    status.benched.append(
        pb.BenchRecord(
            node_id="x", stage=1, reason="norm 900x", step=3, reporters=["a", "b"], seconds_left=60
        )
    )
    view = status_view(status)
    assert view["reports"] == 2
    assert view["benched"] == [
        {
            "node": "x",
            "stage": 1,
            "step": 3,
            "reporters": ["a", "b"],
            "reason": "norm 900x",
            "seconds_left": 60.0,
        }
    ]
    text = "\n".join(status_table(view))
    assert (
        "benched for poisoned tensors:\n  step 3: x (stage 1), reported by a, b: norm 900x" in text
    )
    assert status_view(SWARM)["benched"] == []


def test_the_view_carries_the_throughput_model_and_the_table_its_bound() -> None:
    status = pb.StatusReply(
        run_id="r",
        placement=pb.PlacementRecord(
            bound=12.5,
            best_bound=20.0,
            stage_rates=[30.0, 12.5],
            nodes=[
                pb.NodeRate(
                    node_id="a", stage=1, compute=40.0, effective=12.5, limited_by="bandwidth"
                )
            ],
        ),
    )
    view = status_view(status)
    assert view["model"]["bound"] == 12.5 and view["model"]["best_bound"] == 20.0
    assert view["model"]["nodes"]["a"]["limited_by"] == "bandwidth"
    assert any("the model's bound 12.5 (best plan 20.0)" in line for line in status_table(view))
    empty = status_view(pb.StatusReply(run_id="r"))["model"]
    assert empty["bound"] is None and empty["best_bound"] is None
