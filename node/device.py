"""Which torch device a node's stage trains on, and moving tensors between it and the host.

`resolve_device` turns a spec ("auto", "cpu", "cuda", "cuda:N"; config.check_device_spec
says what may be written) into a torch.device, or a ConfigError with one line saying what is
missing. "auto" takes the CUDA GPU with the least memory in use (so the testnet's nodes, or
several volunteers' processes on one machine, spread over the GPUs there), else the CPU.

Tensors cross between host and device in one place each way: what a node receives is
assembled in host memory (pinned when the stage is on a GPU, so the copy is a DMA that need
not stage through a bounce buffer) and copied to the device as its compressed payload, where
the codec decodes it; what it sends is encoded on the device and only the payload is copied
back (compression/codec.py). So the PCIe link carries compressed bytes both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from swarmpipe.config import check_device_spec
from swarmpipe.errors import ConfigError

GpuMemoryUsed = Callable[[], Sequence[int]]
"""Bytes of memory in use on each visible CUDA GPU, in index order."""


def cuda_memory_used() -> list[int]:
    """Bytes in use on each visible CUDA GPU (by every process, as the driver counts them)."""
    if not torch.cuda.is_available():
        return []
    used = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        used.append(total - free)
    return used


def resolve_device(
    spec: str, *, what: str = "--device", memory_used: GpuMemoryUsed = cuda_memory_used
) -> torch.device:
    """The device `spec` names on this machine; ConfigError (one line, naming the setting
    `what`) when it is not here. `memory_used` lists the visible GPUs' memory in use (tests
    pass their own machine)."""
    check_device_spec(spec, what=what)
    if spec == "cpu":
        return torch.device("cpu")
    used = list(memory_used())
    if spec == "auto":
        if not used:
            return torch.device("cpu")
        least = min(range(len(used)), key=lambda i: (used[i], i))
        return torch.device("cuda", least)
    if not used:
        raise ConfigError(
            f"{what} {spec}: this machine has no CUDA GPU that torch can use "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
            "use --device cpu or auto"
        )
    index = int(spec.partition(":")[2] or 0)  # "cuda" is torch's current GPU: 0 at start
    if index >= len(used):
        raise ConfigError(
            f"{what} {spec}: this machine has {len(used)} CUDA GPU(s), cuda:0 to "
            f"cuda:{len(used) - 1}"
        )
    return torch.device("cuda", index)


def describe_device(device: torch.device) -> str:
    """The device as a log line shows it: its name and, for a GPU, its model and memory."""
    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB)"


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; asynchronous from pinned host memory (the stream orders it)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=tensor.is_pinned())
