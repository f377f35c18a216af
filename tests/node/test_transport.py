"""The node's encode step: codec parameters from the run's config, rounding per tensor role."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmpipe.compression import decode_tensor
from swarmpipe.config import load_config
from swarmpipe.node.transport import EncodeOptions, encode
from swarmpipe.protos import tensor_pb2

INT8 = tensor_pb2.CODEC_BLOCKWISE_INT8


def _mean_of_encodings(options: EncodeOptions, role: str, codec: int, times: int) -> torch.Tensor:
    # One block whose absmax (1.0) makes the code step 1/127; every other element is 0.3
    # of a step, so rounding to nearest sends 0 and is off by 0.3 step every time.
    tensor = torch.full((256,), 0.3 / 127)
    tensor[0] = 1.0

    async def run() -> torch.Tensor:
        total = torch.zeros_like(tensor)
        for _ in range(times):
            encoded = await encode(tensor, codec, options, role=role)
            total += decode_tensor(encoded.header, b"".join(encoded.chunks))
        return total / times

    return asyncio.run(run())[1:] - tensor[1:]


def test_roles_named_in_the_config_round_stochastically_and_without_bias() -> None:
    config = load_config(None, ['pipeline.stochastic_rounding=["gradient"]'])
    options = EncodeOptions.from_pipeline(config.pipeline)
    step = 1 / 127
    biased = _mean_of_encodings(options, "activation", INT8, 50)
    assert biased.abs().min() == pytest.approx(0.3 * step, rel=1e-3)
    unbiased = _mean_of_encodings(options, "gradient", INT8, 400)
    # 400 encodings of a coin flip at p = 0.3: the mean's error shrinks to ~0.02 step.
    assert unbiased.abs().mean() < 0.05 * step < biased.abs().mean()


def test_codecs_that_do_not_quantise_ignore_the_setting() -> None:
    options = EncodeOptions(stochastic_rounding=("activation", "gradient", "reduce"))
    for codec in (tensor_pb2.CODEC_LOSSLESS, tensor_pb2.CODEC_FP16):
        assert not options.rounding(codec, "gradient", torch.device("cpu")).stochastic
    assert options.rounding(INT8, "reduce", torch.device("cpu")).stochastic
    assert EncodeOptions().rounding(INT8, "gradient", torch.device("cpu")).stochastic
    nearest = EncodeOptions.from_pipeline(
        load_config(None, ["pipeline.stochastic_rounding=[]"]).pipeline
    )
    assert not nearest.rounding(INT8, "activation", torch.device("cpu")).stochastic


def test_stochastic_rounding_leaves_the_default_generator_alone() -> None:
    options = EncodeOptions(stochastic_rounding=("gradient",))
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    _mean_of_encodings(options, "gradient", INT8, 3)
    assert torch.equal(torch.rand(3), expected)


def test_roles_named_in_the_config_send_centered_blocks() -> None:
    config = load_config(None, ['pipeline.int8_centered=["activation"]'])
    options = EncodeOptions.from_pipeline(config.pipeline)
    assert options.centered_blocks == ("activation",)
    tensor = torch.randn(64, 8, generator=torch.Generator().manual_seed(3)) + 40.0

    async def send(role: str) -> tuple[bool, float]:
        encoded = await encode(tensor, INT8, options, role=role)
        decoded = decode_tensor(encoded.header, b"".join(encoded.chunks))
        return encoded.header.centered, float((decoded - tensor).abs().max())

    centred, centred_error = asyncio.run(send("activation"))
    plain, plain_error = asyncio.run(send("gradient"))
    assert centred and not plain
    assert centred_error < plain_error / 4
    assert not load_config().pipeline.int8_centered  # off unless a run asks for it


def test_roles_named_in_the_config_pass_through_zstd_and_decode_exactly() -> None:
    config = load_config(None, ['pipeline.zstd=["activation"]', "pipeline.stochastic_rounding=[]"])
    options = EncodeOptions.from_pipeline(config.pipeline)
    assert options.zstd == ("activation",)
    # A quarter of the entries are zero: int4 codes with room for an entropy stage.
    tensor = torch.randn(512, 8, generator=torch.Generator().manual_seed(5))
    tensor[::4] = 0.0
    INT4 = tensor_pb2.CODEC_BLOCKWISE_INT4

    async def send(role: str) -> tuple[tensor_pb2.TensorHeader, torch.Tensor]:
        encoded = await encode(tensor, INT4, options, role=role)
        return encoded.header, decode_tensor(encoded.header, b"".join(encoded.chunks))

    zstd, zstd_decoded = asyncio.run(send("activation"))
    plain, plain_decoded = asyncio.run(send("gradient"))
    assert zstd.entropy == tensor_pb2.ENTROPY_ZSTD and plain.entropy == tensor_pb2.ENTROPY_NONE
    assert zstd.payload_bytes < plain.payload_bytes
    assert torch.equal(zstd_decoded, plain_decoded)  # lossless: the same codes, fewer bytes
    assert not load_config().pipeline.zstd  # off unless a run asks for it


def test_activation_code_max_narrows_activations_only() -> None:
    config = load_config(
        None, ['pipeline.zstd=["activation", "gradient"]', "pipeline.activation_code_max=11"]
    )
    options = EncodeOptions.from_pipeline(config.pipeline)
    tensor = torch.randn(1024, 8, generator=torch.Generator().manual_seed(6))

    async def send(role: str) -> tensor_pb2.TensorHeader:
        return (await encode(tensor, INT8, options, role=role)).header

    activation, gradient = asyncio.run(send("activation")), asyncio.run(send("gradient"))
    assert (activation.code_max, gradient.code_max) == (11, 0)
    assert activation.payload_bytes < 0.65 * gradient.payload_bytes
