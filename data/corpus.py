"""Byte-level language-model samples from text files, named by global sample index.

A sample is a window of context+1 bytes (tokens and the labels shifted by one)
at stride `context`. The last `holdout_fraction` of windows, by position, are
held out for evaluation. Training sample i is window perm_e[i mod n] of epoch
e = i // n, where perm_e is a permutation seeded by (seed, e): any head can
produce any sample from its index alone, so a lease is just a range of indices
and a replayed lease yields exactly the same samples.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch

from swarmpipe.config import DataConfig
from swarmpipe.errors import DataError


def default_corpus_files() -> list[Path]:
    """The Python standard library's .py sources: offline text on every machine we run on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if any(p in ("test", "tests", "idlelib") or p.startswith("test_") for p in parts):
            continue
        files.append(path)
    return files


def _expand(paths: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for pattern in paths:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise DataError(f"data.paths entry {pattern!r} matches no file")
        files.extend(Path(m) for m in matches if Path(m).is_file())
    return sorted(dict.fromkeys(files))


class Corpus:
    """Training and held-out samples of one run's text."""

    def __init__(self, data: np.ndarray, context: int, seed: int, holdout_fraction: float) -> None:
        self.data = data
        self.context = context
        self.seed = seed
        n_windows = (len(data) - 1) // context
        n_holdout = int(n_windows * holdout_fraction)
        self.n_train = n_windows - n_holdout
        self.n_holdout = n_holdout
        if self.n_train < 2 or (holdout_fraction > 0 and n_holdout < 1):
            raise DataError(
                f"the corpus has {len(data)} bytes: too few for samples of {context} tokens "
                "with a held-out part; add text to data.paths"
            )
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @classmethod
    def load(cls, cfg: DataConfig, context: int, seed: int) -> Corpus:
        files = _expand(cfg.paths) if cfg.paths else default_corpus_files()
        if not files:
            raise DataError("no text files found for the corpus")
        chunks, total = [], 0
        for path in files:
            try:
                blob = path.read_bytes()
            except OSError as exc:
                raise DataError(f"cannot read {path}: {exc}") from exc
            blob = blob[: cfg.max_bytes - total]
            chunks.append(blob)
            total += len(blob)
            if total >= cfg.max_bytes:
                break
        data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        return cls(data, context, seed, cfg.holdout_fraction)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.data.tobytes()).hexdigest()[:16]

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = starts[:, None] * self.context + np.arange(self.context + 1)[None, :]
        windows = torch.from_numpy(self.data[offsets].astype(np.int64))  # [N, T+1]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training samples start..start+count-1: tokens and labels, int64 [count, context]."""
        if start < 0 or count < 0:
            raise DataError(f"sample range {start}+{count} is invalid")
        indices = np.arange(start, start + count, dtype=np.int64)
        windows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(indices // self.n_train):
            mask = indices // self.n_train == epoch
            windows[mask] = self._permutation(int(epoch))[indices[mask] % self.n_train]
        return self._windows(windows)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_train)
            self._epoch = epoch
        return self._perm

    def heldout(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `count` held-out windows (deterministic), tokens and labels."""
        count = min(count, self.n_holdout)
        return self._windows(np.arange(self.n_train, self.n_train + count, dtype=np.int64))
