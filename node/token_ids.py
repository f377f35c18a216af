"""A microbatch's token ids in `MicrobatchHeader.tokens`, in as few bytes per id as will do.

Only a run with `model.bottleneck` on sends them: a stage after a bottleneck
boundary re-adds token embeddings and needs to know which token sits where. For
the byte-level vocabulary that is one byte per token, which is why the ids do
not ride in the int32 labels' format.
"""

from __future__ import annotations

import numpy as np
import torch

from swarmpipe.errors import PeerError


def token_id_dtype(vocab: int) -> np.dtype[np.unsignedinteger]:
    """The unsigned little-endian dtype that holds every id below `vocab` in the fewest bytes."""
    if vocab <= 1 << 8:
        return np.dtype("u1")
    if vocab <= 1 << 16:
        return np.dtype("<u2")
    return np.dtype("<u4")


def encode_token_ids(tokens: torch.Tensor, vocab: int) -> bytes:
    """Token ids [B, T] (in [0, vocab)) as the bytes MicrobatchHeader.tokens carries."""
    return tokens.numpy().astype(token_id_dtype(vocab)).tobytes()


def decode_token_ids(data: bytes, sample_count: int, context: int, vocab: int) -> torch.Tensor:
    """MicrobatchHeader.tokens back to int64 ids [sample_count, context]; PeerError if malformed.

    The length is checked before anything is allocated, and every id against the vocabulary.
    """
    dtype = token_id_dtype(vocab)
    want = sample_count * context * dtype.itemsize
    if len(data) != want:
        raise PeerError(
            f"token ids are {len(data)} bytes; {sample_count} samples x {context} tokens of "
            f"{dtype.itemsize} byte(s) each (vocabulary {vocab}) need {want}"
        )
    ids = torch.from_numpy(np.frombuffer(data, dtype=dtype).astype(np.int64))
    if ids.numel() and int(ids.max()) >= vocab:
        raise PeerError(f"token ids must be in [0, {vocab}); got {int(ids.max())}")
    return ids.reshape(sample_count, context)
