"""A real run's exported model is the model single-process training gives, and evaluates
as the run evaluated it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.model import build_full_model, load_exported
from swarmpipe.model.exported import read_exported_info
from swarmpipe.model.reference import train_single_process
from swarmpipe.storage.checkpoint_set import checkpoint_root, steps_by_stage

pytestmark = pytest.mark.timeout(600)

SETTINGS = ["checkpoint.every_steps=5", "train.eval_every=5", "train.eval_samples=10"]
"""Checkpoints and evaluations at steps 5 and 10 (10 held-out samples: not a multiple of the
microbatch, as in test_training.py)."""


def _swarmpipe(*args: str, timeout: float = 120) -> str:
    popen = subprocess.Popen(
        [sys.executable, "-m", "swarmpipe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = popen.communicate(timeout=timeout)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, f"swarmpipe {args[0]} failed:\n{out}\n{err}"
    return out


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow  # a 10-step testnet, two exports and two evals: 80 s on the shared 2 cores
def test_an_exported_testnet_run_equals_single_process_training(
    tmp_path: Path, tiny: list[str]
) -> None:
    run = tmp_path / "run"
    args = ["testnet", "--quiet", "--nodes", "3", "--stages", "3", "--steps", "10"]
    for s in [*tiny, *SETTINGS]:
        args += ["--set", s]
    _swarmpipe(*args, "--out", str(run), timeout=500)
    report: dict[str, Any] = json.loads((run / "report.json").read_text())
    run_evals = {e["step"]: e["loss"] for e in report["evals"]}
    state_dir = run / "coordinator-state"
    found = steps_by_stage(checkpoint_root(state_dir), "testnet")
    # The run is done only once every stage's final state (step 10) is stored.
    assert {stage: sorted(steps) for stage, steps in found.items()} == {
        stage: [5, 10] for stage in range(3)
    }, found
    newest = 10

    config = load_config(None, [*tiny, *SETTINGS, "train.steps=10"])
    for step, chosen in ((None, newest), (5, 5)):
        out = tmp_path / f"model-{chosen}.safetensors"
        line = _swarmpipe(
            "export", "--state-dir", str(state_dir), "--out", str(out),
            *(["--step", str(step)] if step is not None else []),
        )  # fmt: skip
        assert line.startswith(f"exported run 'testnet' at step {chosen} (3 stages, ")
        info = read_exported_info(out)
        assert info.step == chosen
        assert (info.config.model, info.config.train) == (config.model, config.train)

        want = build_full_model(config)
        train_single_process(config, steps=chosen, model=want)
        difference = _max_difference(load_exported(out).state_dict(), want.state_dict())
        print(f"step {chosen}: exported vs single-process parameters, max |diff| {difference:.3g}")
        assert difference <= 1e-4

        # The run evaluated at this step on the same held-out samples; eval must agree.
        result = json.loads(_swarmpipe("eval", "--model", str(out), "--threads", "1"))
        assert (result["step"], result["samples"]) == (chosen, 10)
        gap = abs(result["loss"] - run_evals[chosen])
        print(f"step {chosen}: eval {result['loss']} vs the run's {run_evals[chosen]}: {gap:.3g}")
        assert gap <= 1e-4 * run_evals[chosen]
