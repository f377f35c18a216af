"""Low-rank (PowerSGD-style): send two thin factors P and Q whose product approximates the tensor.

The tensor is viewed as a matrix M [n, m]: its last dimension is m and every other dimension
folds into n (a 0-d tensor is [1, 1], a vector [1, m]). The sender scales M by its absmax s,
runs power iteration from Q [m, r] (random on a fresh state, two rounds; the last tensor's Q
from an `EncoderState`, one round, which converges over calls for a slowly changing matrix):

    P = orth(M Q)   [n, r]    Q = M^T P   [m, r]    M ~ s P Q^T

Both factors travel, in fp32, so decoding needs no receiver state. fp32 rather than fp16: the
factors are (n + m) r numbers against n m, so their width hardly moves the ratio (204x at rank
8 for an 8x512x1024 activation), while fp16 would cap P at 65504 and flush small gradients to
zero. A tensor of rank <= r comes back exact up to fp32 rounding; anything else loses its
smaller singular directions, which error feedback (gradients) carries into later tensors.

When the factors would not be smaller than the tensor itself (small or thin tensors, biases,
r >= min(n, m)), or the tensor holds inf or NaN (whose products would smear NaN over every
element), the payload is the tensor's own bytes instead and the header says rank 0: never a
silent loss, and never a factorisation that costs more than it saves.

Payload, rank r > 0: the scale s (fp32), P (n x r fp32, row-major), Q (m x r fp32, row-major).
Rank 0: the tensor's elements in its own dtype, as lossless sends them (fp16 clamped to its
finite range, which only error feedback's residual can push past).
"""

from __future__ import annotations

import torch

from swarmpipe.compression.casts import FP16_MAX
from swarmpipe.compression.codec import TensorCodec, describe, header_dtype, numel
from swarmpipe.compression.state import EncoderState
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

_COLD_ROUNDS = 2
"""Power iteration rounds without a warm start: one more than PowerSGD's one, because a
stateless caller (or the first tensor on a link) has no earlier Q to start from."""
_SEED = 0x10F0
"""Seeds the random start, so the same tensor always gives the same bytes."""


_TINY_SCALE = 2.0**-100
"""Matrices with a smaller absmax are lifted by `_LIFT` for the power iteration."""
_LIFT = 2.0**64


def matrix_dims(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """The [n, m] matrix a tensor of this shape is factorised as."""
    if not shape:
        return 1, 1
    return numel(shape[:-1]), shape[-1]


def factor_bytes(n: int, m: int, rank: int) -> int:
    """Payload bytes of a rank-`rank` factorisation of an [n, m] matrix."""
    return 4 + 4 * rank * (n + m)


def planned_rank(n: int, m: int, rank: int, itemsize: int) -> int:
    """The rank a finite [n, m] matrix is sent at: at most `rank`, and 0 (the matrix itself)
    where the factors would not be smaller."""
    r = min(rank, n, m)
    return r if r > 0 and factor_bytes(n, m, r) < n * m * itemsize else 0


class LowRankCodec(TensorCodec):
    """fp32 factors P, Q and a scale, or the tensor itself where factors would not pay."""

    codec_id = tensor_pb2.CODEC_LOWRANK
    name = "lowrank"
    stateful = True
    header_fields = frozenset({"rank"})

    def expected_payload_bytes(self, header: tensor_pb2.TensorHeader) -> int:
        n, m = matrix_dims(list(header.shape))
        if header.rank == 0:
            return n * m * header_dtype(header).itemsize
        return factor_bytes(n, m, header.rank)

    def _plan_header(
        self, header: tensor_pb2.TensorHeader, *, topk_fraction: float, rank: int
    ) -> None:
        n, m = matrix_dims(list(header.shape))
        header.rank = planned_rank(n, m, rank, header_dtype(header).itemsize)

    def check_header(self, header: tensor_pb2.TensorHeader) -> None:
        super().check_header(header)
        n, m = matrix_dims(list(header.shape))
        if header.rank > min(n, m):
            raise CodecError(
                f"tensor header gives rank {header.rank} for a [{n}, {m}] matrix, "
                f"more than min(n, m) ({describe(header)})"
            )

    def _encode_stateful(
        self,
        flat: torch.Tensor,
        header: tensor_pb2.TensorHeader,
        *,
        topk_fraction: float,
        rank: int,
        state: EncoderState | None,
    ) -> torch.Tensor:
        if rank < 1:
            raise CodecError(f"rank must be >= 1 for the lowrank codec, not {rank}")
        if state is None:
            return self._encode_matrix(flat, header, rank, None)
        with state.hold(tuple(header.shape), flat.dtype, flat.device):
            x = state.with_residual(flat.to(torch.float32, copy=True))
            return self._encode_matrix(x, header, rank, state)

    def _encode_matrix(
        self,
        x: torch.Tensor,
        header: tensor_pb2.TensorHeader,
        rank: int,
        state: EncoderState | None,
    ) -> torch.Tensor:
        """The payload of flat `x` (fp32 and owned when `state` is given, else the caller's
        tensor); updates `state` under its hold."""
        dtype = header_dtype(header)
        n, m = matrix_dims(list(header.shape))
        r = planned_rank(n, m, rank, dtype.itemsize)
        matrix = x.view(n, m).float() if x.numel() else x
        # absmax is inf or NaN exactly when some element is: one pass decides both.
        scale = matrix.abs().amax() if x.numel() else torch.zeros(())
        if r == 0 or not bool(scale.isfinite()):
            header.rank = 0
            dense = x.to(dtype)
            if dtype == torch.float16 and x.dtype != torch.float16:
                dense = x.clamp(-FP16_MAX, FP16_MAX).to(dtype)
            if state is not None:
                state.keep_residual(x - dense.float())  # dense may be x itself
            return dense.reshape(-1).view(torch.uint8)

        header.rank = r
        out = torch.empty(factor_bytes(n, m, r), dtype=torch.uint8, device=x.device)
        words = out.view(torch.float32)
        if float(scale) == 0.0:
            words.zero_()
            if state is not None:
                state.keep_residual(x.zero_())
            return out
        q = None if state is None else state.warm_start(n, m, r)
        rounds = 1
        if q is None:
            rounds = _COLD_ROUNDS
            # Drawn on the CPU, so a GPU sender starts from the same Q and sends the same
            # factors up to rounding.
            generator = torch.Generator().manual_seed(_SEED)
            q = torch.randn(m, r, generator=generator).to(x.device)
        # Power iteration on M / s, whose entries lie in [-1, 1], so no product overflows even
        # near fp32's largest value; the 1/s goes on the thin factors, not on M (a pass
        # saved). P^T M rather than M^T P: on CPU the transposed product is 10x slower.
        # A matrix of subnormals would make q / s overflow to inf (and the factors NaN): it
        # is lifted by 2^64, which is exact, for the iteration only; the ratio is the same.
        lifted, lifted_scale = matrix, scale
        if float(scale) < _TINY_SCALE:
            lifted, lifted_scale = matrix * _LIFT, scale * _LIFT
        for _ in range(rounds):
            p = torch.linalg.qr(lifted @ (q / lifted_scale)).Q  # reduced: [n, r], orthonormal
            q = ((p / lifted_scale).T @ lifted).T
        words[0] = scale
        words[1 : 1 + n * r].view(n, r).copy_(p)
        words[1 + n * r :].view(m, r).copy_(q)
        if state is not None:
            state.keep_warm_start(n, m, r, q.contiguous())
            # The residual is what the receiver will not see: computed from the factors as
            # sent, the same way `_decode_flat` multiplies them out.
            approx = _product(words[1 : 1 + n * r].view(n, r), words[1 + n * r :].view(m, r))
            state.keep_residual(matrix.sub_(approx.mul_(words[0])).view(-1))
        return out

    def _decode_flat(self, header: tensor_pb2.TensorHeader, raw: torch.Tensor) -> torch.Tensor:
        dtype = header_dtype(header)
        if header.rank == 0:
            return raw.view(dtype)
        n, m = matrix_dims(list(header.shape))
        r = header.rank
        words = raw.view(torch.float32)
        out = _product(words[1 : 1 + n * r].view(n, r), words[1 + n * r :].view(m, r))
        out.mul_(words[0])
        # A projection can exceed the matrix's absmax by up to sqrt(n), so a tensor near its
        # dtype's largest value could come back inf; clamp instead, as fp16 does (NaN stays).
        biggest = FP16_MAX if dtype == torch.float16 else torch.finfo(dtype).max
        out.clamp_(-biggest, biggest)
        return out.view(-1).to(dtype)


def _product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P Q^T, a new [n, m] fp32 tensor."""
    return p @ q.T
