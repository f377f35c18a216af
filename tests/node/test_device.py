"""Which device a node trains on: the spec, the choice among GPUs, and the refusals.

The machines here are described by the memory each GPU has in use, so every branch runs
without a GPU; tests/integration/test_training.py trains on a real one where CUDA is.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.errors import ConfigError
from swarmpipe.node.device import resolve_device, to_device
from tests.conftest import Procs


def _machine(*used: int) -> Callable[[], Sequence[int]]:
    return lambda: list(used)


def test_cpu_is_always_there_and_auto_takes_it_without_a_gpu() -> None:
    assert resolve_device("cpu", memory_used=_machine(1, 2)) == torch.device("cpu")
    assert resolve_device("auto", memory_used=_machine()) == torch.device("cpu")


def test_auto_takes_the_gpu_with_the_least_memory_in_use_first_on_a_tie() -> None:
    assert resolve_device("auto", memory_used=_machine(9, 3, 5)) == torch.device("cuda", 1)
    assert resolve_device("auto", memory_used=_machine(4, 2, 2)) == torch.device("cuda", 1)


def test_cuda_names_the_first_gpu_and_cuda_n_the_nth() -> None:
    assert resolve_device("cuda", memory_used=_machine(0, 0)) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", memory_used=_machine(0, 0)) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("spec", "gpus", "said"),
    [
        ("gpu", 1, "--device 'gpu' is not a device; use auto, cpu, cuda or cuda:N"),
        ("cuda:", 1, "--device 'cuda:' is not a device"),
        ("cuda:-1", 1, "--device 'cuda:-1' is not a device"),
        ("CPU", 0, "--device 'CPU' is not a device"),
        ("cuda", 0, "--device cuda: this machine has no CUDA GPU"),
        ("cuda:0", 0, "--device cuda:0: this machine has no CUDA GPU"),
        ("cuda:2", 2, "--device cuda:2: this machine has 2 CUDA GPU(s), cuda:0 to cuda:1"),
    ],
)
def test_a_device_not_here_is_one_clear_line(spec: str, gpus: int, said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_device(spec, memory_used=_machine(*[0] * gpus))
    assert str(caught.value).startswith(said)
    assert "\n" not in str(caught.value)


def test_the_run_setting_is_checked_as_written_when_the_config_loads() -> None:
    assert load_config(None, ["train.device=cuda:3"]).train.device == "cuda:3"
    with pytest.raises(ConfigError, match=r"train\.device 'tpu' is not a device"):
        load_config(None, ["train.device=tpu"])


def test_a_tensor_already_on_the_device_is_not_copied() -> None:
    x = torch.ones(3)
    assert to_device(x, torch.device("cpu")) is x


def _swarmpipe(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "swarmpipe", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


NO_CUDA = "torch sees a CUDA GPU here, so cuda is no bad input"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["node", "--device", "gpu"], "--device 'gpu' is not a device"),
        (["node", "--device", "cuda:99"], "--device cuda:99: this machine has "),
        (["testnet", "--device", "gpu"], "--device 'gpu' is not a device"),
        (["testnet", "--set", "model.preset=huge"], "model.preset='huge' does not exist"),
        (["coordinator", "--set", "model.preset=large"], "model.preset='large' does not exist"),
        (["coordinator", "--set", "train.precision=fp8"], "train.precision='fp8': use one of"),
    ],
)
def test_bad_devices_and_presets_exit_2_with_one_line_before_anything_starts(
    words: list[str], said: str, tmp_path: Path
) -> None:
    # Port 9 has no coordinator: a node that tried to join would wait, then exit 3.
    extra = ["--coordinator", "127.0.0.1:9", "--join-timeout", "30"] if words[0] == "node" else []
    if words[0] == "testnet":
        extra = ["--out", str(tmp_path)]
    done = _swarmpipe(*words, *extra)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr
    if words[0] == "testnet":
        assert not any(tmp_path.iterdir()), "the testnet started something"


def test_a_misspelt_device_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """The answer comes at once (importing torch takes a CPU-second and more)."""
    code = (
        "import sys\n"
        "from swarmpipe.cli import main\n"
        "codes = [main(['node', '--coordinator', '127.0.0.1:9', '--device', 'gpu']),\n"
        "         main(['testnet', '--device', 'gpu', '--out', sys.argv[1]])]\n"
        "sys.exit(0 if codes == [2, 2] and 'torch' not in sys.modules else f'{codes}')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("--device 'gpu' is not a device") == 2, done.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_on_a_machine_without_cuda_exits_2_before_joining() -> None:
    done = _swarmpipe("node", "--coordinator", "127.0.0.1:9", "--device", "cuda")
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "--device cuda: this machine has no CUDA GPU" in done.stderr


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("cpu", "cpu"),
        pytest.param("cuda", "cpu", marks=CUDA),
        pytest.param("cpu", "cuda", marks=CUDA),
        pytest.param("cuda", "cuda", marks=CUDA),
    ],
)
def test_state_moves_between_stages_on_any_devices_bit_for_bit(source: str, target: str) -> None:
    from swarmpipe.node.stage_runtime import StageRuntime
    from swarmpipe.node.stage_state import StateReceiver
    from swarmpipe.storage.checkpoints import state_messages

    config = load_config(None, ["model.d_model=32", "model.n_heads=2", "model.context=16"])
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    sender = StageRuntime(config, 1, source)
    out = sender.forward("k", "mb", x)
    sender.backward("k", torch.ones_like(out))
    sender.apply_step(0)  # AdamW state exists now
    receiver_runtime = StageRuntime(config, 1, target)
    snapshot = sender.export_state(node_id="a").seal()
    receiver = StateReceiver(
        receiver_runtime.module, run_id=config.run_id, stage=1, num_stages=config.pipeline.stages
    )
    for message in state_messages(snapshot.manifest, snapshot.chunks()):
        receiver.add(message)
    receiver_runtime.import_state(receiver.finish())
    assert receiver_runtime.parameter_digest() == sender.parameter_digest()
    assert receiver_runtime.step == 1
    params = zip(sender.module.parameters(), receiver_runtime.module.parameters(), strict=True)
    for p, q in params:
        assert q.device.type == target
        mine, theirs = sender.optimizer.state[p], receiver_runtime.optimizer.state[q]
        assert theirs["exp_avg"].device == q.device and theirs["step"].device.type == "cpu"
        assert torch.equal(mine["exp_avg_sq"].cpu(), theirs["exp_avg_sq"].cpu())
    # And it trains where it now lives.
    out = receiver_runtime.forward("k", "mb2", x)
    receiver_runtime.backward("k", torch.ones_like(out))
    receiver_runtime.apply_step(1)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason=NO_CUDA)
def test_a_run_that_asks_for_cuda_sends_a_node_without_one_away_with_exit_2(
    procs: Procs,
) -> None:
    # The run's own train.device is known only from JoinReply; the node then leaves with
    # the same one line a bad --device gets, before it builds its stage.
    target = procs.coordinator("train.device=cuda", "pipeline.stages=1")
    popen, _ = procs.start(
        "n0",
        "node",
        "--coordinator",
        target,
        "--node-id",
        "n0",
        "--listen",
        "127.0.0.1:0",
        ready=False,
    )
    assert popen.wait(timeout=120) == 2
    log = (procs.tmp / "n0.log").read_text()
    assert "configuration error: train.device cuda: this machine has no CUDA GPU" in log
    assert "Traceback" not in log
