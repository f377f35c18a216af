"""EncoderState: resets on a change of shape, stays bounded, serialises users, needs no receiver."""

from __future__ import annotations

import threading

import pytest
import torch

from swarmpipe.compression import CODECS_BY_NAME, EncoderState, decode_tensor, encode_tensor

pytestmark = pytest.mark.filterwarnings("error")

STATEFUL = ["lowrank", "topk"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("codec", STATEFUL)
def test_a_change_of_shape_resets_the_state_cleanly(codec: str) -> None:
    state = EncoderState(error_feedback=True)
    a = torch.randn(64, 48, generator=_gen(1))
    b = torch.randn(32, 48, generator=_gen(2))
    encode_tensor(a, codec, rank=2, state=state)
    assert state.residual is not None and state.residual.numel() == a.numel()
    # The first tensor of the new shape is encoded exactly as with a fresh state.
    fresh = EncoderState(error_feedback=True)
    assert encode_tensor(b, codec, rank=2, state=state) == encode_tensor(
        b, codec, rank=2, state=fresh
    )
    assert state.resets == 1
    assert state.residual is not None and state.residual.numel() == b.numel()
    # So does a change of dtype.
    encode_tensor(b.half(), codec, rank=2, state=state)
    assert state.resets == 2


@pytest.mark.parametrize("codec", STATEFUL)
def test_memory_stays_bounded_over_many_tensors(codec: str) -> None:
    state = EncoderState(error_feedback=True)
    g = _gen(3)
    seen = set()
    for step in range(40):
        shape = (64, 48) if step % 10 else (16, 48)  # an occasional short microbatch
        encode_tensor(torch.randn(shape, generator=g), codec, rank=2, state=state)
        assert state.residual is not None
        assert state.residual.numel() == shape[0] * shape[1]
        seen.add(id(state.residual))
    # One residual at a time, replaced rather than accumulated into a growing structure.
    held = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    assert sum(t.numel() for t in held) <= 64 * 48 + 48 * 2


def test_switching_codec_on_a_link_keeps_what_is_owed() -> None:
    # Per-link codec choice may move a link from top-k to low-rank: same shape, so the
    # residual carries over and is paid by the low-rank tensor.
    state = EncoderState(error_feedback=True)
    x = torch.randn(64, 48, generator=_gen(8))
    encode_tensor(x, "topk", topk_fraction=0.05, state=state)
    owed = state.residual
    assert owed is not None
    y = torch.randn(64, 48, generator=_gen(9))
    fresh = EncoderState(error_feedback=True)
    with_owed = decode_tensor(*encode_tensor(y, "lowrank", rank=2, state=state))
    without = decode_tensor(*encode_tensor(y, "lowrank", rank=2, state=fresh))
    assert state.resets == 0
    assert not torch.equal(with_owed, without)
    assert state.residual is not None and fresh.residual is not None
    sent = (y.reshape(-1) + owed) - with_owed.reshape(-1)
    assert torch.allclose(sent, state.residual, atol=1e-5)


def test_reset_forgets_residual_and_warm_start() -> None:
    state = EncoderState(error_feedback=True)
    x = torch.randn(64, 48, generator=_gen(4))
    cold = encode_tensor(x, "lowrank", rank=2)
    encode_tensor(x, "lowrank", rank=2, state=state)
    state.reset()
    assert state.residual is None
    assert encode_tensor(x, "lowrank", rank=2, state=state) == cold


@pytest.mark.parametrize("codec", ["lossless", "fp16", "bf16", "int8", "int4"])
def test_stateless_codecs_ignore_the_state(codec: str) -> None:
    state = EncoderState(error_feedback=True)
    x = torch.randn(3, 300, generator=_gen(5))
    encode_tensor(torch.randn(3, 300, generator=_gen(6)), "topk", state=state)
    residual = state.residual
    assert encode_tensor(x, codec, state=state) == encode_tensor(x, codec)
    assert state.residual is residual and state.resets == 0


def test_decoding_needs_no_state_so_a_reroute_corrupts_nothing() -> None:
    # One sender state, its tensors decoded by two different receivers in turn (a reroute):
    # every receiver's tensors are complete on their own, and together they track the inputs.
    state = EncoderState(error_feedback=True)
    g = _gen(7)
    total_in = torch.zeros(4000, dtype=torch.float64)
    total_out = torch.zeros(4000, dtype=torch.float64)
    for _ in range(60):
        x = torch.randn(4000, generator=g)
        header, payload = encode_tensor(x, "topk", topk_fraction=0.05, state=state)
        receiver_copy = bytes(payload)  # each receiver has only what arrived
        y = decode_tensor(header, receiver_copy)
        assert y.shape == x.shape
        assert int(y.count_nonzero()) <= header.kept
        total_in += x.double()
        total_out += y.double()
    assert state.residual is not None
    assert torch.allclose(total_in - total_out, state.residual.double(), atol=1e-3)


def test_threads_sharing_a_state_lose_nothing() -> None:
    # Encodings of one link run in worker threads; the state serialises them, so the
    # receiver's total still equals the inputs' minus the one residual.
    state = EncoderState(error_feedback=True)
    inputs = [torch.randn(3000, generator=_gen(10 + i)) for i in range(16)]
    outputs: list[torch.Tensor] = []
    lock = threading.Lock()

    def send(x: torch.Tensor) -> None:
        y = decode_tensor(*encode_tensor(x, "topk", topk_fraction=0.05, state=state))
        with lock:
            outputs.append(y)

    threads = [threading.Thread(target=send, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(outputs) == len(inputs)
    gap = torch.stack(inputs).double().sum(0) - torch.stack(outputs).double().sum(0)
    assert state.residual is not None
    assert torch.allclose(gap, state.residual.double(), atol=1e-4)


def test_every_stateful_codec_is_listed() -> None:
    assert sorted(n for n, c in CODECS_BY_NAME.items() if c.stateful) == STATEFUL
