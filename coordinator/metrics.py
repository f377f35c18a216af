"""The coordinator's Prometheus metrics, read from the Status reply it gives anyway.

Built from `CoordinatorService.status()` at scrape time, so a scrape and a Status call at
the same moment agree to the sample, and the testnet's report.json (built from Status) and
a scrape taken once the run is done show the same counters: at DONE they no longer move.

The run's sample counters are separate counters rather than one family with a `state`
label, because they overlap (a replayed sample is also leased twice) and a sum over such a
label would mean nothing. What nodes report over MQTT telemetry (their samples, the bytes
they sent per link) is here too, under `swarmpipe_coordinator_node_*` and
`swarmpipe_coordinator_link_*`, so one scrape of the coordinator shows the whole swarm.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from swarmpipe.coordinator.step_protocol import Phase
from swarmpipe.protos import coordinator_pb2


def coordinator_families(status: coordinator_pb2.StatusReply, *, stages: int) -> list[Metric]:
    """Metric families of the coordinator's Status reply; `stages` is the pipeline's."""
    c = status.counters
    families: list[Metric] = [
        InfoMetricFamily(
            "swarmpipe_coordinator_run", "The run this coordinator runs.", {"run": status.run_id}
        ),
        GaugeMetricFamily(
            "swarmpipe_coordinator_step",
            "The step the run is at: training, being applied, or the last once done.",
            status.step,
        ),
        GaugeMetricFamily(
            "swarmpipe_coordinator_total_steps",
            "Optimizer steps the run trains.",
            status.total_steps,
        ),
        CounterMetricFamily(
            "swarmpipe_coordinator_steps_finished",
            "Optimizer steps applied by every serving node.",
            len(status.steps),
        ),
    ]
    phase = GaugeMetricFamily(
        "swarmpipe_coordinator_phase",
        "1 for the step protocol's phase now, 0 for the others.",
        labels=["phase"],
    )
    for p in Phase:
        phase.add_metric([p.value], 1 if p.value == status.phase else 0)
    families.append(phase)
    for name, value, doc in (
        ("leased", c.leased, "Training samples handed out in leases, replays included."),
        ("committed", c.committed, "Training samples whose lease was committed."),
        (
            "replayed",
            c.replayed,
            "Training samples leased again after their lease was released, "
            "its head went offline, or it timed out.",
        ),
        ("duplicate", c.duplicates, "Training samples of a late commit the coordinator refused."),
        ("lost", c.lost, "Training samples a finished step did not include (always 0)."),
    ):
        families.append(CounterMetricFamily(f"swarmpipe_coordinator_{name}_samples", doc, value))
    families.append(
        GaugeMetricFamily(
            "swarmpipe_coordinator_outstanding_samples",
            "Training samples of the open step leased or waiting to be.",
            c.outstanding,
        )
    )
    if status.steps:
        last = status.steps[-1]
        families.append(
            GaugeMetricFamily(
                "swarmpipe_coordinator_loss",
                "Mean token loss of the last finished step.",
                last.loss,
            )
        )
        families.append(
            GaugeMetricFamily(
                "swarmpipe_coordinator_samples_per_second",
                "Samples per second of the last finished step.",
                last.samples_per_second,
            )
        )
    if status.evals:
        families.append(
            GaugeMetricFamily(
                "swarmpipe_coordinator_eval_loss",
                "Mean token loss of the latest evaluation on held-out samples.",
                status.evals[-1].loss,
            )
        )
    online = GaugeMetricFamily(
        "swarmpipe_coordinator_nodes_online", "Nodes online, by stage.", labels=["stage"]
    )
    serving = GaugeMetricFamily(
        "swarmpipe_coordinator_nodes_serving",
        "Nodes in the plan (online and holding their stage's state), by stage.",
        labels=["stage"],
    )
    for stage in range(stages):
        online.add_metric([str(stage)], sum(n.online for n in status.nodes if n.stage == stage))
        serving.add_metric([str(stage)], sum(n.serving for n in status.nodes if n.stage == stage))
    node_samples = CounterMetricFamily(
        "swarmpipe_coordinator_node_samples",
        "Samples each node reported finished (MQTT telemetry).",
        labels=["node", "stage"],
    )
    for n in status.nodes:
        node_samples.add_metric([n.node_id, str(n.stage)], n.samples)
    link_bytes = CounterMetricFamily(
        "swarmpipe_coordinator_link_sent_bytes",
        "Tensor payload bytes each node reported sent, by peer, direction and codec "
        "(MQTT telemetry).",
        labels=["node", "peer", "direction", "codec"],
    )
    for link in status.links:
        link_bytes.add_metric(
            [link.src_node, link.dst_node, link.direction, link.codec], link.bytes
        )
    families += [online, serving, node_samples, link_bytes]
    return families
