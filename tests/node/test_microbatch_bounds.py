"""A microbatch is refused from its headers, before its payload is buffered, when it does not
fit the run: more samples than train.microbatch, another stage or context, or an activation
that is not [B, T, D] (or [B, T, k] after a bottleneck boundary)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from swarmpipe.compression.wire import encode_tensor
from swarmpipe.config import load_config
from swarmpipe.errors import PeerError
from swarmpipe.node.server import microbatch_check, read_forward_request
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.protos import stage_pb2, tensor_pb2

TINY = [
    "model.n_layers=2",
    "model.d_model=16",
    "model.n_heads=2",
    "model.context=8",
    "pipeline.stages=2",
    "train.microbatch=4",
    "train.global_batch=8",
]


@pytest.fixture(scope="module")
def runtime() -> StageRuntime:
    return StageRuntime(load_config(None, TINY), 1)


def _header(**changes: Any) -> stage_pb2.MicrobatchHeader:
    fields = {"hop": 1, "sample_count": 4, "context": 8} | changes
    return stage_pb2.MicrobatchHeader(**fields)


def _tensor(*shape: int) -> tensor_pb2.TensorHeader:
    return tensor_pb2.TensorHeader(codec=tensor_pb2.CODEC_LOSSLESS, shape=list(shape))


def test_a_microbatch_of_the_run_passes(runtime: StageRuntime) -> None:
    check = microbatch_check(runtime)
    check(_header(), _tensor(4, 8, 16))
    check(_header(sample_count=1), _tensor(1, 8, 16))  # a short last lease


@pytest.mark.parametrize(
    ("header", "tensor", "needle"),
    [
        (_header(sample_count=5), _tensor(5, 8, 16), r"sample_count 5 is out of range: .* 1 to 4"),
        (_header(sample_count=0), _tensor(0, 8, 16), "sample_count 0 is out of range"),
        (_header(hop=0), _tensor(4, 8, 16), "for stage 0; this node serves 1"),
        (_header(context=9), _tensor(4, 9, 16), "context 9 differs"),
        (_header(), _tensor(4, 8, 17), r"shape \[4, 8, 17\] is not the expected \[4, 8, 16\]"),
        (_header(), _tensor(3, 8, 16), "is not the expected"),
        (_header(), _tensor(4, 8), "is not the expected"),
        (_header(), _tensor(*[1] * 60_000), r"\[1, 1, 1, 1, 1, 1, 1, 1, \.\.\.\]"),
    ],
)
def test_a_microbatch_that_does_not_fit_the_run_is_refused(
    runtime: StageRuntime,
    header: stage_pb2.MicrobatchHeader,
    tensor: tensor_pb2.TensorHeader,
    needle: str,
) -> None:
    with pytest.raises(PeerError, match=needle) as error:
        microbatch_check(runtime)(header, tensor)
    assert len(str(error.value)) < 300


async def test_the_check_runs_before_any_chunk_is_read(runtime: StageRuntime) -> None:
    # An oversized microbatch whose payload never arrives: the refusal comes first.
    tensor, payload = encode_tensor(torch.zeros(8, 8, 16), "lossless")
    taken = []

    async def messages() -> AsyncIterator[stage_pb2.ForwardMessage]:
        for message in (
            stage_pb2.ForwardMessage(microbatch=_header(sample_count=8)),
            stage_pb2.ForwardMessage(tensor=tensor),
            stage_pb2.ForwardMessage(chunk=tensor_pb2.TensorChunk(data=payload)),
        ):
            taken.append(message.WhichOneof("kind"))
            yield message

    with pytest.raises(PeerError, match="sample_count 8 is out of range"):
        await read_forward_request(messages(), check=microbatch_check(runtime))
    assert taken == ["microbatch", "tensor"]


def test_a_stage_after_a_bottleneck_wants_k_wide_headers() -> None:
    runtime = StageRuntime(load_config(None, [*TINY, "model.bottleneck=4"]), 1)
    microbatch_check(runtime)(_header(), _tensor(4, 8, 4))
    with pytest.raises(PeerError, match=r"not the expected \[4, 8, 4\]"):
        microbatch_check(runtime)(_header(), _tensor(4, 8, 16))


def test_stage_zero_takes_no_activations() -> None:
    runtime = StageRuntime(load_config(None, TINY), 0)
    with pytest.raises(PeerError, match="stage 0 takes token ids"):
        runtime.check_activation_header([4, 8, 16], 4)
