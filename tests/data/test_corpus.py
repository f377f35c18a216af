"""Samples are a pure function of (corpus, seed, index), so leases can be replayed exactly."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch

from swarmpipe.config import DataConfig
from swarmpipe.data import Corpus, default_corpus_files
from swarmpipe.errors import DataError

CONTEXT = 16


@pytest.fixture
def text(tmp_path: Path) -> Path:
    """Random bytes: with overwhelming probability every window is distinct."""
    path = tmp_path / "a.txt"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes())
    return path


def _load(path: Path, seed: int = 0, holdout: float = 0.1) -> Corpus:
    return Corpus.load(DataConfig(paths=(str(path),), holdout_fraction=holdout), CONTEXT, seed)


def _rows(x: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(r) for r in x.tolist()}


def test_samples_are_deterministic_and_labels_shifted(text: Path) -> None:
    a, b = _load(text), _load(text)
    x, y = a.samples(3, 5)
    assert x.shape == y.shape == (5, CONTEXT) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, b.samples(3, 5)[0]) and torch.equal(y, b.samples(3, 5)[1])
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Each sample is a window of the text at a multiple of the context.
    raw = text.read_bytes()
    for tokens, labels in zip(x.tolist(), y.tolist(), strict=True):
        start = raw.find(bytes(tokens + labels[-1:]))
        assert start % CONTEXT == 0
    # The same index gives the same sample however the range is cut.
    assert torch.equal(a.samples(5, 1)[0][0], x[2])
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 16


def test_a_different_seed_gives_a_different_order_of_the_same_windows(text: Path) -> None:
    a, b = _load(text, seed=0), _load(text, seed=1)
    n = a.n_train
    assert not torch.equal(a.samples(0, n)[0], b.samples(0, n)[0])
    assert _rows(a.samples(0, n)[0]) == _rows(b.samples(0, n)[0])


def test_epochs_wrap_with_a_new_order(text: Path) -> None:
    corpus = _load(text)
    n = corpus.n_train
    first, second = corpus.samples(0, n)[0], corpus.samples(n, n)[0]
    assert len(_rows(first)) == n and _rows(first) == _rows(second)
    assert not torch.equal(first, second)
    # A range across the epoch boundary is the two epochs' pieces back to back.
    across = corpus.samples(n - 3, 6)[0]
    assert torch.equal(across, torch.cat([first[-3:], second[:3]]))
    assert torch.equal(_load(text).samples(3 * n + 2, 1)[0], corpus.samples(3 * n + 2, 1)[0])


def test_holdout_is_disjoint_from_training(text: Path) -> None:
    corpus = _load(text)
    n_windows = (10_000 - 1) // CONTEXT
    assert corpus.n_holdout == int(n_windows * 0.1)
    assert corpus.n_train + corpus.n_holdout == n_windows
    train = _rows(corpus.samples(0, corpus.n_train)[0])
    held_x, held_y = corpus.heldout(corpus.n_holdout + 100)  # clipped to what there is
    assert len(held_x) == corpus.n_holdout and torch.equal(held_x[:, 1:], held_y[:, :-1])
    assert not train & _rows(held_x)
    assert torch.equal(corpus.heldout(3)[0], held_x[:3])
    # The held-out windows are the last ones by position.
    last = text.read_bytes()[(n_windows - 1) * CONTEXT : n_windows * CONTEXT]
    assert held_x[-1].tolist() == list(last)
    # An evaluation lease names a range of held-out windows: the same ones, in pieces.
    assert torch.equal(corpus.heldout_range(2, 3)[0], held_x[2:5])
    tail = corpus.heldout_range(corpus.n_holdout - 2, 10)[0]  # clipped to what there is
    assert torch.equal(tail, held_x[-2:])
    with pytest.raises(DataError, match="past the"):
        corpus.heldout_range(corpus.n_holdout, 1)
    with pytest.raises(DataError, match="not a valid range"):
        corpus.heldout_range(-1, 2)


def test_holdout_fraction_zero_trains_on_everything(text: Path) -> None:
    corpus = _load(text, holdout=0.0)
    assert corpus.n_holdout == 0 and corpus.n_train == (10_000 - 1) // CONTEXT
    with pytest.raises(DataError, match="holds nothing out"):
        corpus.heldout(1)


def test_globs_are_sorted_and_deduplicated(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name, fill in (("b.txt", b"b"), ("a.txt", b"a"), ("sub/c.txt", b"c")):
        (tmp_path / name).write_bytes(fill * 1000)
    paths = (str(tmp_path / "**" / "*.txt"), str(tmp_path / "a.txt"), str(tmp_path / "sub"))
    with pytest.raises(DataError, match="only directories"):
        Corpus.load(DataConfig(paths=paths), CONTEXT, seed=0)
    corpus = Corpus.load(DataConfig(paths=paths[:2]), CONTEXT, seed=0)
    assert corpus.data.tobytes() == b"a" * 1000 + b"b" * 1000 + b"c" * 1000


def test_max_bytes_caps_the_text(tmp_path: Path) -> None:
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes(b"x" * 3000)
    cfg = DataConfig(paths=(str(tmp_path / "*.txt"),), max_bytes=4000)
    assert len(Corpus.load(cfg, CONTEXT, seed=0).data) == 4000


def test_default_corpus_is_the_standard_library_without_tests() -> None:
    files = default_corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    relative = {f.relative_to(stdlib).as_posix() for f in files}
    assert "os.py" in relative and "json/decoder.py" in relative
    assert not any(
        part in ("test", "tests", "site-packages") for f in relative for part in f.split("/")
    )
    assert files == sorted(files)
    corpus = Corpus.load(DataConfig(), 64, seed=0)
    assert len(corpus.data) > 1_000_000 and len(corpus.fingerprint) == 16
    assert corpus.samples(10**9, 2)[0].shape == (2, 64)  # indices are unbounded


def test_bad_paths_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="matches no file"):
        Corpus.load(DataConfig(paths=(str(tmp_path / "*.nothing"),)), CONTEXT, seed=0)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc" * 10)  # one window of 16 tokens
    with pytest.raises(DataError, match="too few"):
        Corpus.load(DataConfig(paths=(str(tiny),)), CONTEXT, seed=0)


def test_an_unreadable_file_is_a_data_error(monkeypatch: pytest.MonkeyPatch, text: Path) -> None:
    # Permissions do not stop root, so the OS refusal is simulated.
    def refuse(self: Path, *args: object, **kwargs: object) -> NoReturn:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(DataError, match=r"cannot read corpus file .*a\.txt.*Permission denied"):
        _load(text)


def test_negative_ranges_are_data_errors(text: Path) -> None:
    with pytest.raises(DataError, match="non-negative"):
        _load(text).samples(-1, 2)
    with pytest.raises(DataError, match="non-negative"):
        _load(text).samples(2, -1)
