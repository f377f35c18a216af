"""The int4 codec's packing: nibble order, odd counts, non-finite blocks, random bytes."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.compression import decode_tensor, encode_tensor, get_codec

pytestmark = pytest.mark.filterwarnings("error")


def test_int4_payload_is_scales_then_nibbles_low_first() -> None:
    x = torch.tensor([0.0, 0.0, 14.0, -7.0, 1.0])  # blocks of 2: [0, 0], [14, -7], [1]
    header, payload = encode_tensor(x, "int4", block_size=2)
    scales = torch.frombuffer(bytearray(payload[:12]), dtype=torch.float32)
    assert torch.equal(scales, torch.tensor([0.0, 2.0, 1.0 / 7]))
    # codes 0, 0 | 7, -4 (-3.5 rounds half to even) | 7, then the odd count's 0 nibble
    assert list(payload[12:]) == [0x00, 0xC7, 0x07]
    assert header.payload_bytes == 3 * 4 + 3
    assert decode_tensor(header, payload).tolist()[:4] == [0.0, 0.0, 14.0, -8.0]


@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 257])
def test_int4_packs_two_codes_per_byte(n: int) -> None:
    x = torch.linspace(-7, 7, n)
    header, payload = encode_tensor(x, "int4", block_size=n)
    assert len(payload) == 4 + (n + 1) // 2
    # absmax 7 makes the step 1, so integers survive exactly, odd tail included.
    assert torch.equal(decode_tensor(header, payload), x.round())


def test_int4_non_finite_block_decodes_to_nan_and_spares_the_others() -> None:
    x = torch.ones(5 * 8)
    x[1] = float("nan")
    x[9] = float("inf")
    x[17] = -float("inf")
    x[25:27] = torch.tensor([float("inf"), float("nan")])
    header, payload = encode_tensor(x, "int4", block_size=8)
    y = decode_tensor(header, payload)
    assert bool(y[:32].isnan().all())
    assert torch.equal(y[32:], x[32:])


def test_int4_decodes_every_nibble() -> None:
    # -8 (0x8) never comes from the encoder, but a byte holding it must still decode.
    codec = get_codec("int4")
    header, _ = encode_tensor(torch.zeros(512), "int4", block_size=512)
    payload = torch.tensor([1.0]).numpy().tobytes() + bytes(range(256))
    y = codec.decode(header, payload)
    low = [(b & 0xF) - 16 * (b >> 3 & 1) for b in range(256)]
    high = [(b >> 4) - 16 * (b >> 7) for b in range(256)]
    assert y[0::2].tolist() == low
    assert y[1::2].tolist() == high
