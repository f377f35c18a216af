"""Byte-level language-model samples from text files, named by global sample index.

A sample is a window of context+1 bytes (tokens and the labels shifted by one)
at stride `context`, so windows share only their boundary byte. The last
`holdout_fraction` of windows, by position, are held out for evaluation.
Training sample i is window perm_e[i mod n] of epoch e = i // n, where perm_e
is a permutation seeded by (seed, e): any head can produce any sample from its
index alone, so a lease is just a range of indices and a replayed lease yields
exactly the same samples.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from swarmpipe.config import DataConfig
from swarmpipe.errors import DataError

# Directories of the standard library that are not the library itself: tests
# (test/, tests/, idlelib/idle_test/, ...) and what pip installed beside it.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests"})


def _skipped(directory: str) -> bool:
    return (
        directory in _SKIPPED_DIRS or directory.startswith("test_") or directory.endswith("_test")
    )


def default_corpus_files() -> list[Path]:
    """The Python standard library's .py sources: offline text on every machine we run on."""
    root = sysconfig.get_paths()["stdlib"]
    files: list[Path] = []
    # os.walk rather than rglob: pruning site-packages (often far larger than
    # the library itself) is what keeps this fast.
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if not _skipped(d)]
        files.extend(Path(directory, n) for n in names if n.endswith(".py"))
    return sorted(files)


def _expand(patterns: tuple[str, ...]) -> list[Path]:
    """The files named by data.paths (paths or globs), sorted and each once."""
    files: set[Path] = set()
    for pattern in patterns:
        matches = [Path(m) for m in glob.glob(os.path.expanduser(pattern), recursive=True)]
        found = [m.resolve() for m in matches if m.is_file()]
        if not found:
            hint = "; it names only directories, use e.g. 'dir/**/*.txt'" if matches else ""
            raise DataError(f"data.paths entry {pattern!r} matches no file{hint}")
        files.update(found)
    return sorted(files)


def _read(files: list[Path], max_bytes: int) -> npt.NDArray[np.uint8]:
    """The files' bytes back to back, at most max_bytes of them."""
    chunks, total = [], 0
    for path in files:
        try:
            with path.open("rb") as f:
                chunk = f.read(max_bytes - total)
        except OSError as exc:
            raise DataError(f"cannot read corpus file {path}: {exc}") from exc
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class Corpus:
    """Training and held-out samples of one run's text."""

    def __init__(
        self, data: npt.NDArray[np.uint8], context: int, seed: int, holdout_fraction: float
    ) -> None:
        self.data = data  # [N] uint8, the whole text
        self.context = context
        self.seed = seed
        n_windows = (len(data) - 1) // context
        n_holdout = int(n_windows * holdout_fraction)
        if holdout_fraction > 0:
            n_holdout = max(n_holdout, 1)
        self.n_holdout = n_holdout
        self.n_train = n_windows - n_holdout
        if self.n_train < 2:
            raise DataError(
                f"the corpus has {len(data)} bytes, {n_windows} windows of {context} tokens: "
                f"too few for training ({self.n_train}) and held-out ({n_holdout}) samples; "
                "add text to data.paths or lower model.context"
            )
        # (epoch, its permutation), replaced as one object so a reader never
        # pairs one epoch with another's order.
        self._perm: tuple[int, npt.NDArray[np.int64]] = (-1, np.empty(0, dtype=np.int64))

    @classmethod
    def load(cls, cfg: DataConfig, context: int, seed: int) -> Corpus:
        """Read the files cfg.paths names (default: the standard library) into a corpus."""
        files = _expand(cfg.paths) if cfg.paths else default_corpus_files()
        if not files:
            raise DataError("no .py files found in the standard library; set data.paths")
        return cls(_read(files, cfg.max_bytes), context, seed, cfg.holdout_fraction)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short sha256 of the text, so a report can say which corpus it trained on."""
        return hashlib.sha256(self.data.tobytes()).hexdigest()[:16]

    def _windows(self, starts: npt.NDArray[np.int64]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows number `starts` [N] as (tokens, labels), each int64 [N, context]."""
        offsets = starts[:, None] * self.context + np.arange(self.context + 1)  # [N, T+1]
        windows = torch.from_numpy(self.data[offsets].astype(np.int64))  # [N, T+1]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _permutation(self, epoch: int) -> npt.NDArray[np.int64]:
        """The training windows in epoch `epoch`'s order; the latest epoch is cached."""
        cached_epoch, perm = self._perm
        if cached_epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_train)
            self._perm = (epoch, perm)
        return perm

    def samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training samples start..start+count-1: tokens and labels, int64 [count, context]."""
        if start < 0 or count < 0:
            raise DataError(f"sample range start={start} count={count} must be non-negative")
        parts = []
        i, end = start, start + count
        while i < end:  # one pass per epoch the range touches, usually one
            epoch, first = divmod(i, self.n_train)
            stop = min(end, (epoch + 1) * self.n_train)
            parts.append(self._permutation(epoch)[first : first + stop - i])
            i = stop
        starts = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return self._windows(starts)

    def heldout(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `count` held-out windows (fewer if there are fewer): tokens and labels."""
        return self.heldout_range(0, count)

    def heldout_range(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out windows start..start+count-1 (clipped to what there is): tokens and labels.

        An evaluation lease names such a range, so every head evaluates the same samples.
        """
        if self.n_holdout == 0:
            raise DataError("the corpus holds nothing out; set data.holdout_fraction > 0")
        if count < 1 or start < 0:
            raise DataError(f"held-out range start={start} count={count} is not a valid range")
        if start >= self.n_holdout:
            raise DataError(
                f"held-out range starts at {start}, past the {self.n_holdout} held-out samples"
            )
        count = min(count, self.n_holdout - start)
        first = self.n_train + start
        return self._windows(np.arange(first, first + count, dtype=np.int64))
