"""`swarmpipe bench fuzz-rpc`: a raw-bytes fuzz of every RPC of a coordinator and a node.

Starts a coordinator and one node on 127.0.0.1 (two stages, so with one node no step opens
and the node only answers), lists each server's services through server reflection, and
sends every method `--inputs` seeded inputs: random bytes and a valid request mutated
(truncated, bits flipped, a huge length prefix, an over-long varint), plus the valid request
itself as a control, on a raw channel with a deadline per call. It prints JSON: per method
the calls, the status codes seen (all, and for the inputs that do not parse), hangs and
whether health answered SERVING after; per process whether it is alive, its peak memory
(VmHWM, restarted from the current RSS before the fuzz, so it is the fuzz's peak) beside the
bound the servers' message limit gives (`memory_bound_bytes`), and what the fuzz added to its
log (lines, tracebacks, lines per method). A message that does not parse should be
INVALID_ARGUMENT and cost at most a line per method per 10 s. `--target 127.0.0.1:PORT`
fuzzes a server already running instead.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from swarmpipe.config import add_config_arguments

START_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inputs", type=int, default=500, help="inputs per method")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    parser.add_argument(
        "--deadline-s", type=float, default=2.0, help="deadline of each call (long polls)"
    )
    parser.add_argument("--in-flight", type=int, default=8, help="calls in flight at once")
    parser.add_argument(
        "--max-seconds", type=float, default=600.0, help="stop sending inputs after this long"
    )
    parser.add_argument(
        "--target", help="fuzz this running server (127.0.0.1:PORT) instead of starting two"
    )
    parser.add_argument(
        "--state-dir",
        help="with --target: the run's coordinator state dir, to sign a credential that gets "
        "the fuzz past admission (without one, every call but health is UNAUTHENTICATED)",
    )
    parser.add_argument(
        "--target-kind",
        choices=("coordinator", "node"),
        default="node",
        help="with --target and --state-dir: which kind of server it is (default: node)",
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--out", help="write the JSON here too")


def peak_memory_kib(pid: int) -> dict[str, int]:
    """The process's peak and current resident memory (VmHWM, VmRSS) in KiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0])
    return fields


def reset_peak_memory(pid: int) -> bool:
    """Restart the process's VmHWM from its current RSS (Linux: "5" to clear_refs), so the
    peak read after the fuzz is the fuzz's and not the start's; False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_bound_bytes(in_flight: int) -> int:
    """How much resident memory the fuzz's calls may add to a server, from its limits.

    At most `in_flight` calls are open at once, and no message of one is over the servers'
    MAX_MESSAGE_BYTES (transport/rpc.py). A message is held at most four times while its
    call is open: grpc's buffer, the bytes our parser reads, the parsed message, and its
    tensor chunk copied into the buffer TensorAssembler reserves (which is reserved at the
    header's size, up to MAX_TENSOR_BYTES, but only resident as far as chunks fill it).
    Each call holds at most one message at a time, since our servicers read them in turn."""
    from swarmpipe.transport.rpc import MAX_MESSAGE_BYTES

    return in_flight * 4 * MAX_MESSAGE_BYTES


def _memory_report(pid: int, before: dict[str, int], reset: bool, in_flight: int) -> dict[str, Any]:
    after = peak_memory_kib(pid)
    bound_kib = memory_bound_bytes(in_flight) // 1024
    # With the peak reset, VmHWM after is the fuzz's peak; without, it may be the start's.
    growth_kib = after["VmHWM"] - (before["VmRSS"] if reset else before["VmHWM"])
    return {
        "peak_rss_kib": after["VmHWM"],
        "rss_before_kib": before["VmRSS"],
        "peak_reset_before_fuzz": reset,
        "peak_growth_kib": max(0, growth_kib),
        "growth_bound_kib": bound_kib,
        "within_bound": growth_kib <= bound_kib,
    }


def _shape(line: str) -> str:
    """A log line without its time, quoted values and numbers, so lines alike count as one."""
    text = line.split(" ", 2)[-1]  # after the date and the time
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    return re.sub(r"\d+", "N", text)[:160]


def log_added(text: str, methods: list[str]) -> dict[str, Any]:
    """What a stretch of a daemon's log holds: lines, tracebacks, lines naming each method,
    and the most common lines by shape."""
    lines = text.splitlines()
    return {
        "lines": len(lines),
        "tracebacks": sum("Traceback" in line for line in lines),
        "lines_per_method": {
            m: n for m in methods if (n := sum(bool(re.search(rf"{m}\b", x)) for x in lines))
        },
        "common_lines": dict(Counter(_shape(x) for x in lines).most_common(8)),
    }


async def fuzz_process(
    target: str, *, pid: int | None = None, log_path: Path | None = None, **budget: Any
) -> dict[str, Any]:
    """Fuzz one server (`budget`: `rpc_fuzzer.fuzz_server`'s keywords); with its pid and log,
    also its memory and what its log gained."""
    from swarmpipe.bench.rpc_fuzzer import fuzz_server

    reset = reset_peak_memory(pid) if pid else False
    before = peak_memory_kib(pid) if pid else {}
    log_start = log_path.stat().st_size if log_path else 0
    results = await fuzz_server(target, **budget)
    report: dict[str, Any] = {
        "target": target,
        "methods": {path: r.as_json() for path, r in results.items()},
        "calls": sum(r.calls for r in results.values()),
        "hangs": sum(r.hangs for r in results.values()),
        "unknown_or_internal_for_unparsable": sum(
            r.as_json()["unknown_or_internal_for_unparsable"] for r in results.values()
        ),
        "healthy_after_every_method": all(r.healthy_after for r in results.values()),
    }
    if pid:
        alive = Path(f"/proc/{pid}/status").exists()
        report["alive"] = alive
        report["memory_kib_before"] = before
        report["memory_kib_after"] = peak_memory_kib(pid) if alive else {}
        if alive:
            report["memory"] = _memory_report(pid, before, reset, budget["in_flight"])
    if log_path:
        with open(log_path, errors="replace") as log:
            log.seek(log_start)
            report["log"] = log_added(log.read(), list(results))
    return report


def fuzz_credentials(state_dir: Path) -> dict[str, tuple[tuple[str, str], ...]]:
    """Metadata that the servers of the run in `state_dir` admit, signed with its run key:
    a node credential for the coordinator (whose node API takes nodes only), a coordinator
    credential for a node (whose Stage server takes only the plan's nodes and the
    coordinator's), both with the organiser's token for Status, Drain and Move."""
    from swarmpipe.transport.auth import (
        ADMIN_TOKEN_KEY,
        CREDENTIAL_KEY,
        ROLE_COORDINATOR,
        ROLE_NODE,
        RunKey,
    )

    (run_id,) = [p.name for p in (state_dir / "checkpoints").iterdir()]
    key = RunKey.load_or_create(state_dir, run_id)
    admin = (ADMIN_TOKEN_KEY, (state_dir / "admin-token").read_text().strip())
    return {
        "coordinator": ((CREDENTIAL_KEY, key.issue("fuzzer", role=ROLE_NODE)), admin),
        "node": ((CREDENTIAL_KEY, key.issue("fuzzer", role=ROLE_COORDINATOR)), admin),
    }


def _budget(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "inputs": args.inputs,
        "seed": args.seed,
        "deadline_s": args.deadline_s,
        "in_flight": args.in_flight,
        "max_seconds": args.max_seconds,
    }


async def _fuzz_started(args: argparse.Namespace) -> dict[str, Any]:
    from swarmpipe.testnet.processes import ProcessGroup

    with tempfile.TemporaryDirectory(prefix="swarmpipe-bench-fuzz-") as tmp:
        group = ProcessGroup(Path(tmp))
        try:
            coordinator, ready, node, info = group.coordinator_and_node(
                list(args.set), START_TIMEOUT_S
            )
            coord_target = f"127.0.0.1:{ready['grpc_port']}"
            metadata = fuzz_credentials(Path(tmp) / "state")
            return {
                "coordinator": await fuzz_process(
                    coord_target,
                    pid=coordinator.popen.pid,
                    log_path=coordinator.log_path,
                    metadata=metadata["coordinator"],
                    **_budget(args),
                ),
                "node": await fuzz_process(
                    f"127.0.0.1:{info['grpc_port']}",
                    pid=int(info["pid"]),
                    log_path=node.log_path,
                    metadata=metadata["node"],
                    **_budget(args),
                ),
            }
        finally:
            group.stop_all()


def serve(args: argparse.Namespace) -> int:
    import asyncio

    from swarmpipe.bench.rpc_fuzzer import check_target

    if args.target:
        check_target(args.target)
        metadata = (
            fuzz_credentials(Path(args.state_dir))[args.target_kind] if args.state_dir else ()
        )
        servers = {
            "target": asyncio.run(fuzz_process(args.target, metadata=metadata, **_budget(args)))
        }
    else:
        servers = asyncio.run(_fuzz_started(args))
    result = {
        "inputs_per_method": args.inputs,
        "seed": args.seed,
        "deadline_s": args.deadline_s,
        "servers": servers,
        "calls": sum(s["calls"] for s in servers.values()),
        "crashes": sum(not s.get("alive", True) for s in servers.values()),
        "hangs": sum(s["hangs"] for s in servers.values()),
        "unknown_or_internal_for_unparsable": sum(
            s["unknown_or_internal_for_unparsable"] for s in servers.values()
        ),
        "inputs_per_endpoint": {
            f"{name}{path}": method["calls"]
            for name, s in servers.items()
            for path, method in s["methods"].items()
        },
        "peak_memory": {name: s["memory"] for name, s in servers.items() if "memory" in s},
        "memory_bound": "growth of VmHWM over the RSS before the fuzz <= in_flight x 4 x "
        "MAX_MESSAGE_BYTES (transport/rpc.py): each open call holds one message at most four "
        "times (grpc's buffer, our bytes, parsed, copied into a tensor buffer)",
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
