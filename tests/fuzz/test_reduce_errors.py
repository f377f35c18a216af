"""A Reduce call's refusals stay one short line, whatever the header carries."""

from __future__ import annotations

import pytest

from swarmpipe.bench.decoder_targets import TARGETS, join_records
from swarmpipe.errors import PeerError
from swarmpipe.protos import stage_pb2, tensor_pb2


@pytest.mark.slow  # builds a stage and a replica's context: a few seconds on a busy machine
def test_a_reduce_tensor_with_sixty_thousand_dimensions_makes_a_short_error() -> None:
    # The refusal once listed every dimension: a header of a million (under the 8 MiB message
    # limit) made megabytes of message for the log and the call's status.
    header = stage_pb2.ReduceHeader(step=0, sender_node="n-peer")
    tensor = tensor_pb2.TensorHeader(codec=tensor_pb2.CODEC_LOSSLESS, shape=[1] * 60_000)
    data = join_records(
        [
            b"\0",
            stage_pb2.ReduceMessage(header=header).SerializeToString(),
            stage_pb2.ReduceMessage(tensor=tensor).SerializeToString(),
        ]
    )
    with pytest.raises(PeerError, match="is not of shape") as error:
        TARGETS["reduce-request"].make()(data)
    assert len(str(error.value)) < 1000


@pytest.mark.slow  # builds a stage and a replica's context: a few seconds on a busy machine
@pytest.mark.parametrize("shape", [[7], [0], [2, 10]])
def test_a_reduce_tensor_of_another_parameter_count_is_refused(shape: list[int]) -> None:
    # The stage's parameter count is the only shape a Reduce may carry (one flat gradient).
    header = stage_pb2.ReduceHeader(step=0, sender_node="n-peer")
    tensor = tensor_pb2.TensorHeader(codec=tensor_pb2.CODEC_LOSSLESS, shape=shape)
    data = join_records(
        [
            b"\0",
            stage_pb2.ReduceMessage(header=header).SerializeToString(),
            stage_pb2.ReduceMessage(tensor=tensor).SerializeToString(),
        ]
    )
    with pytest.raises(PeerError, match=r"is not of shape \[\d+\]"):
        TARGETS["reduce-request"].make()(data)
