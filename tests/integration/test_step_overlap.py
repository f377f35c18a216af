"""train.step_overlap end to end: a lossless testnet whose steps overlap trains exactly as
single-process training that applies the same rule, step by step, on the parameter versions
the run's report.json records."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmpipe.config import load_config
from swarmpipe.model.reference import train_single_process
from tests.integration.test_training import assert_losses_match, run_testnet

pytestmark = pytest.mark.timeout(600)

SETTINGS = (
    "pipeline.activation_codec=lossless",
    "pipeline.gradient_codec=lossless",
    "checkpoint.every_steps=5",
    "train.eval_every=5",
    "train.eval_samples=10",
)


@pytest.mark.slow
@pytest.mark.parametrize("depth", ["true", "3"])
def test_overlapped_lossless_pipeline_matches_the_same_rule_in_one_process(
    tmp_path: Path, tiny: list[str], depth: str
) -> None:
    # Four nodes on three stages: one stage has two replicas, so the reduce of step s runs
    # while later steps accumulate on the same replicas. `true` is depth 1.
    settings = (f"train.step_overlap={depth}", *SETTINGS)
    k = 1 if depth == "true" else int(depth)
    report = run_testnet(tmp_path, tiny, 10, *settings, nodes=4)
    trains_on = [s["trains_on"] for s in report["steps"]]
    assert [s["step"] for s in report["steps"]] == list(range(10))
    # Step 0 and the checkpoint step 5 are drain points; every other step may open early,
    # up to k steps behind, and on this idle swarm some did (at depth 3, some more than one
    # step behind: steps 2 and 3 open with step 1, on step 0's parameters).
    assert trains_on[0] == 0 and trains_on[5] == 5
    assert all(step - k <= on <= step for step, on in enumerate(trains_on)), trains_on
    assert any(on < step for step, on in enumerate(trains_on)), trains_on
    if k > 1:
        assert any(on < step - 1 for step, on in enumerate(trains_on)), trains_on

    config = load_config(None, [*tiny, *settings, "train.steps=10"])
    want_evals: list[tuple[int, float]] = []
    baseline = train_single_process(config, evals=want_evals, trains_on=trains_on)
    assert_losses_match(report, baseline, want_evals)
    # An evaluation measures the parameters its step trains on.
    assert [e["trains_on"] for e in report["evals"]] == [0, 5, 10]
    # The delayed gradient is a different trajectory from the synchronous one: the rule
    # matters, and the test above would fail against the plain baseline.
    plain = train_single_process(load_config(None, [*tiny, "train.steps=10"]))
    assert abs(plain[-1] - baseline[-1]) > 1e-4 * abs(plain[-1])

    c = report["counters"]
    assert c["lost"] == 0 and c["committed"] == 10 * 16 and c["outstanding"] == 0
    by_stage: dict[int, set[str]] = {}
    for m in report["members"]:
        assert m["last_step"] == 9
        by_stage.setdefault(m["stage"], set()).add(m["param_digest"])
    assert sorted(by_stage) == [0, 1, 2]
    assert all(len(digests) == 1 for digests in by_stage.values()), by_stage
