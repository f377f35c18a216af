"""`swarmpipe export`: stage checkpoints in, one model file out, or one clear refusal.

Checkpoints here are written the way nodes write them (`export_state`, the checkpoint
store), from stage runtimes whose parameters and AdamW state were moved off their
initial values, so a misplaced or missing tensor cannot pass for a fresh one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmpipe.config import RunConfig, load_config
from swarmpipe.errors import CheckpointError, ModelFileError
from swarmpipe.model import build_full_model, stage_module_counts
from swarmpipe.model.exported import export_checkpoints, load_exported, read_exported_info
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.storage.checkpoint_set import read_checkpoint_set
from swarmpipe.storage.checkpoints import CheckpointStore, state_messages

TINY = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.context=32"]
FACTORIES = Path(__file__).resolve().parents[1] / "model"


def _config(*extra: str) -> RunConfig:
    return load_config(None, [*TINY, *extra])


def _moved_stage(config: RunConfig, stage: int, seed: int) -> StageRuntime:
    """A stage whose parameters and AdamW state are no longer what it was built with."""
    runtime = StageRuntime(config, stage)
    gen = torch.Generator().manual_seed(seed * 100 + stage)
    for p in runtime.module.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    runtime.optimizer.step()
    runtime.optimizer.zero_grad(set_to_none=True)
    return runtime


def _save(
    root: Path, runtime: StageRuntime, step: int, *, manifest_run_config: str | None = None
) -> Path:
    runtime.step = step
    snapshot = runtime.export_state(node_id="n0")
    if manifest_run_config is not None:
        snapshot.manifest.run_config = manifest_run_config
    snapshot.seal()
    writer = CheckpointStore(root, runtime.config.run_id, keep=10).receive(runtime.stage)
    for message in state_messages(snapshot.manifest, snapshot.chunks()):
        writer.add(message)
    return writer.commit()


def _save_run(
    root: Path, config: RunConfig, step: int, stages: list[int] | None = None
) -> list[StageRuntime]:
    runtimes = [_moved_stage(config, s, step) for s in range(config.pipeline.stages)]
    for s in stages if stages is not None else range(config.pipeline.stages):
        _save(root, runtimes[s], step)
    return runtimes


@pytest.mark.parametrize(
    "settings",
    [
        [],
        ["model.bottleneck=4", "model.bottleneck_recent=2"],
        ["pipeline.stages=2", "model.factory=user_factory_models:layers"],
    ],
    ids=["gpt", "bottleneck", "factory"],
)
def test_the_exported_model_computes_what_the_stages_compute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: list[str]
) -> None:
    monkeypatch.syspath_prepend(str(FACTORIES))
    config = _config(*settings)
    runtimes = _save_run(tmp_path / "state" / "checkpoints", config, 5)
    out = tmp_path / "out" / "model.safetensors"
    done = export_checkpoints(read_checkpoint_set(tmp_path / "state"), out, config=None)
    assert (done.run_id, done.step, done.model_file) == (config.run_id, 5, out)

    model = load_exported(out)
    assert not model.training
    # Exactly the single-process model's names, shapes and dtypes, and nothing else.
    fresh = build_full_model(config).state_dict()
    loaded = model.state_dict()
    assert list(loaded) == list(fresh)
    assert all(loaded[k].shape == v.shape and loaded[k].dtype == v.dtype for k, v in fresh.items())
    # Each stage's parameters landed where the whole model uses them: the same outputs.
    tokens = torch.randint(0, config.model.vocab, (2, config.model.context))
    with torch.no_grad():
        x = tokens
        for r in runtimes:
            r.module.eval()
            x = r.module(x, tokens)
        torch.testing.assert_close(model(tokens), x, rtol=0, atol=0)
    assert sum(stage_module_counts(config)) == len(model)

    info = read_exported_info(out)
    assert (info.config, info.run_id, info.step) == (config, config.run_id, 5)
    description = json.loads(out.with_suffix(".json").read_text())
    assert (
        description["step"] == 5
        and RunConfig.from_json(json.dumps(description["run_config"])) == config
    )
    assert list(description["tensors"]) == list(fresh)
    assert description["parameters"] == done.parameters == sum(v.numel() for v in fresh.values())
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.json", "model.safetensors"]
    # Files to share, as the umask makes them, not private (0600) as save_file makes its own.
    (tmp_path / "probe").touch()
    mode = (tmp_path / "probe").stat().st_mode
    assert [p.stat().st_mode for p in out.parent.iterdir()] == [mode, mode]


def test_a_testnet_out_folder_is_a_state_dir(tmp_path: Path) -> None:
    _save_run(tmp_path / "coordinator-state" / "checkpoints", _config(), 3)
    assert read_checkpoint_set(tmp_path).step == 3


def test_a_shared_checkpoint_folder_and_the_newest_complete_step(tmp_path: Path) -> None:
    # checkpoint.dir holds <run>/stage-<s>/ directly; step 8 lacks stage 2, so 4 is newest.
    config = _config()
    _save_run(tmp_path, config, 4)
    _save_run(tmp_path, config, 8, stages=[0, 1])
    assert read_checkpoint_set(tmp_path).step == 4
    with pytest.raises(
        CheckpointError, match=r"stage 2 has no checkpoint at step 8 \(.*stage 2 has step 4\)"
    ):
        read_checkpoint_set(tmp_path, step=8)


def _refusal(tmp_path: Path, **kwargs: object) -> str:
    with pytest.raises(CheckpointError) as caught:
        done = read_checkpoint_set(tmp_path, **kwargs)  # type: ignore[arg-type]
        export_checkpoints(done, tmp_path / "model.safetensors")
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_refuses_a_folder_without_checkpoints(tmp_path: Path) -> None:
    assert "no checkpoints under" in _refusal(tmp_path)
    assert "is not a folder" in _refusal(tmp_path / "nonesuch")


def test_refuses_an_unknown_run_and_asks_which_of_several(tmp_path: Path) -> None:
    _save_run(tmp_path, _config("run_id=a"), 2)
    _save_run(tmp_path, _config("run_id=b"), 2)
    assert "no checkpoints of run 'c' under" in _refusal(tmp_path, run_id="c")
    assert "holds the runs a, b; choose one with --run" in _refusal(tmp_path)
    assert read_checkpoint_set(tmp_path, run_id="b").run_id == "b"


def test_refuses_a_step_a_stage_never_saved(tmp_path: Path) -> None:
    _save_run(tmp_path, _config(), 2, stages=[0, 1])
    message = _refusal(tmp_path)
    assert "stage 2 of run 'testnet' has no checkpoint at step 2 (the run has 3 stages" in message


def test_refuses_stages_with_no_step_in_common(tmp_path: Path) -> None:
    config = _config()
    _save_run(tmp_path, config, 2, stages=[1, 2])
    _save_run(tmp_path, config, 4, stages=[0])
    message = _refusal(tmp_path)
    assert (
        "no step has a checkpoint of every stage (stage 0 has step 4; stage 1 has step 2" in message
    )


def test_refuses_a_file_whose_contents_are_another_step(tmp_path: Path) -> None:
    config = _config()
    _save_run(tmp_path, config, 2)
    stage0 = tmp_path / "testnet" / "stage-0"
    moved = _save(tmp_path, _moved_stage(config, 0, 9), 9)
    moved.replace(stage0 / "step-000000002.ckpt")
    assert "holds stage 0 at step 9, not stage 0 at step 2 as its path says" in _refusal(tmp_path)


def test_refuses_stages_of_two_runs_that_share_a_run_id(tmp_path: Path) -> None:
    _save_run(tmp_path, _config(), 2, stages=[0, 2])
    _save_run(tmp_path, _config("train.lr=0.01"), 2, stages=[1])
    assert "carry different run configs" in _refusal(tmp_path)


def test_refuses_a_file_of_another_run(tmp_path: Path) -> None:
    _save_run(tmp_path, _config(), 2, stages=[0, 2])
    stray = _save(tmp_path, _moved_stage(_config("run_id=other"), 1, 2), 2)
    target = tmp_path / "testnet" / "stage-1"
    target.mkdir()
    stray.replace(target / stray.name)
    shutil.rmtree(tmp_path / "other")
    assert "belongs to run 'other', not 'testnet'" in _refusal(tmp_path)


def test_a_corrupt_file_is_refused_and_nothing_is_overwritten(tmp_path: Path) -> None:
    _save_run(tmp_path / "ckpt", _config(), 2)
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"the previous export")
    path = tmp_path / "ckpt" / "testnet" / "stage-1" / "step-000000002.ckpt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"stage-1/step-000000002.ckpt is unusable: .*sha256"):
        export_checkpoints(read_checkpoint_set(tmp_path / "ckpt"), out)
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match=r"ended after \d+ of \d+ bytes"):
        export_checkpoints(read_checkpoint_set(tmp_path / "ckpt"), out)
    assert out.read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.safetensors"]


def test_old_checkpoints_without_a_run_config_export_with_the_config_given(tmp_path: Path) -> None:
    config = _config()
    for s in range(3):
        _save(tmp_path, _moved_stage(config, s, 3), 3, manifest_run_config="")
    checkpoints = read_checkpoint_set(tmp_path)
    with pytest.raises(CheckpointError, match=r"carry no run config .* pass the run's --config"):
        export_checkpoints(checkpoints, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match="names run 'x'; the checkpoints are of 'testnet'"):
        export_checkpoints(checkpoints, tmp_path / "m.safetensors", config=_config("run_id=x"))
    with pytest.raises(CheckpointError, match=r"parameter '0.tok.weight' is .* \[256, 32\] in"):
        export_checkpoints(
            checkpoints, tmp_path / "m.safetensors", config=_config("model.d_model=64")
        )
    export_checkpoints(checkpoints, tmp_path / "m.safetensors", config=config)
    assert read_exported_info(tmp_path / "m.safetensors").config == config


def test_loading_refuses_files_swarmpipe_did_not_write(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="does not exist"):
        load_exported(tmp_path / "nonesuch.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ModelFileError, match="not a readable safetensors file"):
        load_exported(junk)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(junk))
    with pytest.raises(ModelFileError, match="was not written by `swarmpipe export`"):
        load_exported(junk)


def _swarmpipe(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "swarmpipe", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
def test_the_commands_print_one_line_for_bad_input(tmp_path: Path) -> None:
    done = _swarmpipe(
        "export", "--state-dir", str(tmp_path), "--out", str(tmp_path / "m.safetensors")
    )
    assert done.returncode == 1
    assert done.stderr.startswith("swarmpipe export: error: no checkpoints under")
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    done = _swarmpipe("eval", "--model", str(tmp_path / "m.safetensors"))
    assert (done.returncode, done.stderr.count("\n")) == (1, 1)
    assert done.stderr.startswith("swarmpipe eval: error: ") and "does not exist" in done.stderr


def test_finding_checkpoints_imports_no_torch() -> None:
    # The checkpoint set is read without torch, like the store the coordinator uses.
    code = "import sys, swarmpipe.storage.checkpoint_set; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
