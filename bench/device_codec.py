"""`swarmpipe bench device-codec`: a codec's encode and decode GB/s on a device, beside a
plain device-to-host copy of the same tensor.

A node on a GPU encodes what it sends there and copies only the payload to the host, and
decodes what it receives there from the payload copied up from pinned memory
(node/device.py). That pays when encoding and copying the payload beat copying the fp32
tensor: this measures the three side by side. GB/s are of the fp32 tensor's bytes, so the
figures compare directly: `encode` is device tensor -> host payload bytes (crc32 included),
`decode` host payload bytes -> device tensor, `copy_to_host` the fp32 tensor into pinned host
memory and `copy_to_host_pageable` into ordinary memory. Medians of `--repeats`; JSON on
stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

DEFAULT_SHAPES = ("8,256,768", "16,1024,1024")
"""A microbatch of the small preset's activations (6 MiB), and 64 MiB."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--codec", default="int8", help="codec name (default int8)")
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        help=f"tensor shape as comma-separated sizes; repeatable (default {DEFAULT_SHAPES})",
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of each (median)")


def serve(args: argparse.Namespace) -> int:

    from swarmpipe.compression import get_codec
    from swarmpipe.errors import CodecError, ConfigError
    from swarmpipe.node.device import describe_device, resolve_device

    if args.repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    try:
        codec = get_codec(args.codec)
    except CodecError as exc:
        raise ConfigError(f"--codec: {exc}") from None
    shapes = []
    for text in args.shape or DEFAULT_SHAPES:
        try:
            shape = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise ConfigError(f"--shape {text!r}: give sizes like 8,256,768") from None
        if not shape or min(shape) < 1:
            raise ConfigError(f"--shape {text!r}: every size must be >= 1")
        shapes.append(shape)
    device = resolve_device(args.device)

    rows = [_measure(shape, codec.name, codec.blockwise, device, args.repeats) for shape in shapes]
    print(
        json.dumps(
            {"device": describe_device(device), "codec": args.codec, "results": rows}, indent=2
        )
    )
    return 0


def _measure(
    shape: tuple[int, ...], codec: str, blockwise: bool, device: Any, repeats: int
) -> dict[str, Any]:
    """One tensor's timings under `codec` on `device`."""
    import torch

    from swarmpipe.compression import decode_tensor, encode_tensor

    cuda = device.type == "cuda"

    def timed(fn: Callable[[], object]) -> float:
        fn()  # warm-up: kernels, allocator
        if cuda:
            torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    nbytes = x.numel() * x.element_size()

    def encode() -> tuple[Any, bytes]:
        # As a node sends activations: channel blocks for the blockwise codecs.
        return encode_tensor(x, codec, channel_blocks=blockwise)

    header, payload = encode()
    pinned = torch.empty(shape, dtype=x.dtype, pin_memory=cuda)
    seconds = {
        "encode": timed(encode),
        "decode": timed(lambda: decode_tensor(header, payload, device=device)),
        "copy_to_host": timed(lambda: pinned.copy_(x, non_blocking=cuda)),
        "copy_to_host_pageable": timed(lambda: x.to("cpu", copy=True)),
    }
    return {
        "shape": list(shape),
        "tensor_mib": round(nbytes / 2**20, 2),
        "payload_mib": round(len(payload) / 2**20, 2),
        "gb_per_s": {k: round(nbytes / s / 1e9, 3) for k, s in seconds.items()},
        "ms": {k: round(s * 1e3, 3) for k, s in seconds.items()},
    }
