"""A microbatch's labels and token ids on the wire, in as few bytes per id as will do.

`MicrobatchHeader.labels` holds the target ids of every sample, one byte each for the
byte-level vocabulary (2 or 4 for larger ones). A stage after a bottleneck boundary also needs
the input ids, to re-add token embeddings; a sample is a window of the text, so its input ids
are its first id followed by its labels shifted by one, and only the first travels
(`MicrobatchHeader.first_tokens`): the ids a bottleneck needs cost one id per sample on top of
the labels every run sends.
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


def encode_token_ids(ids: torch.Tensor, vocab: int) -> bytes:
    """Ids (any shape, each in [0, vocab)) as bytes in the narrowest width, row-major."""
    return ids.numpy().astype(token_id_dtype(vocab)).tobytes()


def decode_token_ids(
    data: bytes, shape: tuple[int, ...], vocab: int, what: str = "token ids"
) -> torch.Tensor:
    """Bytes from encode_token_ids back to int64 ids of `shape`; PeerError if malformed.

    The length is checked before anything is allocated, and every id against the vocabulary;
    `what` names the field in the error.
    """
    dtype = token_id_dtype(vocab)
    count = int(np.prod(shape, dtype=np.int64))
    want = count * dtype.itemsize
    if len(data) != want:
        dims = " x ".join(str(d) for d in shape)
        raise PeerError(
            f"{what} are {len(data)} bytes; {dims} ids of {dtype.itemsize} byte(s) each "
            f"(vocabulary {vocab}) need {want}"
        )
    ids = torch.from_numpy(np.frombuffer(data, dtype=dtype).astype(np.int64))
    if ids.numel() and int(ids.max()) >= vocab:
        raise PeerError(f"{what} must be in [0, {vocab}); got {int(ids.max())}")
    return ids.reshape(shape)


def first_tokens_of(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The first id of each sample [B], after checking the rest are the labels shifted by one.

    ValueError if they are not: then the input ids cannot be derived from the labels, and
    sending only the first would train the stages after a boundary on the wrong tokens.
    """
    if tokens.shape != labels.shape or not torch.equal(tokens[:, 1:], labels[:, :-1]):
        raise ValueError(
            "the samples' token ids are not their labels shifted by one (tokens[:, 1:] == "
            "labels[:, :-1]), which a bottleneck run relies on to send only each sample's "
            "first id"
        )
    return tokens[:, 0]


def tokens_from_labels(first: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Input ids [B, T] from each sample's first id [B] and its labels [B, T]."""
    return torch.cat([first[:, None], labels[:, :-1]], dim=1)
