"""What a coordinator keeps of a run between its lives, beside the stage checkpoints.

`<state-dir>/checkpoints/<run_id>/run.json` holds the run's config, written when a
coordinator starts the run. `swarmpipe coordinator --resume --state-dir DIR` reads it back
(with `--set` overrides on top, e.g. `train.steps=N` to extend a finished run) and resumes
from the last complete step: the newest step for which every stage has a checkpoint. Step s
always trains on the same samples, and each stage's checkpoint holds its parameters and
optimizer state, so nodes that join a resumed run restore those checkpoints and train on as
if nothing had happened. A coordinator started without `--resume` on a folder that already
holds checkpoints of the same run refuses, rather than mix a new run's checkpoints with the
old one's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from swarmpipe.config import RunConfig, load_config
from swarmpipe.errors import ConfigError
from swarmpipe.storage.checkpoints import CheckpointStore

RUN_FILE = "run.json"
FORMAT = "swarmpipe.run/1"


def run_folder(state_dir: Path, run_id: str) -> Path:
    return state_dir / "checkpoints" / run_id


def last_complete_step(store: CheckpointStore, stages: int) -> int | None:
    """The newest step for which every stage has a checkpoint, or None."""
    common: set[int] | None = None
    for stage in range(stages):
        steps = {step for step, _ in store.checkpoints(stage)}
        common = steps if common is None else common & steps
    return max(common) if common else None


def _write(state_dir: Path, config: RunConfig) -> None:
    folder = run_folder(state_dir, config.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"format": FORMAT, "run_id": config.run_id, "config": dataclasses.asdict(config)}
    tmp = folder / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.replace(tmp, folder / RUN_FILE)


def _read(path: Path) -> dict[str, object]:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is unreadable: {exc}") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a swarmpipe run record ({FORMAT})")
    if not isinstance(record.get("config"), dict):
        raise ConfigError(f"{path} has no run config")
    return record


def start(state_dir: Path, config: RunConfig) -> None:
    """A new run: refuse a folder that already holds checkpoints of this run, then record
    its config. A record with no checkpoint beside it (a coordinator stopped before any was
    stored) holds nothing to lose, and is replaced: --resume could not continue it."""
    store = CheckpointStore(state_dir / "checkpoints", config.run_id)
    held = [store.latest(stage) for stage in range(config.pipeline.stages)]
    if any(held):
        newest = max((entry[0] for entry in held if entry), default=0)
        raise ConfigError(
            f"{state_dir} already holds run {config.run_id!r} (checkpoints up to step {newest}): "
            "pass --resume to continue it, or give another --state-dir or run_id"
        )
    _write(state_dir, config)


def resume(state_dir: Path, overrides: list[str], run_id: str | None) -> tuple[RunConfig, int]:
    """The run recorded in `state_dir` with `overrides` applied, and the step it resumes at."""
    records = sorted((state_dir / "checkpoints").glob(f"*/{RUN_FILE}"))
    if run_id is not None:
        records = [r for r in records if r.parent.name == run_id]
    if not records:
        which = f"run {run_id!r}" if run_id else "a run"
        raise ConfigError(f"--resume: {state_dir} holds no record of {which} to resume")
    if len(records) > 1:
        names = ", ".join(r.parent.name for r in records)
        raise ConfigError(f"--resume: {state_dir} holds several runs ({names}); add --set run_id=…")
    record = _read(records[0])
    stored = RunConfig.from_json(json.dumps(record["config"]))
    config = load_config(None, overrides, base=stored)
    if config.run_id != stored.run_id:
        raise ConfigError("--resume continues the recorded run: run_id cannot change")
    if (config.model, config.data, config.pipeline.stages) != (
        stored.model,
        stored.data,
        stored.pipeline.stages,
    ):
        raise ConfigError(
            "--resume: the model, the data and pipeline.stages must stay as recorded; "
            "the checkpoints hold that model"
        )
    store = CheckpointStore(state_dir / "checkpoints", config.run_id)
    step = last_complete_step(store, config.pipeline.stages)
    if step is None:
        raise ConfigError(
            f"--resume: run {config.run_id!r} has no step for which every stage has a "
            "checkpoint; start it again instead"
        )
    if step >= config.train.steps:
        raise ConfigError(
            f"run {config.run_id!r} is already at step {step} of {config.train.steps}; "
            f"pass --set train.steps=N with N > {step} to train it further"
        )
    _write(state_dir, config)
    return config, step
