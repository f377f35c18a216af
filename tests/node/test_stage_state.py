"""A stage's state as a byte stream: exact round trips, and refusal of what does not fit."""

from __future__ import annotations

import gc
import hashlib
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swarmpipe.config import RunConfig, load_config
from swarmpipe.errors import PeerError
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.node.stage_state import StateReceiver, StateSnapshot
from swarmpipe.protos import state_pb2, tensor_pb2
from swarmpipe.storage.checkpoints import (
    MAX_RUN_CONFIG_BYTES,
    CheckpointStore,
    StateStream,
    state_messages,
    tensor_bytes,
)

TINY = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.context=32"]


def _config(*extra: str) -> RunConfig:
    return load_config(None, [*TINY, *extra])


def _trained(config: RunConfig, stage: int, steps: int, seed: int = 0) -> StageRuntime:
    """A middle stage after `steps` optimizer steps on random data."""
    runtime = StageRuntime(config, stage)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(2, 32, 32, generator=gen)
        out = runtime.forward("k", f"mb{step}", x)
        runtime.backward("k", torch.randn(out.shape, generator=gen))
        runtime.apply_step(step)
    return runtime


def _receiver(runtime: StageRuntime) -> StateReceiver:
    return StateReceiver(
        runtime.module,
        run_id=runtime.config.run_id,
        stage=runtime.stage,
        num_stages=runtime.num_stages,
    )


def _messages(snapshot: StateSnapshot) -> list[state_pb2.StateMessage]:
    return list(state_messages(snapshot.seal().manifest, snapshot.chunks()))


def _one_step(runtime: StageRuntime, step: int) -> None:
    gen = torch.Generator().manual_seed(99)
    out = runtime.forward("k", "next", torch.randn(2, 32, 32, generator=gen))
    runtime.backward("k", torch.randn(out.shape, generator=gen))
    runtime.apply_step(step)


def test_round_trip_restores_parameters_adam_state_and_step_exactly() -> None:
    config = _config()
    source = _trained(config, 1, 3)
    target = StageRuntime(config, 1)
    receiver = _receiver(target)
    for message in _messages(source.export_state(node_id="a")):
        receiver.add(message)
    target.import_state(receiver.finish())
    assert target.step == source.step == 3
    assert target.parameter_digest() == source.parameter_digest()
    for p, q in zip(source.module.parameters(), target.module.parameters(), strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(source.optimizer.state[p][key], target.optimizer.state[q][key])
    # The same update from here on: the optimizer state, not just the weights, was copied.
    _one_step(source, 3)
    _one_step(target, 3)
    assert target.parameter_digest() == source.parameter_digest()


def test_export_is_deterministic_and_the_digest_tracks_the_state() -> None:
    config = _config()
    a, b = _trained(config, 1, 2), _trained(config, 1, 2)
    sa, sb = a.export_state(node_id="x").seal(), b.export_state(node_id="x").seal()
    assert sa.manifest.sha256 == sb.manifest.sha256
    assert b"".join(sa.chunks()) == b"".join(sb.chunks())
    _one_step(b, 2)
    assert b.export_state(node_id="x").seal().manifest.sha256 != sa.manifest.sha256


def test_fresh_stage_has_no_optimizer_state_and_round_trips() -> None:
    config = _config()
    fresh = StageRuntime(config, 0)
    snapshot = fresh.export_state(node_id="a")
    assert all(t.name.startswith("param:") for t in snapshot.manifest.tensors)
    trained = _trained(config, 0, 0)
    receiver = _receiver(trained)
    for message in _messages(snapshot):
        receiver.add(message)
    trained.import_state(receiver.finish(), step=7)
    assert trained.step == 7 and not trained.optimizer.state


def _mangled(
    mangle: Callable[[list[state_pb2.StateMessage]], None],
) -> list[state_pb2.StateMessage]:
    messages = _messages(_trained(_config(), 1, 1).export_state(node_id="a"))
    mangle(messages)
    return messages


def _consistent(manifest: state_pb2.StateManifest) -> None:
    """Make a tampered manifest add up again, so the check against the stage must catch it."""
    manifest.payload_bytes = sum(tensor_bytes(t) for t in manifest.tensors)


def _set_shape(messages: list[state_pb2.StateMessage]) -> None:
    messages[0].manifest.tensors[0].shape[0] -= 1
    _consistent(messages[0].manifest)


def _rename(messages: list[state_pb2.StateMessage]) -> None:
    messages[0].manifest.tensors[0].name = "param:not.a.layer"


def _dtype(messages: list[state_pb2.StateMessage]) -> None:
    messages[0].manifest.tensors[0].dtype = tensor_pb2.DTYPE_FLOAT16
    _consistent(messages[0].manifest)


def _drop_adam(messages: list[state_pb2.StateMessage]) -> None:
    del messages[0].manifest.tensors[1]  # "step:" of the first parameter
    _consistent(messages[0].manifest)


def _huge(messages: list[state_pb2.StateMessage]) -> None:
    messages[0].manifest.payload_bytes = 1 << 40


def _flip(messages: list[state_pb2.StateMessage]) -> None:
    data = bytearray(messages[1].chunk.data)
    data[100] ^= 0xFF
    messages[1].chunk.data = bytes(data)


def _extra(messages: list[state_pb2.StateMessage]) -> None:
    messages.append(state_pb2.StateMessage(chunk=tensor_pb2.TensorChunk(data=b"\x00" * 8)))


def _truncate(messages: list[state_pb2.StateMessage]) -> None:
    messages.pop()


def _stage(messages: list[state_pb2.StateMessage]) -> None:
    messages[0].manifest.stage = 2


def _run(messages: list[state_pb2.StateMessage]) -> None:
    messages[0].manifest.run_id = "another-run"


def _two_manifests(messages: list[state_pb2.StateMessage]) -> None:
    messages.insert(1, messages[0])


def _bytes_first(messages: list[state_pb2.StateMessage]) -> None:
    messages.insert(0, messages.pop(1))


HOSTILE = {
    "a wrong shape": (_set_shape, "this stage has"),
    "an unknown tensor": (_rename, "does not have"),
    "a wrong dtype": (_dtype, "float16"),
    "half an optimizer state": (_drop_adam, "part of the optimizer state"),
    "a huge payload": (_huge, "over the limit"),
    "a flipped bit": (_flip, "sha256"),
    "bytes past the payload": (_extra, "runs past"),
    "a truncated stream": (_truncate, "ended after"),
    "another stage": (_stage, "stage 2"),
    "another run": (_run, "another-run"),
    "two manifests": (_two_manifests, "second manifest"),
    "bytes before the manifest": (_bytes_first, "before the manifest"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_or_mismatched_state_is_refused_and_changes_nothing(case: str) -> None:
    mangle, words = HOSTILE[case]
    messages = _mangled(mangle)
    target = StageRuntime(_config(), 1)
    before = target.parameter_digest()
    receiver = _receiver(target)
    with pytest.raises(PeerError) as err:
        for message in messages:
            receiver.add(message)
        target.import_state(receiver.finish())
    assert any(w.lower() in str(err.value).lower() for w in words.split("|")), err.value
    assert target.parameter_digest() == before and target.step == 0


def test_a_huge_claim_is_refused_before_any_allocation() -> None:
    """The payload buffer is sized from the checked manifest, never from the sender's claim."""
    opened: list[int] = []
    stream = StateStream(
        max_bytes=1 << 20,
        check=lambda m: None,
        open_sink=lambda m: opened.append(m.payload_bytes) or bytearray(),  # type: ignore[func-returns-value]
    )
    manifest = state_pb2.StateManifest(
        payload_bytes=1 << 40,
        sha256=hashlib.sha256().digest(),
        tensors=[state_pb2.StateTensor(name="x", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1 << 38])],
    )
    with pytest.raises(PeerError, match="over the limit"):
        stream.add(state_pb2.StateMessage(manifest=manifest))
    assert opened == []


def test_checkpoint_store_keeps_the_latest_and_round_trips(tmp_path: Path) -> None:
    config = _config()
    store = CheckpointStore(tmp_path, config.run_id, keep=2)
    runtime = _trained(config, 1, 1)
    digests = {}
    uploads = []
    for step in range(1, 4):
        snapshot = runtime.export_state(node_id="a").seal()
        digests[snapshot.step] = runtime.parameter_digest()
        writer = store.receive(1)
        uploads.append(list(state_messages(snapshot.manifest, snapshot.chunks())))
        for message in uploads[-1]:
            writer.add(message)
        writer.commit()
        _one_step(runtime, step)
    assert [step for step, _ in store.checkpoints(1)] == [2, 3]
    assert not list(store.stage_dir(1).glob(".incoming-*"))
    step, path = store.latest(1) or (0, Path())
    manifest, chunks = store.read(path)
    target = StageRuntime(config, 1)
    receiver = _receiver(target)
    for message in state_messages(manifest, chunks):
        receiver.add(message)
    target.import_state(receiver.finish())
    assert target.step == step == 3 and target.parameter_digest() == digests[3]
    # A late upload of a step older than every kept one would be deleted as it lands (the
    # fuzzer found the store answering with a path that was gone): refused, nothing changes.
    writer = store.receive(1)
    with pytest.raises(PeerError, match="step 1 is older than the 2 kept here"):
        for message in uploads[0]:
            writer.add(message)
        writer.commit()
    assert [step for step, _ in store.checkpoints(1)] == [2, 3]
    assert not list(store.stage_dir(1).glob(".incoming-*"))


def test_checkpoint_store_refuses_a_corrupt_upload_and_keeps_the_old_one(tmp_path: Path) -> None:
    config = _config()
    store = CheckpointStore(tmp_path, config.run_id)
    runtime = _trained(config, 1, 1)
    good = runtime.export_state(node_id="a").seal()
    writer = store.receive(1)
    for message in state_messages(good.manifest, good.chunks()):
        writer.add(message)
    writer.commit()
    messages = _mangled(_flip)
    messages[0].manifest.step = 5
    writer = store.receive(1)
    with pytest.raises(PeerError, match="sha256"):
        for message in messages:
            writer.add(message)
        writer.commit()
    assert [step for step, _ in store.checkpoints(1)] == [1]
    assert not list(store.stage_dir(1).glob(".incoming-*"))


def test_a_checkpoint_carries_the_run_config_under_its_digest(tmp_path: Path) -> None:
    config = _config("train.lr=0.001")
    snapshot = StageRuntime(config, 1).export_state(node_id="a").seal()
    assert RunConfig.from_json(snapshot.manifest.run_config) == config
    # The digest covers the config: a checkpoint whose config was edited no longer verifies.
    messages = _messages(snapshot)
    messages[0].manifest.run_config = _config("train.lr=0.002").to_json()
    receiver = _receiver(StageRuntime(config, 1))
    with pytest.raises(PeerError, match="sha256"):
        for message in messages:
            receiver.add(message)
        receiver.finish()


def test_a_state_without_a_run_config_still_loads() -> None:
    # States written before manifests carried the config hash the same bytes as before.
    config = _config()
    source = _trained(config, 1, 1)
    snapshot = source.export_state(node_id="a")
    snapshot.manifest.run_config = ""
    receiver = _receiver(StageRuntime(config, 1))
    for message in _messages(snapshot):
        receiver.add(message)
    target = StageRuntime(config, 1)
    target.import_state(receiver.finish())
    assert target.parameter_digest() == source.parameter_digest()


def test_an_oversized_run_config_is_refused_before_any_payload() -> None:
    messages = _messages(_trained(_config(), 1, 1).export_state(node_id="a"))
    messages[0].manifest.run_config = "x" * (MAX_RUN_CONFIG_BYTES + 1)
    receiver = _receiver(StageRuntime(_config(), 1))
    with pytest.raises(PeerError, match="run config takes"):
        receiver.add(messages[0])


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"SWP", "is not a swarmpipe checkpoint"),
        (b"SWPSTATE\x05", "ends inside its header"),
        (b"SWPSTATE" + (200).to_bytes(4, "little") + b"\x0a" * 40, "ends inside its manifest"),
        (b"SWPSTATE" + (4).to_bytes(4, "little") + b"\xff" * 4, "does not decode"),
    ],
)
def test_a_broken_checkpoint_file_is_a_peer_error(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    # One clear error whatever the damage (a node reading a shared folder logs it and moves on).
    path = tmp_path / "step-000000001.ckpt"
    path.write_bytes(content)
    with pytest.raises(PeerError, match=problem):
        CheckpointStore(tmp_path, "r").read(path)


@pytest.mark.parametrize("finish", ["close", "drop"])
def test_a_checkpoint_read_no_further_than_its_manifest_leaves_no_file_open(
    tmp_path: Path, finish: str
) -> None:
    # The chunk iterator was a generator: closed or dropped before its first chunk (a file
    # refused for its manifest), it never ran its `with`, and the file stayed open until the
    # collector warned about it from whatever test ran then.
    config = _config()
    store = CheckpointStore(tmp_path, config.run_id)
    snapshot = _trained(config, 1, 1).export_state(node_id="a").seal()
    writer = store.receive(1)
    for message in state_messages(snapshot.manifest, snapshot.chunks()):
        writer.add(message)
    path = writer.commit()
    manifest, chunks = store.read(path)
    opened = chunks._f
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if finish == "close":
            chunks.close()
        del chunks
        gc.collect()
    assert opened.closed
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    manifest, chunks = store.read(path)
    assert sum(len(c) for c in chunks) == manifest.payload_bytes
    assert chunks._f.closed
