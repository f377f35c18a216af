"""The decoder fuzz (issue 22) at a small budget: every target, from its committed corpus.

Each target runs in its own process under atheris for `RUNS` inputs: the committed seeds
(tests/fuzz/corpus/<target>/, inputs that once crashed a decoder among them) and then
mutations, all with a fixed libFuzzer seed. Any exception but the decoder's documented
refusals, an input over the time bound or memory past the bound fails the test, naming the
input. `swarmpipe bench fuzz-decoders --seconds N` runs the same targets for longer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarmpipe.bench.decoder_seeds import seed_inputs
from swarmpipe.bench.decoder_targets import TARGETS, get_target
from swarmpipe.bench.fuzz_decoders import CORPUS_ROOT, fuzz_target

RUNS = 500
"""Inputs per target, seeds included: most of each test's two seconds is the start (torch)."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", list(TARGETS))
def test_decoder_survives_its_corpus_and_mutations(target: str, tmp_path: Path) -> None:
    report = fuzz_target(target, runs=RUNS, seed=22, timeout_s=20, keep=tmp_path)
    crash = report["crash_input"]
    detail = (report["problem"], crash and Path(crash).read_bytes()[:2000])
    assert report["crashes"] == 0, detail
    assert report["hangs"] == 0, detail
    assert report["memory_overruns"] == 0, detail
    assert report["inputs"] == RUNS, report
    # No one input raised the peak past what the decoder's limits allow.
    assert report["largest_one_input_rise_mb"] <= report["memory_bound_mb"], report
    # The seeds decode, and the mutations reach the decoder rather than dying in parsing.
    assert report["decoded"] >= len(seed_inputs(target)), report
    assert report["refused"] > 0, report


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("how", "field", "problem"),
    [
        ("crash", "crashes", "crash KeyError"),
        ("hang", "hangs", "an input ran past the time bound"),
        ("memory", "memory_overruns", "memory RuntimeError"),
        ("leak", "memory_overruns", "memory resident"),
    ],
)
def test_the_harness_reports_a_crash_a_hang_and_a_memory_bomb(
    how: str, field: str, problem: str, tmp_path: Path
) -> None:
    # The hang's input takes forever: a 1 s bound finds it at once.
    timeout_s = 1 if how == "hang" else 20
    report = fuzz_target(f"misbehave-{how}", runs=RUNS, seed=22, timeout_s=timeout_s, keep=tmp_path)
    summary = {k: report.get(k) for k in ("inputs", "problem", "returncode", "seconds")}
    assert report[field] == 1, (summary, report.get("output_tail"))
    assert sum(report[f] for f in ("crashes", "hangs", "memory_overruns")) == 1, report
    assert report["problem"].startswith(problem), report
    assert report["crash_input"] and len(Path(report["crash_input"]).read_bytes()) >= 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_large_parent_does_not_make_the_child_look_large(tmp_path: Path) -> None:
    # Linux hands a child its parent's peak RSS as its own ru_maxrss: in CI the harness runs
    # from a test session of gigabytes, and libFuzzer's RSS limit (which reads ru_maxrss)
    # once ended the hang check as "out of memory" before any input ran long.
    script = (
        "import json, sys\n"
        "ballast = bytearray(2 << 30)\n"
        "ballast[::4096] = b'\\1' * len(range(0, len(ballast), 4096))\n"
        "from swarmpipe.bench.fuzz_decoders import fuzz_target\n"
        "r = fuzz_target('misbehave-hang', runs=50, seed=22, timeout_s=1, keep=sys.argv[1])\n"
        "print(json.dumps(r))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["hangs"], report["memory_overruns"]) == (1, 0), report
    # The peak is the child's own, far under the 2 GiB its parent held.
    assert report["peak_rss_mb"] < 1024, report


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_committed_input_is_handled_as_documented(target: str) -> None:
    # In this process, without atheris: seeds decode and committed crash inputs are refused.
    run = get_target(target).make()
    folder = CORPUS_ROOT / target
    files = sorted(folder.iterdir())
    assert any(f.name.startswith("seed-") for f in files), folder
    for path in files:
        if path.name.startswith("seed-"):
            assert run(path.read_bytes()), path
        else:
            try:
                run(path.read_bytes())
            except get_target(target).refusals:
                pass
