"""The run record beside the checkpoints: starting, refusing, resuming."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from swarmpipe.config import load_config
from swarmpipe.coordinator import run_state
from swarmpipe.errors import ConfigError
from swarmpipe.storage.checkpoints import CheckpointStore

TINY = ["model.n_layers=2", "model.d_model=16", "model.n_heads=2", "model.context=8"]


def _fake_checkpoints(state_dir: Path, steps_by_stage: dict[int, list[int]]) -> None:
    """Empty files with checkpoint names: the record logic reads names, not contents."""
    store = CheckpointStore(state_dir / "checkpoints", "testnet")
    for stage, steps in steps_by_stage.items():
        store.stage_dir(stage).mkdir(parents=True, exist_ok=True)
        for step in steps:
            (store.stage_dir(stage) / f"step-{step:09d}.ckpt").write_bytes(b"")


def test_the_last_complete_step_is_the_newest_every_stage_has(tmp_path: Path) -> None:
    _fake_checkpoints(tmp_path, {0: [20, 30], 1: [30, 40], 2: [30]})
    store = CheckpointStore(tmp_path / "checkpoints", "testnet")
    assert run_state.last_complete_step(store, 3) == 30
    assert run_state.last_complete_step(store, 4) is None  # stage 3 has none


def test_a_new_run_refuses_a_folder_that_holds_it(tmp_path: Path) -> None:
    config = load_config(None, [*TINY, "pipeline.stages=2"])
    run_state.start(tmp_path, config)
    # Stopped before any checkpoint: nothing to lose, and --resume could not continue it.
    run_state.start(tmp_path, config)
    _fake_checkpoints(tmp_path, {0: [10]})
    with pytest.raises(ConfigError, match=r"already holds run 'testnet'.*--resume"):
        run_state.start(tmp_path, config)
    # Another run id lives in its own folder.
    run_state.start(tmp_path, load_config(None, [*TINY, "pipeline.stages=2", "run_id=other"]))


def test_resume_applies_overrides_and_starts_at_the_last_complete_step(tmp_path: Path) -> None:
    run_state.start(tmp_path, load_config(None, [*TINY, "pipeline.stages=2", "train.steps=20"]))
    _fake_checkpoints(tmp_path, {0: [10, 20], 1: [10, 20]})
    with pytest.raises(ConfigError, match="already at step 20 of 20"):
        run_state.resume(tmp_path, [], None)
    config, step = run_state.resume(tmp_path, ["train.steps=30"], None)
    assert (config.train.steps, step, config.model.n_layers) == (30, 20, 2)
    # The record now says 30 steps: resuming again needs no override.
    assert run_state.resume(tmp_path, [], None)[0].train.steps == 30


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.d_model=32"], "model, the data and pipeline.stages must stay"),
        (["pipeline.stages=1"], "model, the data and pipeline.stages must stay"),
        (["run_id=other"], "no record of run 'other'"),
    ],
)
def test_resume_refuses_what_the_checkpoints_cannot_continue(
    tmp_path: Path, overrides: list[str], words: str
) -> None:
    run_state.start(tmp_path, load_config(None, [*TINY, "pipeline.stages=2", "train.steps=20"]))
    _fake_checkpoints(tmp_path, {0: [10], 1: [10]})
    with pytest.raises(ConfigError, match=words):
        run_state.resume(tmp_path, overrides, "other" if "run_id=other" in overrides else None)


def test_resume_needs_a_record_and_a_complete_step(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no record"):
        run_state.resume(tmp_path, [], None)
    run_state.start(tmp_path, load_config(None, [*TINY, "pipeline.stages=2"]))
    _fake_checkpoints(tmp_path, {0: [10]})
    with pytest.raises(ConfigError, match="no step for which every stage has a checkpoint"):
        run_state.resume(tmp_path, [], None)


def test_a_corrupt_record_is_one_line_and_exit_2(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints" / "testnet"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text("{not json")
    before = (folder / "run.json").read_bytes()
    done = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "coordinator", "--resume", "--state-dir",
         str(tmp_path), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("swarmpipe")]
    assert len(errors) == 1 and "run.json is unreadable" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert (folder / "run.json").read_bytes() == before
