"""`swarmpipe bench fuzz-decoders`: a coverage-guided fuzz (atheris) of every decoder.

Each target of `decoder_targets.py` (the tensor wire form, each codec, a stage's state stream
into a joiner and into the coordinator's store, checkpoint files, a Forward call's messages,
every RPC request and MQTT payload) runs in a process of its own (`decoder_fuzz_child.py`)
for `--seconds`, starting from the committed seed corpus (tests/fuzz/corpus/<target>/, or the
seeds built afresh where the package has no tests folder) plus atheris's mutations. It prints
JSON per target: inputs run (decoded, refused with a documented error, skipped as not
parsing), crashes, hangs (an input over `--timeout-s`), memory overruns, and peak memory
beside the bound derived from the decoder's limits. A crash names the input libFuzzer saved;
`--keep DIR` keeps those and the corpus the fuzz grew.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MARK = "swarmpipe-fuzz:"
TIMEOUT_EXIT = 70
"""The fuzz process's exit code when an input ran past the time bound (libFuzzer's
`-timeout_exitcode`, set explicitly)."""
START_MARGIN_S = 60.0
"""Wall-clock allowance over a target's fuzzing time for its start (imports, seeds) and end."""
CORPUS_ROOT = Path(__file__).resolve().parent.parent / "tests" / "fuzz" / "corpus"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="fuzzing time per target (default 20)"
    )
    parser.add_argument(
        "--targets",
        help="comma-separated targets (default: all, and the codec target once per codec)",
    )
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed")
    parser.add_argument(
        "--timeout-s", type=int, default=10, help="an input taking longer is a hang (default 10)"
    )
    parser.add_argument("--keep", help="keep each target's grown corpus and crash inputs here")
    parser.add_argument("--out", help="write the JSON here too")


def all_targets() -> list[str]:
    """Every target, with the codec target once per codec after the mixed one."""
    from swarmpipe.bench.decoder_targets import TARGETS
    from swarmpipe.compression.registry import CODECS_BY_NAME

    return [*TARGETS, *(f"codec:{name}" for name in CODECS_BY_NAME)]


def corpus_dir(target: str, scratch: Path) -> Path:
    """The target's committed seed corpus, or its seeds written under `scratch`."""
    from swarmpipe.bench.decoder_seeds import seed_inputs
    from swarmpipe.bench.decoder_targets import input_hash

    committed = CORPUS_ROOT / target.partition(":")[0]
    if committed.is_dir() and any(committed.iterdir()):
        return committed
    folder = scratch / "seeds"
    folder.mkdir(parents=True, exist_ok=True)
    for data in seed_inputs(target):
        (folder / input_hash(data)).write_bytes(data)
    return folder


def fuzz_target(
    target: str,
    *,
    runs: int | None = None,
    seconds: float | None = None,
    seed: int = 1,
    timeout_s: int = 10,
    keep: Path | None = None,
) -> dict[str, Any]:
    """Fuzz one target for `runs` inputs (the seeds count) or `seconds`, in a subprocess."""
    from swarmpipe.bench.decoder_targets import MAX_INPUT_BYTES, get_target

    get_target(target)  # ValueError names the targets
    with tempfile.TemporaryDirectory(prefix="swarmpipe-fuzz-") as tmp:
        scratch = Path(keep) / target.replace(":", "-") if keep else Path(tmp)
        grown = scratch / "corpus"
        grown.mkdir(parents=True, exist_ok=True)
        counts = scratch / "counts"
        counts.write_bytes(b"")
        kept = scratch / "failing-input"
        kept.unlink(missing_ok=True)  # a kept folder's last run's
        flags = [
            f"-seed={seed}",
            f"-timeout={timeout_s}",
            # The exit code says "hang" even when libFuzzer's report line is lost.
            f"-timeout_exitcode={TIMEOUT_EXIT}",
            f"-max_len={MAX_INPUT_BYTES}",
            f"-artifact_prefix={scratch}/",
            "-print_final_stats=1",
        ]
        if runs is not None:
            flags.append(f"-runs={runs}")
        if seconds is not None:
            flags.append(f"-max_total_time={max(1, round(seconds))}")
        # New inputs go to the first folder: the committed corpus stays as it is.
        command = [sys.executable, "-m", "swarmpipe.bench.decoder_fuzz_child", target]
        command += [str(counts), *flags, str(grown), str(corpus_dir(target, scratch))]
        # Few malloc arenas: each thread's would reserve 64 MiB of the capped address space.
        env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
        wall = (seconds or 0) + (runs or 0) * 0.05 + START_MARGIN_S + 2 * timeout_s
        started = time.monotonic()
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        try:
            output, _ = child.communicate(timeout=wall)
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            output, _ = child.communicate()
            killed = True
        report = parse_output(output, child.returncode, counts.read_bytes())
        if report["crash_input"] is None and kept.exists():
            report["crash_input"] = str(kept)
        if report["crash_input"] and keep is None:
            # The folder goes with this call: the input itself goes in the report.
            report["crash_input_hex"] = Path(report["crash_input"]).read_bytes()[:4096].hex()
            report["crash_input"] = None
        report["target"] = target
        report["seconds"] = round(time.monotonic() - started, 1)
        if killed:
            report["hangs"] += 1
            report["problem"] = f"the fuzz process outlived its {wall:.0f} s and was killed"
        if report["problem"] and keep is None:
            report["output_tail"] = output[-3000:]
        return report


def parse_output(output: str, returncode: int | None, counts: bytes) -> dict[str, Any]:
    """What a child's output and counts file say: inputs, outcomes, memory, problems."""
    from swarmpipe.bench.decoder_fuzz_child import COUNTS

    start: dict[str, Any] = {}
    marks = []
    fuzzing_from_kib = 0
    jumps = []
    for line in output.splitlines():
        if line.startswith(f"{MARK} start "):
            start = json.loads(line.removeprefix(f"{MARK} start "))
        elif line.startswith(f"{MARK} fuzzing-from "):
            fuzzing_from_kib = int(line.split()[-1])
        elif line.startswith(f"{MARK} peak +"):
            jumps.append(int(line.split("+")[1].split()[0]))
        elif line.startswith(MARK):
            marks.append(line.removeprefix(MARK).strip())
    tallied = COUNTS.unpack(counts) if len(counts) == COUNTS.size else (0, 0, 0, 0)
    decoded, refused, skipped, peak_kib = tallied
    stats = dict(re.findall(r"^stat::(\w+):\s+(\d+)", output, re.M))
    artifact = re.search(r"Test unit written to (\S+)", output)
    # libFuzzer's alarm says so first; what it does next (a traceback through Python) can
    # end the process as an out-of-memory under the address-space cap, exit 71, not 70.
    hang = (
        "libFuzzer: timeout" in output
        or returncode == TIMEOUT_EXIT
        or "ALARM: working on the last Unit" in output
    )
    out_of_memory = not hang and (
        "libFuzzer: out-of-memory" in output or any(m.startswith("memory ") for m in marks)
    )
    crashed = not out_of_memory and (
        any(m.startswith(("crash ", "wrong-result ")) for m in marks)
        or "Uncaught Python exception" in output
    )
    problem = marks[0] if marks else None
    if hang:
        problem = "an input ran past the time bound"
    elif out_of_memory and problem is None:
        problem = "the process ran past its memory bound"
    elif returncode not in (0, None) and problem is None:
        problem = f"the fuzz process exited with {returncode}"
    # The child's own VmHWM: libFuzzer's peak_rss_mb is ru_maxrss, which starts at the
    # parent's peak (see decoder_fuzz_child).
    peak_mb = peak_kib >> 10
    # From after libFuzzer's own setup (its first input), when that line came.
    baseline_mb = (fuzzing_from_kib or start.get("baseline_rss_kib", 0)) / 1024
    return {
        "inputs": int(stats.get("number_of_executed_units", decoded + refused + skipped)),
        "decoded": decoded,
        "refused": refused,
        "skipped_unparsable": skipped,
        "new_corpus_units": int(stats.get("new_units_added", 0)),
        "crashes": int(crashed),
        "hangs": int(hang),
        "memory_overruns": int(out_of_memory),
        "baseline_rss_mb": round(baseline_mb, 1),
        "peak_rss_mb": peak_mb,
        "peak_growth_mb": round(max(0.0, peak_mb - baseline_mb), 1),
        "largest_one_input_rise_mb": round(max(jumps, default=0) / 1024, 1),
        "memory_bound_mb": round(start.get("memory_bound_bytes", 0) / (1 << 20), 1),
        # What was enforced: the bound plus the harness's slack.
        "rss_limit_mb": start.get("rss_limit_mb"),
        "problem": problem,
        "crash_input": artifact.group(1) if artifact else None,
        "returncode": returncode,
    }


def serve(args: argparse.Namespace) -> int:
    from swarmpipe.bench.decoder_targets import get_target

    targets = args.targets.split(",") if args.targets else all_targets()
    for name in targets:
        try:
            get_target(name)
        except ValueError as exc:
            raise SystemExit(f"swarmpipe bench fuzz-decoders: {exc}") from None
    if args.seconds <= 0:
        raise SystemExit("swarmpipe bench fuzz-decoders: --seconds must be > 0")
    if args.timeout_s < 1:
        raise SystemExit("swarmpipe bench fuzz-decoders: --timeout-s must be >= 1")
    keep = Path(args.keep) if args.keep else None
    results = {}
    for name in targets:
        results[name] = fuzz_target(
            name, seconds=args.seconds, seed=args.seed, timeout_s=args.timeout_s, keep=keep
        )
        print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)
    result = {
        "seconds_per_target": args.seconds,
        "seed": args.seed,
        "timeout_s": args.timeout_s,
        "targets": results,
        "inputs": sum(r["inputs"] for r in results.values()),
        "crashes": sum(r["crashes"] for r in results.values()),
        "hangs": sum(r["hangs"] for r in results.values()),
        "memory_overruns": sum(r["memory_overruns"] for r in results.values()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
