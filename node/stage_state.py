"""A stage's full training state as bytes: parameters, AdamW state and the step number.

`take_snapshot` runs on the compute thread, between two jobs, so it sees a
step boundary (parameters change only inside `apply_step`, one job); it only
clones tensors, and `StateSnapshot.encode` turns the clones into the stream
elsewhere. The payload is deterministic: tensors in parameter order, each
parameter followed by its AdamW tensors in a fixed key order, raw
little-endian bytes. Equal states give equal bytes and an equal sha256.

`StateReceiver` takes a stream from anyone (a peer, a checkpoint) and checks
the manifest against the locally built stage (run, stage, every name, dtype
and shape) before allocating the one buffer the payload goes into, so a hostile
or mismatched sender is refused before it costs memory. `load_into` then
copies the state into the runtime on the compute thread.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swarmpipe.compression.codec import DTYPES, dtype_enum
from swarmpipe.errors import PeerError
from swarmpipe.model.adamw import AdamW
from swarmpipe.protos import state_pb2
from swarmpipe.storage.checkpoints import CHUNK_BYTES, StateStream, start_digest, tensor_bytes

if sys.byteorder != "little":  # the payload is raw little-endian bytes
    raise ImportError("swarmpipe's state transfer needs a little-endian machine")

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")
"""AdamW's per-parameter state (amsgrad is off), in stream order."""


@dataclass(frozen=True, slots=True)
class _Spec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _param_specs(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(module.named_parameters())


def expected_specs(module: torch.nn.Module) -> dict[str, _Spec]:
    """Every tensor a state of this stage may hold, by stream name."""
    specs: dict[str, _Spec] = {}
    for name, p in _param_specs(module):
        shape = tuple(p.shape)
        specs[f"param:{name}"] = _Spec(f"param:{name}", p.dtype, shape)
        specs[f"step:{name}"] = _Spec(f"step:{name}", torch.float32, ())
        for key in ADAM_KEYS[1:]:
            specs[f"{key}:{name}"] = _Spec(f"{key}:{name}", p.dtype, shape)
    return specs


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """One stage's state at one step boundary: its manifest and a copy of its payload."""

    manifest: state_pb2.StateManifest
    payload: torch.Tensor
    """uint8, every tensor's bytes back to back in manifest order (one copy, one allocation)."""

    @property
    def step(self) -> int:
        return int(self.manifest.step)

    def seal(self) -> StateSnapshot:
        """Compute the sha256 into the manifest (off the compute thread: it reads every byte)."""
        if not self.manifest.sha256:
            h = start_digest(self.manifest)
            h.update(self.payload.numpy().data)
            self.manifest.sha256 = h.digest()
        return self

    def chunks(self) -> Iterator[bytes]:
        """The payload in chunks of at most CHUNK_BYTES."""
        view = self.payload.numpy().data
        for start in range(0, len(view), CHUNK_BYTES):
            yield bytes(view[start : start + CHUNK_BYTES])


def take_snapshot(
    module: torch.nn.Module,
    optimizer: AdamW,
    *,
    step: int,
    run_id: str,
    stage: int,
    num_stages: int,
    node_id: str,
    run_config: str,
) -> StateSnapshot:
    """Copy the stage's state (run on the compute thread); `seal` it before sending.

    `run_config` is the run's RunConfig as JSON: it travels in the manifest so that a
    checkpoint file alone says which model and data its tensors belong to.
    """
    entries: list[state_pb2.StateTensor] = []
    tensors: list[torch.Tensor] = []

    def add(name: str, t: torch.Tensor) -> None:
        # Host bytes whatever device the stage trains on: the stream and the checkpoint file
        # are the same for a GPU node and a CPU node, so either can load the other's.
        t = t.detach().contiguous().cpu()
        entries.append(state_pb2.StateTensor(name=name, dtype=dtype_enum(t.dtype), shape=t.shape))
        tensors.append(t.reshape(-1).view(torch.uint8))

    for name, p in _param_specs(module):
        add(f"param:{name}", p)
        state = optimizer.state.get(p)
        if state:
            for key in ADAM_KEYS:
                value = state[key]
                add(f"{key}:{name}", value if torch.is_tensor(value) else torch.tensor(value))
    manifest = state_pb2.StateManifest(
        run_id=run_id,
        stage=stage,
        num_stages=num_stages,
        step=step,
        tensors=entries,
        payload_bytes=sum(tensor_bytes(e) for e in entries),
        node_id=node_id,
        run_config=run_config,
    )
    payload = torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.uint8)
    return StateSnapshot(manifest, payload)


class StateReceiver:
    """Receives a state stream for the locally built stage and checks it against that stage."""

    def __init__(
        self, module: torch.nn.Module, *, run_id: str, stage: int, num_stages: int
    ) -> None:
        self._specs = expected_specs(module)
        self._params = [name for name, _ in _param_specs(module)]
        self._run_id = run_id
        self._stage = stage
        self._num_stages = num_stages
        self._buffer = bytearray()
        self._stream = StateStream(
            max_bytes=sum(self._bytes(s) for s in self._specs.values()),
            check=self._check,
            open_sink=self._open,
        )

    @staticmethod
    def _bytes(spec: _Spec) -> int:
        n = 1
        for d in spec.shape:
            n *= d
        return n * spec.dtype.itemsize

    def _check(self, manifest: state_pb2.StateManifest) -> None:
        if manifest.run_id != self._run_id:
            raise PeerError(f"the state is of run {manifest.run_id!r}, not {self._run_id!r}")
        if manifest.stage != self._stage or manifest.num_stages != self._num_stages:
            raise PeerError(
                f"the state is of stage {manifest.stage} of {manifest.num_stages}, not "
                f"{self._stage} of {self._num_stages}"
            )
        seen = set()
        for t in manifest.tensors:
            spec = self._specs.get(t.name)
            if spec is None:
                raise PeerError(f"the state has a tensor {t.name!r} this stage does not have")
            dtype = DTYPES.get(t.dtype)
            if dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise PeerError(
                    f"state tensor {t.name!r} is {dtype} {list(t.shape)}; this stage has "
                    f"{spec.dtype} {list(spec.shape)}"
                )
            seen.add(t.name)
        for name in self._params:
            if f"param:{name}" not in seen:
                raise PeerError(f"the state lacks parameter {name!r}")
            present = [f"{key}:{name}" in seen for key in ADAM_KEYS]
            if any(present) and not all(present):
                raise PeerError(f"the state has part of the optimizer state of {name!r}")
        order = [t.name for t in manifest.tensors]
        if order != [name for name in self._stream_order() if name in seen]:
            raise PeerError("the state's tensors are not in parameter order")

    def _stream_order(self) -> Iterator[str]:
        for name in self._params:
            yield f"param:{name}"
            for key in ADAM_KEYS:
                yield f"{key}:{name}"

    def _open(self, manifest: state_pb2.StateManifest) -> _BufferSink:
        # Allocated only now, at the size just checked against this stage's own tensors.
        self._buffer = bytearray(manifest.payload_bytes)
        return _BufferSink(self._buffer)

    def add(self, message: state_pb2.StateMessage) -> None:
        self._stream.add(message)

    def finish(self) -> ReceivedState:
        manifest = self._stream.finish()
        return ReceivedState(manifest, self._buffer)


class _BufferSink:
    """Writes consecutive chunks into a preallocated buffer (StateStream bounds the total)."""

    def __init__(self, buffer: bytearray) -> None:
        self._view = memoryview(buffer)
        self._offset = 0

    def write(self, data: bytes) -> int:
        self._view[self._offset : self._offset + len(data)] = data
        self._offset += len(data)
        return len(data)


@dataclass(frozen=True, slots=True)
class ReceivedState:
    """A checked state, ready to load into the stage it was checked against."""

    manifest: state_pb2.StateManifest
    payload: bytearray

    @property
    def step(self) -> int:
        return int(self.manifest.step)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.manifest.sha256).hexdigest()[:16]

    def load_into(self, module: torch.nn.Module, optimizer: AdamW) -> None:
        """Copy parameters and AdamW state into the stage (run on the compute thread)."""
        params = dict(_param_specs(module))
        offset = 0
        adam: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for t in self.manifest.tensors:
                dtype = DTYPES[t.dtype]
                n = tensor_bytes(t)
                if n:
                    flat = torch.frombuffer(self.payload, dtype=torch.uint8, count=n, offset=offset)
                    value = flat.view(dtype).reshape(tuple(t.shape))
                else:
                    value = torch.empty(tuple(t.shape), dtype=dtype)
                offset += n
                key, _, name = t.name.partition(":")
                if key == "param":
                    params[name].copy_(value)  # onto the parameter's device
                elif key == "step":
                    # AdamW keeps its step count on the host unless it runs capturable/fused.
                    adam.setdefault(name, {})[key] = value.clone()
                else:
                    adam.setdefault(name, {})[key] = value.to(params[name].device, copy=True)
        optimizer.state.clear()
        for name, state in adam.items():
            optimizer.state[params[name]] = state
