"""One decoder fuzz target under atheris, in a process of its own (`fuzz_decoders` starts it).

    python -m swarmpipe.bench.decoder_fuzz_child TARGET COUNTS_FILE [libFuzzer flags...]

atheris runs libFuzzer's loop in this process and ends it with exit() on the first crash,
hang (-timeout) or memory overrun, so each target gets a process and the parent reads
what happened from its output. swarmpipe's modules are imported under
`atheris.instrument_imports`, so the fuzzer is guided by coverage of our decoders (torch and
protobuf are not instrumented: their code is not what is under test).

Memory is bounded twice, both from the target's `memory_bound` (derived from the limits its
decoder is given): after the target is built and its seeds ran once, the address space is
capped at what the process then has plus the bound, so an allocation bomb fails there and
then (MemoryError, or torch's "can't allocate memory"), and a watch thread here catches
memory that is allocated and touched bit by bit (resident memory past the baseline plus the
bound ends the process, exit RSS_EXIT, with the input kept).

Memory is read from /proc/self/status (VmRSS, VmHWM), never from getrusage's ru_maxrss:
Linux carries ru_maxrss over from the process that started this one (a fork's copy of the
parent's pages counts, and exec keeps the figure), so a child of a large test session
"starts" at the session's peak. libFuzzer's own -rss_limit_mb reads that figure, fired on
inputs that allocate nothing, and is switched off here for that reason.

Per input, what the target did (decoded, refused, skipped) is counted in COUNTS_FILE, a small
mmapped file, because libFuzzer exits without running Python's exit handlers.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import struct
import sys
import threading
import time
from pathlib import Path

import atheris  # type: ignore[import-untyped]  # ships no type information

COUNTS = struct.Struct("<QQQQ")
"""COUNTS_FILE: inputs decoded, refused with a documented error, and skipped (not messages
our request parser lets through, so never handed to the decoder); then the process's peak
resident memory in KiB (VmHWM) after the last input."""
RSS_EXIT = 72
"""The exit code when resident memory ran past the limit (the watch thread's doing)."""
WATCH_EVERY_S = 0.1
"""How often the watch thread reads resident memory."""
MARK = "swarmpipe-fuzz:"
"""Prefix of the lines the parent reads."""
JUMP_KIB = 2 << 10
"""A rise of the peak RSS by more than this in one input is reported, and the input kept:
libFuzzer's own tables grow in smaller steps, so a rise this large is the input's doing."""
SLACK_BYTES = 256 << 20
"""Address space over the bound for what any input costs the harness: a thread's stack and
malloc arena (asyncio.to_thread), libFuzzer's own tables."""


def _status_kib(field: str) -> int:
    with open("/proc/self/status", "rb") as status:
        for line in status:
            if line.startswith(field.encode() + b":"):
                return int(line.split()[1])
    return 0


def _watch_rss(limit_kib: int, current: list[bytes], failing: Path) -> None:
    """End the process when resident memory passes `limit_kib`, keeping the input at work."""
    while True:
        time.sleep(WATCH_EVERY_S)
        rss = _status_kib("VmRSS")
        if rss > limit_kib:
            failing.write_bytes(current[0])
            line = f"{MARK} memory resident {rss >> 10} MiB past the limit of {limit_kib >> 10} MiB"
            print(line, file=sys.stderr, flush=True)
            os._exit(RSS_EXIT)


def main(argv: list[str]) -> None:
    name, counts_path, *flags = argv[1:]
    with atheris.instrument_imports(include=["swarmpipe"]):
        from swarmpipe.bench import decoder_targets
        from swarmpipe.bench.decoder_seeds import seed_inputs
        from swarmpipe.bench.decoder_targets import get_target

        target = get_target(name)
        run = target.make()
    import torch

    torch.set_num_threads(1)
    for seed in seed_inputs(name):  # warm every path the seeds reach before the caps
        run(seed)
    failing = Path(counts_path).with_name("failing-input")
    counts_file = open(counts_path, "r+b")  # mapped until the process ends
    counts_file.truncate(COUNTS.size)
    counts = mmap.mmap(counts_file.fileno(), COUNTS.size)
    tally = [0, 0, 0]
    peaks = [_status_kib("VmHWM")]
    current = [b""]
    refusals = target.refusals
    crash_types = (decoder_targets.Crash,)

    def one_input(data: bytes) -> None:
        current[0] = data
        try:
            decoded = run(data)
        except refusals:
            tally[1] += 1
        except BaseException as exc:
            kind = "memory" if _is_allocation_failure(exc) else "crash"
            if isinstance(exc, crash_types):
                kind = "wrong-result"
            print(f"{MARK} {kind} {type(exc).__name__}: {str(exc)[:500]}", file=sys.stderr)
            # Kept here too: libFuzzer writes its copy after atheris prints the traceback,
            # and its periodic timeout alarm can end the process in between.
            failing.write_bytes(data)
            raise
        else:
            tally[0 if decoded else 2] += 1
        peak = _status_kib("VmHWM")
        COUNTS.pack_into(counts, 0, *tally, peak)
        if sum(tally) == 1:
            # libFuzzer sets up its tables (some 25 MiB) around the first input, which is
            # empty: the decoders' growth is measured from after it.
            print(f"{MARK} fuzzing-from {peak}", file=sys.stderr, flush=True)
        elif peak - peaks[0] > JUMP_KIB:
            # The input that raised the process's peak most: what the memory figure is about.
            Path(counts_path).with_name("peak-input").write_bytes(data)
            print(f"{MARK} peak +{peak - peaks[0]} KiB", file=sys.stderr, flush=True)
        peaks[0] = peak

    baseline_kib = _status_kib("VmRSS")
    address_space = _status_kib("VmSize") * 1024 + target.memory_bound + SLACK_BYTES
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or address_space < hard:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, hard))
    rss_limit_mb = (baseline_kib * 1024 + target.memory_bound + SLACK_BYTES) >> 20
    watch = threading.Thread(
        target=_watch_rss, args=(rss_limit_mb << 10, current, failing), daemon=True
    )
    watch.start()
    info = {
        "target": name,
        "baseline_rss_kib": baseline_kib,
        "memory_bound_bytes": target.memory_bound,
        "rss_limit_mb": rss_limit_mb,
    }
    print(f"{MARK} start {json.dumps(info)}", file=sys.stderr, flush=True)
    from swarmpipe.bench.field_mutator import mutate_fields

    def mutate(data: bytes, max_size: int, seed: int) -> bytes:
        # Half the time one protobuf field, to a hostile value that still parses; the
        # other half (and where that finds nothing to change) libFuzzer's byte mutations.
        if seed % 2:
            try:
                mutated = mutate_fields(data, max_size, seed, target.record_type)
            except BaseException as exc:  # the harness's own bug, not the decoder's
                print(f"{MARK} harness-error {type(exc).__name__}: {exc}", file=sys.stderr)
                raise
            if mutated is not None:
                return mutated
        result: bytes = atheris.Mutate(data, max_size)
        return result

    # libFuzzer's RSS limit reads ru_maxrss (see the module's docstring): the thread above
    # does its job.
    atheris.Setup([argv[0], "-rss_limit_mb=0", *flags], one_input, custom_mutator=mutate)
    atheris.Fuzz()


def _is_allocation_failure(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "allocate" in str(exc)
    )


if __name__ == "__main__":
    main(sys.argv)
