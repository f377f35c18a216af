"""State manifests a hostile peer could send: refused as PeerError at a bounded cost."""

from __future__ import annotations

import pytest

from swarmpipe.errors import PeerError
from swarmpipe.protos import state_pb2, tensor_pb2
from swarmpipe.storage.checkpoints import MAX_DIMS, check_manifest


def _manifest(shape: list[int], name: str = "param:w") -> state_pb2.StateManifest:
    manifest = state_pb2.StateManifest(payload_bytes=16, sha256=b"\0" * 32)
    manifest.tensors.add(name=name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=shape)
    return manifest


@pytest.mark.parametrize("dims", [MAX_DIMS + 1, 300, 100_000])
def test_a_tensor_with_too_many_dimensions_is_refused_before_it_is_sized(dims: int) -> None:
    # Found by the decoder fuzz: sizing 300 dimensions of 2**62 made a number too long to
    # format into the error (ValueError, so UNKNOWN and a traceback on PutCheckpoint), and
    # 100,000 of them took 88 s of CPU to multiply.
    with pytest.raises(PeerError, match=f"{dims} dimensions, more than {MAX_DIMS}"):
        check_manifest(_manifest([1 << 62] * dims), max_bytes=1 << 30)


def test_the_largest_shape_allowed_still_makes_a_short_error() -> None:
    with pytest.raises(PeerError) as error:
        check_manifest(_manifest([(1 << 63) - 1] * MAX_DIMS), max_bytes=1 << 30)
    assert len(str(error.value)) < 2000


def test_a_megabyte_tensor_name_is_shortened_in_the_error() -> None:
    manifest = _manifest([4], name="x" * (1 << 20))
    manifest.tensors.add(name="x" * (1 << 20), dtype=tensor_pb2.DTYPE_FLOAT32, shape=[0])
    with pytest.raises(PeerError, match="appears twice") as error:
        check_manifest(manifest, max_bytes=1 << 30)
    assert len(str(error.value)) < 300
