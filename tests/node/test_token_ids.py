"""Labels and token ids on the wire: as few bytes as the vocabulary allows, the input ids
derived from the labels and one id per sample, and refused when malformed."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.data import Corpus
from swarmpipe.errors import PeerError
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.node.token_ids import (
    decode_token_ids,
    encode_token_ids,
    first_tokens_of,
    tokens_from_labels,
)


@pytest.mark.parametrize(("vocab", "width"), [(2, 1), (256, 1), (257, 2), (65536, 2), (65537, 4)])
def test_ids_round_trip_in_the_narrowest_width(vocab: int, width: int) -> None:
    ids = torch.randint(0, vocab, (3, 5))
    ids[0, 0] = vocab - 1
    data = encode_token_ids(ids, vocab)
    assert len(data) == 3 * 5 * width
    assert torch.equal(decode_token_ids(data, (3, 5), vocab), ids)


def test_a_wrong_length_is_refused_before_decoding() -> None:
    with pytest.raises(PeerError, match="labels are 14 bytes; 3 x 5 ids of 1 byte"):
        decode_token_ids(bytes(14), (3, 5), 256, "labels")


def test_ids_outside_a_small_vocabulary_are_refused() -> None:
    with pytest.raises(PeerError, match=r"must be in \[0, 100\); got 200"):
        decode_token_ids(bytes([200]) + bytes(14), (3, 5), 100)


def test_the_corpus_input_ids_come_back_from_first_ids_and_labels(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(256)) * 40)
    corpus = Corpus.load(load_config(None, [f"data.paths=[{str(text)!r}]"]).data, 16, 0)
    for tokens, labels in [corpus.samples(3, 5), corpus.heldout(4)]:
        first = first_tokens_of(tokens, labels)
        assert first.shape == (tokens.shape[0],)
        wire = decode_token_ids(encode_token_ids(first, 256), first.shape, 256)
        assert torch.equal(tokens_from_labels(wire, labels), tokens)


def test_ids_that_are_not_the_labels_shifted_are_refused_at_the_sender() -> None:
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    labels = torch.tensor([[2, 3, 4], [5, 7, 7]])  # sample 1's second id is 5, not 7
    with pytest.raises(ValueError, match="not their labels shifted by one"):
        first_tokens_of(tokens, labels)


def test_a_stage_after_a_boundary_wants_k_wide_activations_and_token_ids() -> None:
    config = load_config(
        None,
        ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.context=8",
         "model.bottleneck=4", "pipeline.stages=2"],
    )  # fmt: skip
    runtime = StageRuntime(config, 1)
    runtime.check_activation(torch.zeros(2, 8, 4), 2)
    with pytest.raises(PeerError, match=r"not the expected \[2, 8, 4\]"):
        runtime.check_activation(torch.zeros(2, 8, 32), 2)
    with pytest.raises(PeerError, match="needs the microbatch's token ids"):
        runtime.check_tokens(None)
    runtime.check_tokens(torch.zeros(2, 8, dtype=torch.long))
    StageRuntime(config, 0).check_tokens(None)  # stage 0 has the ids as its input
