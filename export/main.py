"""`swarmpipe export`: one step of a run's stage checkpoints as one safetensors model file.

Reads `<dir>/checkpoints/<run>/stage-<s>/step-<N>.ckpt` (the coordinator's --state-dir; a
testnet's --out holds one as coordinator-state/) or `<dir>/<run>/stage-<s>/...` (a shared
checkpoint.dir), takes step N or by default the newest step that every stage has, checks
each file (sha256, run, stage count, step, run config), and writes the model's parameters,
optimizer state left out, under the single-process model's state_dict() names. The run
config goes into the file's metadata and, with the tensor names and shapes, into a .json
beside it. Prints one line.
"""

from __future__ import annotations

import argparse

from swarmpipe.config import add_config_arguments, load_config


def _step(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is >= 0, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        required=True,
        help="the coordinator's --state-dir, the shared folder checkpoint.dir names, or a "
        "testnet's --out",
    )
    parser.add_argument(
        "--run", dest="run_id", help="the run to export (default: the only one in the folder)"
    )
    parser.add_argument(
        "--step",
        type=_step,
        help="the step whose checkpoints to export (default: the newest that every stage has)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="the model file to write, e.g. model.safetensors; model.json goes beside it",
    )
    add_config_arguments(parser)
    parser.epilog = "--config/--set: only for checkpoints written before they carried the config."


def serve(args: argparse.Namespace) -> int:
    from swarmpipe.model.exported import export_checkpoints
    from swarmpipe.storage.checkpoint_set import read_checkpoint_set

    given = load_config(args.config, args.set) if args.config or args.set else None
    checkpoints = read_checkpoint_set(args.state_dir, run_id=args.run_id, step=args.step)
    done = export_checkpoints(checkpoints, args.out, config=given)
    print(
        f"exported run {done.run_id!r} at step {done.step} ({len(done.checkpoints)} stages, "
        f"{done.parameters} parameters) to {done.model_file} and {done.description_file}"
    )
    return 0
