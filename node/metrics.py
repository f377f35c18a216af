"""A node's Prometheus metrics, read from the state its parts keep anyway.

Every family carries the labels `node` and `stage` (empty before the node has joined), so
one Prometheus scraping a whole swarm can group by stage without relabelling. The values
come from their owners at scrape time: `NodeStatus` (serving, samples, microbatches in
flight), the compute thread (queue depth, busy seconds), `LinkStats` (bytes and tensors
sent per peer, direction and codec; bytes received), and the router (reroutes, the bench).
The daemon calls `node_families` on its event loop (process/metrics.py).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from swarmpipe.config import codec_name
from swarmpipe.node.compute import ComputeWorker
from swarmpipe.node.context import NodeStatus
from swarmpipe.node.router import Router
from swarmpipe.node.transport import LinkStats

_NODE_LABELS = ["node", "stage"]
_LINK_LABELS = [*_NODE_LABELS, "peer", "direction", "codec"]


def node_families(
    *,
    node_id: str,
    stage: int,
    step: int,
    samples_per_second: float,
    status: NodeStatus,
    compute: ComputeWorker,
    stats: LinkStats,
    router: Router,
) -> list[Metric]:
    """The node's metric families now; `stage` is -1 and `step` 0 before it has joined."""
    who = [node_id, str(stage) if stage >= 0 else ""]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=_NODE_LABELS)
        family.add_metric(who, value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=_NODE_LABELS)
        family.add_metric(who, value)
        return family

    sent_bytes = CounterMetricFamily(
        "swarmpipe_node_sent_bytes",
        "Tensor payload bytes sent, by peer, direction (activation, gradient, reduce, state) "
        "and codec.",
        labels=_LINK_LABELS,
    )
    sent_tensors = CounterMetricFamily(
        "swarmpipe_node_sent_tensors",
        "Tensors sent, by peer, direction and codec.",
        labels=_LINK_LABELS,
    )
    for link in stats.snapshot():
        labels = [*who, link.peer, link.direction, codec_name(link.codec)]
        sent_bytes.add_metric(labels, link.bytes)
        sent_tensors.add_metric(labels, link.tensors)

    peers = router.peers_benched()
    peer_benched = GaugeMetricFamily(
        "swarmpipe_node_peer_benched",
        "1 while this node skips the peer after failed calls to it, else 0 (plan peers only).",
        labels=[*_NODE_LABELS, "peer"],
    )
    for peer, benched in sorted(peers.items()):
        peer_benched.add_metric([*who, peer], 1 if benched else 0)

    return [
        gauge(
            "swarmpipe_node_serving",
            "1 once the node holds its stage's state and takes traffic, else 0.",
            1 if status.serving else 0,
        ),
        gauge("swarmpipe_node_step", "The optimizer step this node's stage trains.", step),
        counter(
            "swarmpipe_node_samples",
            "Samples whose backward pass this node finished.",
            status.samples_processed,
        ),
        gauge(
            "swarmpipe_node_samples_per_second",
            "Samples per second, smoothed over the last seconds (the status line's figure).",
            samples_per_second,
        ),
        gauge(
            "swarmpipe_node_microbatches_in_flight",
            "Microbatches this node is working on, as head or as a stage of the pipeline.",
            status.in_flight,
        ),
        gauge(
            "swarmpipe_node_compute_queue_depth",
            "Jobs (forward, backward, optimizer steps) waiting for the compute thread.",
            compute.queued,
        ),
        counter(
            "swarmpipe_node_compute_busy_seconds",
            "Seconds the compute thread spent running jobs.",
            compute.busy_seconds,
        ),
        sent_bytes,
        sent_tensors,
        counter(
            "swarmpipe_node_received_bytes",
            "Tensor payload bytes received from every peer.",
            stats.received_bytes,
        ),
        counter(
            "swarmpipe_node_reroutes",
            "Microbatches resent to another replica after a failed or overdue hop.",
            router.reroutes,
        ),
        gauge(
            "swarmpipe_node_benched_peers",
            "Peers this node skips now after failed calls to them.",
            sum(peers.values()),
        ),
        peer_benched,
    ]
