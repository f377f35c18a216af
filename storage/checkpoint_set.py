"""One step's checkpoints of every stage of a run, found in a folder and checked as a set.

Exporting a run's model reads what the checkpoint store (storage/checkpoints.py) left:
`<root>/<run_id>/stage-<s>/step-<N>.ckpt`, where root is the coordinator's
`--state-dir`/checkpoints or a shared `checkpoint.dir`. One step's stages form a
consistent set when each file passes its own checks (manifest bounds, length, sha256),
is the stage and step its path names, and all of them agree on the run, the number of
stages and the run config. Anything else is a `CheckpointError` naming the file, so an
export never mixes the parameters of two runs or two steps.

Only the parameters are kept in memory (`param:<name>` tensors); the optimizer state
streams past and counts only towards the digest. No torch here: the bytes come back raw,
with their dtype enum and shape, for the caller to view as tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from swarmpipe.errors import CheckpointError, PeerError
from swarmpipe.protos import state_pb2, tensor_pb2
from swarmpipe.storage.checkpoints import (
    MAX_STATE_BYTES,
    CheckpointStore,
    StateStream,
    read_checkpoint,
    state_messages,
    tensor_bytes,
)

_STAGE_DIR = re.compile(r"stage-(\d{1,9})")
PARAM_PREFIX = "param:"
"""How a parameter's stream name starts (the optimizer's tensors start with their key)."""


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One parameter's bytes as the checkpoint holds them: little-endian, row-major."""

    dtype: tensor_pb2.DType.ValueType
    shape: tuple[int, ...]
    data: bytearray


@dataclass(frozen=True, slots=True)
class StageParameters:
    """One checked checkpoint's parameters, by the stage module's own parameter names."""

    stage: int
    path: Path
    manifest: state_pb2.StateManifest
    params: dict[str, RawTensor]


@dataclass(frozen=True, slots=True)
class CheckpointSet:
    """Every stage of one run at one step, checked against each other."""

    run_id: str
    step: int
    num_stages: int
    run_config: str
    """The RunConfig as JSON, equal in every stage's manifest ("" in checkpoints written
    before manifests carried it)."""
    stages: list[StageParameters]


def checkpoint_root(state_dir: str | Path) -> Path:
    """The folder holding `<run_id>/stage-<s>/`: the coordinator's `--state-dir` keeps it in
    `checkpoints/`, a testnet's `--out` keeps that state dir in `coordinator-state/`, and a
    shared `checkpoint.dir` is it."""
    folder = Path(state_dir)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    for inner in (folder / "checkpoints", folder / "coordinator-state" / "checkpoints"):
        if inner.is_dir():
            return inner
    return folder


def _stage_dirs(run_dir: Path) -> dict[int, Path]:
    found = {}
    for path in run_dir.iterdir():
        match = _STAGE_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def runs_in(root: Path) -> list[str]:
    """The run ids that have at least one stage folder under `root`."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _stage_dirs(p))


def choose_run(root: Path, run_id: str | None) -> str:
    """`run_id`, or the only run under `root`; CheckpointError when that is not one run."""
    runs = runs_in(root)
    if not runs:
        raise CheckpointError(
            f"no checkpoints under {root}: expected <run_id>/stage-<s>/step-<N>.ckpt "
            "(is checkpoint.every_steps 0, or is this not the coordinator's --state-dir or "
            "the checkpoint.dir?)"
        )
    if run_id is None:
        if len(runs) > 1:
            raise CheckpointError(f"{root} holds the runs {', '.join(runs)}; choose one with --run")
        return runs[0]
    if run_id not in runs:
        raise CheckpointError(
            f"no checkpoints of run {run_id!r} under {root}; it holds {', '.join(runs)}"
        )
    return run_id


def steps_by_stage(root: Path, run_id: str) -> dict[int, dict[int, Path]]:
    """stage -> step -> checkpoint file, for each stage folder of the run."""
    store = CheckpointStore(root, run_id)
    return {stage: dict(store.checkpoints(stage)) for stage in sorted(_stage_dirs(root / run_id))}


def choose_step(found: dict[int, dict[int, Path]], step: int | None) -> int:
    """`step` if every stage folder holds it, else the newest step that every one holds.

    A stage with no folder at all is noticed later, from the manifests' stage count.
    """
    listing = "; ".join(
        f"stage {s} has {_steps_text(sorted(steps))}" for s, steps in sorted(found.items())
    )
    if step is not None:
        lacking = [s for s, steps in sorted(found.items()) if step not in steps]
        if lacking:
            raise CheckpointError(
                f"stage {lacking[0]} has no checkpoint at step {step} ({listing})"
            )
        return step
    common = set.intersection(*(set(steps) for steps in found.values()))
    if not common:
        raise CheckpointError(f"no step has a checkpoint of every stage ({listing})")
    return max(common)


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "no checkpoints"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


def read_stage(path: Path, *, run_id: str, stage: int, step: int) -> StageParameters:
    """Read one checkpoint file whole, check it, and keep its parameters' bytes."""
    sink = _ParamSink()

    def check(manifest: state_pb2.StateManifest) -> None:
        if manifest.run_id != run_id:
            raise PeerError(f"it belongs to run {manifest.run_id!r}, not {run_id!r}")
        if manifest.stage != stage or manifest.step != step:
            raise PeerError(
                f"it holds stage {manifest.stage} at step {manifest.step}, not stage {stage} "
                f"at step {step} as its path says"
            )
        if manifest.stage >= manifest.num_stages:
            raise PeerError(f"it names stage {manifest.stage} of {manifest.num_stages}")

    stream = StateStream(max_bytes=MAX_STATE_BYTES, check=check, open_sink=sink.open)
    try:
        manifest, chunks = read_checkpoint(path)
        try:
            for message in state_messages(manifest, chunks):
                stream.add(message)
        finally:
            chunks.close()
        checked = stream.finish()
    except PeerError as exc:
        raise CheckpointError(f"checkpoint {path} is unusable: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    return StageParameters(stage, path, checked, sink.params)


def read_checkpoint_set(
    state_dir: str | Path, *, run_id: str | None = None, step: int | None = None
) -> CheckpointSet:
    """Find, read and check one step's checkpoints of every stage of a run.

    The step is `step`, or by default the newest one that every stage has.
    """
    root = checkpoint_root(state_dir)
    run = choose_run(root, run_id)
    found = steps_by_stage(root, run)
    chosen = choose_step(found, step)
    stages = [
        read_stage(files[chosen], run_id=run, stage=s, step=chosen)
        for s, files in sorted(found.items())
    ]
    first = stages[0]
    num_stages = int(first.manifest.num_stages)
    for s in stages:
        if s.manifest.num_stages != num_stages:
            raise CheckpointError(
                f"checkpoints of step {chosen} disagree on the number of stages: {first.path} "
                f"says {num_stages}, {s.path} says {s.manifest.num_stages}; they come from "
                "different runs that share the run id"
            )
        if s.manifest.run_config != first.manifest.run_config:
            raise CheckpointError(
                f"checkpoints of step {chosen} carry different run configs ({first.path} and "
                f"{s.path}); they come from different runs that share the run id"
            )
    have = {s.stage for s in stages}
    missing = [s for s in range(num_stages) if s not in have]
    if missing:
        raise CheckpointError(
            f"stage {missing[0]} of run {run!r} has no checkpoint at step {chosen} (the run "
            f"has {num_stages} stages; found {', '.join(map(str, sorted(have)))})"
        )
    return CheckpointSet(run, chosen, num_stages, first.manifest.run_config, stages)


class _ParamSink:
    """Takes the payload as it streams and keeps only the parameters' bytes."""

    def __init__(self) -> None:
        self.params: dict[str, RawTensor] = {}
        self._ranges: Iterator[tuple[int, int, RawTensor]] = iter(())
        self._current: tuple[int, int, RawTensor] | None = None
        self._offset = 0

    def open(self, manifest: state_pb2.StateManifest) -> _ParamSink:
        # The manifest was checked (sizes add up to payload_bytes, under the limit) before this
        # runs, so the buffers below never exceed what the file's own header promised.
        ranges = []
        offset = 0
        for t in manifest.tensors:
            n = tensor_bytes(t)
            if t.name.startswith(PARAM_PREFIX):
                raw = RawTensor(t.dtype, tuple(t.shape), bytearray(n))
                self.params[t.name.removeprefix(PARAM_PREFIX)] = raw
                ranges.append((offset, offset + n, raw))
            offset += n
        self._ranges = iter(ranges)
        self._current = next(self._ranges, None)
        return self

    def write(self, data: bytes) -> None:
        end = self._offset + len(data)
        while self._current is not None and self._current[0] < end:
            start, stop, raw = self._current
            lo, hi = max(start, self._offset), min(stop, end)
            if lo < hi:
                raw.data[lo - start : hi - start] = data[lo - self._offset : hi - self._offset]
            if stop > end:
                break
            self._current = next(self._ranges, None)
        self._offset = end
