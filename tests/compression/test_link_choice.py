"""The per-link codec policy: least lossy codec that fits, hysteresis, and change with the link."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swarmpipe.compression import CODECS_BY_NAME, encode_tensor
from swarmpipe.compression.link_choice import (
    LOSSINESS_ORDER,
    UPGRADE_HEADROOM,
    UPGRADE_PATIENCE,
    CodecChooser,
    candidates,
    pick_codec,
    wire_bytes,
)

ID = {name: CODECS_BY_NAME[name].codec_id for name in LOSSINESS_ORDER}
SHAPE = (8, 64, 128)  # an activation of the default model: microbatch x context x d_model
BLOCK = 256


def _sizes(ladder: tuple[str, ...] = LOSSINESS_ORDER) -> list[int]:
    return wire_bytes(
        candidates(ladder), SHAPE, torch.float32, block_size=BLOCK, topk_fraction=0.01, rank=8
    )


def _pick(bandwidth: float, budget: float, current: int = 0) -> str:
    codec = pick_codec(
        candidates(), _sizes(), bytes_per_second=bandwidth, budget_seconds=budget, current=current
    )
    return CODECS_BY_NAME_BY_ID[codec]


CODECS_BY_NAME_BY_ID = {codec.codec_id: name for name, codec in CODECS_BY_NAME.items()}


def test_candidates_run_from_least_to_most_lossy() -> None:
    assert candidates() == tuple(ID[name] for name in LOSSINESS_ORDER)
    # Integer tensors can only go lossless.
    assert candidates(dtype=torch.int64) == (CODECS_BY_NAME["lossless"].codec_id,)
    # A run's own ladder keeps its order.
    ladder = ("lossless", "int8", "topk")
    assert candidates(ladder) == tuple(CODECS_BY_NAME[n].codec_id for n in ladder)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "fraction", "rank"),
    [
        (SHAPE, 0.01, 8),
        ((3, 5), 0.5, 2),  # factors would not pay at rank 2: lowrank sends it dense
        ((1000,), 0.001, 4),  # a vector: rank 1 at most
        ((2, 70_000), 0.3, 8),  # more than one top-k span
        ((), 0.5, 8),
        ((0, 4), 0.01, 8),
    ],
)
@pytest.mark.parametrize("centered", [False, True])
def test_wire_bytes_match_what_the_codecs_send(
    shape: tuple[int, ...], fraction: float, rank: int, dtype: torch.dtype, centered: bool
) -> None:
    tensor = torch.randn(shape).to(dtype)
    codecs = candidates(tuple(CODECS_BY_NAME), dtype)
    options: dict[str, Any] = {
        "block_size": BLOCK, "topk_fraction": fraction, "rank": rank, "centered": centered
    }  # fmt: skip
    sizes = wire_bytes(codecs, shape, dtype, **options)
    for codec, size in zip(codecs, sizes, strict=True):
        header, payload = encode_tensor(tensor, codec, **options)
        assert size == len(payload) == header.payload_bytes, CODECS_BY_NAME_BY_ID[codec]


def test_a_ladder_ending_in_topk_reaches_it_only_when_int4_does_not_fit() -> None:
    ladder = (*LOSSINESS_ORDER, "topk")
    sizes = _sizes(ladder)
    int4, topk = sizes[ladder.index("int4")], sizes[ladder.index("topk")]
    assert topk * 5 < int4  # 1 % of the entries at ~6 bytes each against half a byte each

    def pick(bandwidth: float) -> str:
        codec = pick_codec(
            candidates(ladder), sizes, bytes_per_second=bandwidth, budget_seconds=1.0, current=0
        )
        return CODECS_BY_NAME_BY_ID[codec]

    assert pick(bandwidth=int4 * 1.01) == "int4"
    assert pick(bandwidth=int4 * 0.99) == "topk"
    assert pick(bandwidth=topk * 0.5) == "topk"  # nothing fits: the fewest bytes


def test_a_fast_link_sends_lossless() -> None:
    lossless = _sizes()[0]
    # A link that carries the lossless tensor in a tenth of the compute time.
    assert _pick(bandwidth=lossless / 0.01, budget=0.1) == "lossless"


@pytest.mark.parametrize(
    ("name", "slower"), [("lossless", "fp16"), ("fp16", "int8"), ("int8", "int4")]
)
def test_the_least_lossy_codec_that_fits_wins(name: str, slower: str) -> None:
    sizes = dict(zip(LOSSINESS_ORDER, _sizes(), strict=True))
    budget = 0.05
    # The bandwidth at which `name` just fits; a little less and it does not (bf16 is never
    # picked over fp16: it sends as many bytes with less precision).
    bandwidth = sizes[name] / budget
    assert _pick(bandwidth, budget) == name
    assert _pick(bandwidth * 0.99, budget) == slower


def test_nothing_fits_sends_the_fewest_bytes() -> None:
    assert _pick(bandwidth=1.0, budget=0.01) == "int4"


def test_moving_to_a_less_lossy_codec_needs_headroom() -> None:
    sizes = dict(zip(LOSSINESS_ORDER, _sizes(), strict=True))
    budget = 0.05
    # int8 fits, but only just: a link already on int4 stays there...
    just = sizes["int8"] / budget
    assert _pick(just, budget, current=ID["int4"]) == "int4"
    assert _pick(just * 0.999 / UPGRADE_HEADROOM, budget, current=ID["int4"]) == "int4"
    # ...until int8 fits within the headroom; a fresh link takes int8 at once.
    assert _pick(just * 1.001 / UPGRADE_HEADROOM, budget, current=ID["int4"]) == "int8"
    assert _pick(just, budget) == "int8"


def test_a_codec_that_stops_fitting_is_left_at_once() -> None:
    sizes = dict(zip(LOSSINESS_ORDER, _sizes(), strict=True))
    budget = 0.05
    current = ID["lossless"]
    assert _pick(sizes["lossless"] / budget, budget, current=current) == "lossless"
    assert _pick(sizes["lossless"] / budget * 0.99, budget, current=current) == "fp16"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        pick_codec([1], [10], bytes_per_second=0, budget_seconds=1, current=1)
    with pytest.raises(ValueError, match="one size per codec"):
        pick_codec([1, 2], [10], bytes_per_second=1, budget_seconds=1, current=1)


def test_chooser_follows_a_link_that_slows_down_and_speeds_up_without_flapping() -> None:
    chooser = CodecChooser(candidates())
    sizes = _sizes()
    lossless = sizes[0]
    budget = 0.05
    names = []

    def step(bandwidth: float | None, budget_s: float | None = budget) -> None:
        codec = chooser.update(sizes, bytes_per_second=bandwidth, budget_seconds=budget_s)
        names.append(CODECS_BY_NAME_BY_ID[codec])

    step(None, None)  # nothing measured: lossless
    step(lossless / budget * 4)  # fast: lossless
    step(lossless / budget / 8)  # slowed eightfold: int4 fits only
    # Wobbling around the int8 boundary stays put once on int4.
    for wobble in (0.98, 1.02, 0.97, 1.05):
        step(sizes[3] / budget * wobble)
    # Fast again: back to lossless, once the link has stayed fast for a while.
    for _ in range(UPGRADE_PATIENCE):
        step(lossless / budget * 4)
    expected = ["lossless", "lossless", *["int4"] * (5 + UPGRADE_PATIENCE - 1), "lossless"]
    assert names == expected


def test_chooser_needs_a_run_of_agreeing_figures_to_relax_and_none_to_compress() -> None:
    chooser = CodecChooser(candidates(), patience=3)
    sizes = _sizes()
    fast, slow = sizes[0] / 0.01, sizes[-1] / 0.06

    def update(bandwidth: float) -> str:
        codec = chooser.update(sizes, bytes_per_second=bandwidth, budget_seconds=0.05)
        return CODECS_BY_NAME_BY_ID[codec]

    assert update(slow) == "int4"  # compressing: at once
    # One slow figure among fast ones restarts the count.
    assert [update(fast), update(fast), update(slow), update(fast), update(fast)] == ["int4"] * 5
    assert update(fast) == "lossless"
    with pytest.raises(ValueError, match="patience"):
        CodecChooser(candidates(), patience=0)
