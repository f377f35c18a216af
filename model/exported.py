"""A run's trained model as one safetensors file, and loading it back with one call.

A run's parameters are spread over its stages' checkpoints, each under the stage module's
own names (`0.qkv.weight` is the first module *of that stage*). Every stage builds its
slice of the whole model (model/partition.py), so stage s's module i is module
`sum(counts[:s]) + i` of `build_full_model`: `assemble_state_dict` renames each
parameter to the single-process model's `state_dict()` name and checks the result
against that model, name by name, shape by shape, before anything is written.

The file is self-describing: its safetensors metadata carries the RunConfig as JSON,
the run id and the step, so `load_exported(path)` needs nothing else. The same facts
go beside it as `<name>.json` for people and tools that do not read safetensors headers.
Both are written to temporary files and renamed, so a failed export leaves whatever
was there before untouched.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from swarmpipe.compression.codec import DTYPES
from swarmpipe.config import RunConfig
from swarmpipe.errors import CheckpointError, ModelFileError
from swarmpipe.model.partition import StageModule, build_full_model, stage_module_counts
from swarmpipe.storage.checkpoint_set import CheckpointSet, RawTensor
from swarmpipe.storage.checkpoints import fsync_path

FORMAT = "swarmpipe-model/1"
"""The value of the metadata key `swarmpipe.format`: what wrote the file, and how to read it."""

_META_FORMAT = "swarmpipe.format"
_META_CONFIG = "swarmpipe.run_config"
_META_RUN = "swarmpipe.run_id"
_META_STEP = "swarmpipe.step"


@dataclass(frozen=True, slots=True)
class ExportedModelInfo:
    """What an exported file says about itself."""

    config: RunConfig
    run_id: str
    step: int
    """The step the parameters would train next: steps 0..step-1 are in them."""


def _tensor(raw: RawTensor) -> torch.Tensor:
    dtype = DTYPES.get(raw.dtype)
    if dtype is None:
        raise CheckpointError(f"a parameter has dtype {raw.dtype}, which swarmpipe does not know")
    if not raw.data:
        return torch.empty(raw.shape, dtype=dtype)
    return torch.frombuffer(raw.data, dtype=dtype).reshape(raw.shape)


def assemble_state_dict(checkpoints: CheckpointSet, config: RunConfig) -> dict[str, torch.Tensor]:
    """Every stage's parameters under the single-process model's names, checked against it.

    CheckpointError when the stages do not add up to exactly that model's state_dict.
    """
    counts = stage_module_counts(config)
    if len(counts) != checkpoints.num_stages:
        raise CheckpointError(
            f"the checkpoints hold {checkpoints.num_stages} stages; the run config says "
            f"pipeline.stages={len(counts)}"
        )
    offsets = [sum(counts[:s]) for s in range(len(counts))]
    tensors: dict[str, torch.Tensor] = {}
    for stage in checkpoints.stages:
        for local, raw in stage.params.items():
            index, _, rest = local.partition(".")
            if not index.isdigit() or int(index) >= counts[stage.stage] or not rest:
                raise CheckpointError(
                    f"{stage.path} has a parameter {local!r} that stage {stage.stage} of this "
                    "model does not have"
                )
            tensors[f"{offsets[stage.stage] + int(index)}.{rest}"] = _tensor(raw)
    want = build_full_model(config).state_dict()
    missing = [name for name in want if name not in tensors]
    extra = [name for name in tensors if name not in want]
    if missing or extra:
        what = f"lack {missing[0]!r}" if missing else f"have {extra[0]!r}, which it does not"
        raise CheckpointError(
            f"the checkpoints {what} ({len(missing)} missing, {len(extra)} unexpected against "
            "the model their run config builds; a model with buffers cannot be exported, "
            "checkpoints carry parameters only)"
        )
    for name, expected in want.items():
        got = tensors[name]
        if got.shape != expected.shape or got.dtype != expected.dtype:
            raise CheckpointError(
                f"parameter {name!r} is {got.dtype} {list(got.shape)} in the checkpoints; the "
                f"model has {expected.dtype} {list(expected.shape)}"
            )
    return {name: tensors[name] for name in want}


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What `export_checkpoints` wrote, and from which checkpoints."""

    model_file: Path
    description_file: Path
    run_id: str
    step: int
    parameters: int
    checkpoints: list[Path]


def export_checkpoints(
    checkpoints: CheckpointSet, out: str | Path, *, config: RunConfig | None = None
) -> ExportResult:
    """Assemble one checked step of a run into `out` (see `write_exported`).

    The run config comes from the checkpoints; `config` is for checkpoints written before
    manifests carried it, and must not contradict ones that do.
    """
    carried = RunConfig.from_json(checkpoints.run_config) if checkpoints.run_config else None
    if carried is not None and config is not None and carried != config:
        raise CheckpointError(
            "the checkpoints carry their own run config, which differs from the one given; "
            "leave out --config/--set"
        )
    config = carried or config
    if config is None:
        raise CheckpointError(
            f"the checkpoints of run {checkpoints.run_id!r} carry no run config (written by an "
            "older swarmpipe); pass the run's --config and --set flags"
        )
    if config.run_id != checkpoints.run_id:
        raise CheckpointError(
            f"the run config names run {config.run_id!r}; the checkpoints are of "
            f"{checkpoints.run_id!r}"
        )
    tensors = assemble_state_dict(checkpoints, config)
    model_file, description = write_exported(tensors, out, config=config, step=checkpoints.step)
    return ExportResult(
        model_file,
        description,
        checkpoints.run_id,
        checkpoints.step,
        sum(t.numel() for t in tensors.values()),
        [s.path for s in checkpoints.stages],
    )


def write_exported(
    tensors: dict[str, torch.Tensor], out: str | Path, *, config: RunConfig, step: int
) -> tuple[Path, Path]:
    """Write `out` (safetensors) and `out` with the suffix .json, atomically; return both."""
    out = Path(out)
    description = out.with_suffix(".json")
    if description == out:
        raise ModelFileError(f"{out} ends in .json: name the model file *.safetensors")
    metadata = {
        _META_FORMAT: FORMAT,
        _META_CONFIG: config.to_json(),
        _META_RUN: config.run_id,
        _META_STEP: str(step),
    }
    summary = {
        "format": FORMAT,
        "model_file": out.name,
        "run_id": config.run_id,
        "step": step,
        "parameters": sum(t.numel() for t in tensors.values()),
        "tensors": {name: list(t.shape) for name, t in tensors.items()},
        "run_config": json.loads(config.to_json()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    temps: list[Path] = []
    try:
        model_tmp = _temp_beside(out, temps)
        mode = model_tmp.stat().st_mode
        save_file(tensors, str(model_tmp), metadata=metadata)
        model_tmp.chmod(mode)  # save_file recreates the file private (0600)
        fsync_path(model_tmp)
        json_tmp = _temp_beside(description, temps)
        json_tmp.write_text(json.dumps(summary, indent=2) + "\n")
        fsync_path(json_tmp)
        # The description first: a model file is never left beside another run's description.
        os.replace(json_tmp, description)
        os.replace(model_tmp, out)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
    return out, description


def _temp_beside(path: Path, temps: list[Path]) -> Path:
    # Not mkstemp: its files are private (0600), and the model is meant to be shared, so the
    # file gets the permissions the user's umask gives any new file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    temps.append(tmp)
    return tmp


def read_exported_info(path: str | Path) -> ExportedModelInfo:
    """The run config, run id and step an exported model file carries."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{path} is not a readable safetensors file ({exc})") from exc
    if metadata.get(_META_FORMAT) != FORMAT:
        raise ModelFileError(
            f"{path} was not written by `swarmpipe export` (its metadata has no "
            f"{_META_FORMAT}={FORMAT})"
        )
    try:
        step = int(metadata[_META_STEP])
        config = RunConfig.from_json(metadata[_META_CONFIG])
    except (KeyError, ValueError) as exc:
        raise ModelFileError(f"{path} has damaged swarmpipe metadata ({exc})") from exc
    return ExportedModelInfo(config, metadata.get(_META_RUN, config.run_id), step)


def load_exported(path: str | Path) -> StageModule:
    """The single-process model (built-in GPT or the run's factory) with an exported file's
    weights loaded strictly, in eval mode. Call `.to(device)` to move it."""
    info = read_exported_info(path)
    model = build_full_model(info.config)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{path} is not a readable safetensors file ({exc})") from exc
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        raise ModelFileError(
            f"{path} does not hold the weights of the model its config builds: "
            f"{' '.join(line.strip() for line in first[:2])}"
        ) from exc
    model.eval()
    return model
