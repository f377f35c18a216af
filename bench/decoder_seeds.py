"""Valid inputs of each decoder fuzz target (`decoder_targets.py`): the seed corpus.

`scripts/gen_fuzz_corpus.py` writes them under tests/fuzz/corpus/<target>/; the fuzz harness
also runs each once before fuzzing, and each decodes without an error. They are built from
the project's own encoders (encode_tensor, a stage's exported state, a Forward's messages as a
node sends them), so a wire format change shows up as seeds that no longer decode.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from swarmpipe.bench.decoder_targets import (
    FIX_SIZES,
    HARNESS_CHECKS,
    join_records,
    read_message_types,
)
from swarmpipe.bench.stage_targets import tiny_runtime


def _tensors() -> Iterator[tuple[Any, dict[str, Any]]]:
    """Small tensors and encode_tensor options covering every codec's header fields."""
    import torch

    from swarmpipe.compression.registry import CODECS_BY_NAME

    gen = torch.Generator().manual_seed(22)
    x = torch.randn(4, 24, generator=gen)
    x[1, 3] = 40.0  # an outlier channel
    for name, codec in CODECS_BY_NAME.items():
        yield x, {"codec": name}
        yield x.half() if torch.float16 in codec.dtypes else x, {"codec": name, "entropy": "zstd"}
        if codec.blockwise:
            yield x, {"codec": name, "block_size": 16, "channel_blocks": True}
            yield x + 3, {"codec": name, "block_size": 32, "centered": True, "code_max": 3}
        if name == "lossless":
            yield torch.arange(12, dtype=torch.int64).reshape(3, 4), {"codec": name}
            yield torch.zeros(0, 5), {"codec": name}
        if name == "topk":
            yield x, {"codec": name, "topk_fraction": 0.2}
        if name == "lowrank":
            yield x, {"codec": name, "rank": 2}


def _encoded() -> Iterator[tuple[Any, bytes]]:
    from swarmpipe.compression.wire import encode_tensor

    for tensor, options in _tensors():
        yield encode_tensor(tensor, **options)


def _chunks(payload: bytes, size: int = 64) -> list[bytes]:
    return [payload[i : i + size] for i in range(0, len(payload), size)]


def _state_seed(messages: Iterator[Any], flags: int, chunk: int = 4096) -> bytes:
    from swarmpipe.protos import state_pb2, tensor_pb2

    records = [bytes([flags])]
    for message in messages:
        if message.WhichOneof("kind") == "chunk":
            for piece in _chunks(message.chunk.data, chunk):
                one = state_pb2.StateMessage(chunk=tensor_pb2.TensorChunk(data=piece))
                records.append(one.SerializeToString())
        else:
            records.append(message.SerializeToString())
    return join_records(records)


def _state_seeds() -> list[bytes]:
    from swarmpipe.storage.checkpoints import state_messages

    snapshot = tiny_runtime(1).export_state(node_id="seed").seal()
    return [
        _state_seed(state_messages(snapshot.manifest, snapshot.chunks()), flags)
        for flags in (0, FIX_SIZES)
    ]


def seed_inputs(name: str) -> list[bytes]:
    """Valid inputs of target `name`, each decoded without an error."""
    from swarmpipe.protos import tensor_pb2

    if name == "tensor-wire":
        return [
            join_records([bytes([flags]), h.SerializeToString(), *_chunks(p)])
            for h, p in _encoded()
            for flags in (0, FIX_SIZES)
        ]
    if name == "codec" or name.startswith("codec:"):
        from swarmpipe.compression.registry import CODECS

        codecs = sorted(CODECS)
        pinned = name.partition(":")[2]
        return [
            join_records([bytes([codecs.index(h.codec)]), h.SerializeToString(), p])
            for h, p in _encoded()
            if h.entropy == tensor_pb2.ENTROPY_NONE and pinned in ("", CODECS[h.codec].name)
        ]
    if name in ("state-stream", "checkpoint-stream"):
        return _state_seeds()
    if name == "checkpoint-file":
        return [_checkpoint_file_seed()]
    if name == "forward-request":
        return _forward_seeds()
    if name == "reduce-request":
        return _reduce_seeds()
    if name == "control-messages":
        return _control_seeds()
    if name in HARNESS_CHECKS:
        return [b"\x00"]
    raise ValueError(f"no fuzz target {name!r}")


def _checkpoint_file_seed() -> bytes:
    import tempfile

    from swarmpipe.storage.checkpoints import CheckpointStore, state_messages

    snapshot = tiny_runtime(1).export_state(node_id="seed").seal()
    with tempfile.TemporaryDirectory() as folder:
        store = CheckpointStore(folder, tiny_runtime(1).config.run_id)
        writer = store.receive(1)
        for message in state_messages(snapshot.manifest, snapshot.chunks()):
            writer.add(message)
        return writer.commit().read_bytes()


def _forward_seeds() -> list[bytes]:
    import torch

    from swarmpipe.compression.wire import encode_tensor
    from swarmpipe.node.token_ids import encode_token_ids
    from swarmpipe.protos import stage_pb2, tensor_pb2

    config = tiny_runtime(1).config
    gen = torch.Generator().manual_seed(5)
    seeds = []
    for codec, samples in (("lossless", 2), ("int8", 1), ("bf16", 3)):
        labels = torch.randint(0, 256, (samples, config.model.context), generator=gen)
        header = stage_pb2.MicrobatchHeader(
            microbatch_id=f"mb-{codec}",
            hop=1,
            sample_count=samples,
            context=config.model.context,
            labels=encode_token_ids(labels, config.model.vocab),
        )
        x = torch.randn(samples, config.model.context, config.model.d_model, generator=gen)
        tensor, payload = encode_tensor(x, codec)
        messages = [
            stage_pb2.ForwardMessage(microbatch=header),
            stage_pb2.ForwardMessage(tensor=tensor),
            *(
                stage_pb2.ForwardMessage(chunk=tensor_pb2.TensorChunk(data=c))
                for c in _chunks(payload, 512)
            ),
        ]
        for flags in (0, FIX_SIZES):
            seeds.append(join_records([bytes([flags]), *(m.SerializeToString() for m in messages)]))
    return seeds


def _control_seeds() -> list[bytes]:

    from swarmpipe.bench.fuzz_inputs import fill
    from swarmpipe.control.link_control import encode

    types = read_message_types()
    rng = random.Random(22)
    seeds = [
        join_records([bytes([i]), fill(t(), rng).SerializeToString()]) for i, t in enumerate(types)
    ]
    seeds.append(join_records([bytes([len(types)]), encode(2e6)]))
    seeds.append(join_records([bytes([len(types)]), encode(None)]))
    return seeds


def _reduce_seeds() -> list[bytes]:
    import torch

    from swarmpipe.compression.wire import encode_tensor
    from swarmpipe.protos import stage_pb2, tensor_pb2

    runtime = tiny_runtime(1)
    gradient = torch.randn(runtime.n_parameters, generator=torch.Generator().manual_seed(3))
    seeds = []
    for codec in ("lossless", "int8", "topk"):
        tensor, payload = encode_tensor(gradient, codec)
        header = stage_pb2.ReduceHeader(step=0, sender_node="n-peer", tokens=64, samples=8)
        messages = [
            stage_pb2.ReduceMessage(header=header),
            stage_pb2.ReduceMessage(tensor=tensor),
            *(
                stage_pb2.ReduceMessage(chunk=tensor_pb2.TensorChunk(data=c))
                for c in _chunks(payload, 4096)
            ),
        ]
        for flags in (0, FIX_SIZES):
            seeds.append(join_records([bytes([flags]), *(m.SerializeToString() for m in messages)]))
    manifest = stage_pb2.ReduceManifest(
        step=0, sender_node="n-peer", received=["n-peer"], digests=[bytes(32)]
    )
    seeds.append(
        join_records([b"\0", stage_pb2.ReduceMessage(manifest=manifest).SerializeToString()])
    )
    return seeds
