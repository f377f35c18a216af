"""`swarmpipe bench codecs` as a user runs it: JSON for every tensor, hivemind skipped or run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def test_codec_bench_prints_figures_for_every_tensor(tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    cmd = [sys.executable, "-m", "swarmpipe", "bench", "codecs", "--repeats", "1"]
    cmd += ["--codecs", "int8,lowrank", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result == json.loads(out.read_text())
    if importlib.util.find_spec("hivemind") is None:
        assert result["hivemind"].startswith("skipped: hivemind is not importable here")
        assert "int8_target" not in result
    tensors = result["tensors"]
    assert set(tensors) == {"activation", "gradient", "activation_outliers", "gradient_outliers"}
    for name, entry in tensors.items():
        assert set(entry["ours"]) == {"int8", "int8_flat", "int8_centered", "int8_zstd",
                                      "int8_codes15_zstd", "lowrank"}  # fmt: skip
        int8 = entry["ours"]["int8"]
        # 1 byte a code plus one fp32 scale per 256: fp32 / (1 + 4/256).
        assert int8["ratio"] == pytest.approx(4 / (1 + 4 / 256))
        assert int8["encode_mb_s"] > 0 and int8["decode_mb_s"] > 0
        assert 0 < int8["relative_error"] < 0.01, name
        assert entry["ours"]["lowrank"]["ratio"] > 100
        # One fp32 midpoint more per block, and never more error on these zero-mean tensors.
        centered = entry["ours"]["int8_centered"]
        assert centered["ratio"] == pytest.approx(4 / (1 + 8 / 256))
        assert centered["relative_error"] <= int8["relative_error"] * 1.05, name
        # zstd is lossless; narrowed codes trade error for what zstd then saves.
        packed, narrowed = entry["ours"]["int8_zstd"], entry["ours"]["int8_codes15_zstd"]
        assert packed["relative_error"] == int8["relative_error"]
        assert packed["ratio"] >= int8["ratio"]
        assert narrowed["ratio"] > 1.4 * int8["ratio"], name
        assert int8["relative_error"] < narrowed["relative_error"] < 0.1, name
    outliers = tensors["activation_outliers"]["ours"]
    assert outliers["int8"]["relative_error"] < 0.5 * outliers["int8_flat"]["relative_error"]
