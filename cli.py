"""The `swarmpipe` command: run a swarm (coordinator, node, testnet), then use its model.

Errors the user can act on (SwarmpipeError) print one line, never a traceback. A
subcommand's module is imported only when the command line names it (see
process/subcommands.py), so `swarmpipe --help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
from collections.abc import Sequence

from swarmpipe.errors import ConfigError, CoordinatorUnavailable, NotAdmitted, SwarmpipeError
from swarmpipe.process.logs import LOG_FORMATS
from swarmpipe.process.subcommands import Subcommand, add_subcommands

EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_COORDINATOR_UNREACHABLE = 3
EXIT_NOT_ADMITTED = 4
"""A node refused by the run: no valid join token, or its token was revoked."""


COMMANDS: dict[str, Subcommand] = {
    "coordinator": Subcommand(
        module="swarmpipe.coordinator.main", help="run the coordinator (embeds an MQTT broker)"
    ),
    "node": Subcommand(
        module="swarmpipe.node.main", help="run a node daemon that serves one pipeline stage"
    ),
    "testnet": Subcommand(
        module="swarmpipe.testnet.main", help="run a local swarm of processes and write a report"
    ),
    "bench": Subcommand(module="swarmpipe.bench.main", help="print benchmark figures as JSON"),
    "link-limit": Subcommand(
        module="swarmpipe.control.link_control",
        help="change nodes' send limits while a run goes on",
    ),
    "export": Subcommand(
        module="swarmpipe.export.main",
        help="assemble a run's stage checkpoints into one safetensors model file",
    ),
    "eval": Subcommand(
        module="swarmpipe.export.evaluate",
        help="print an exported model's held-out loss as JSON",
    ),
    "generate": Subcommand(
        module="swarmpipe.export.generate", help="sample text from an exported model"
    ),
    "status": Subcommand(
        module="swarmpipe.control.admin",
        attribute="StatusCommand",
        help="show a run's stages, replicas, bottleneck, links, step and loss (--watch, --json)",
    ),
    "drain": Subcommand(
        module="swarmpipe.control.admin",
        attribute="DrainCommand",
        help="move a node's work away and make it leave the run",
    ),
    "move": Subcommand(
        module="swarmpipe.control.admin",
        attribute="MoveCommand",
        help="send a node to another stage (an operator's override)",
    ),
    "token": Subcommand(
        module="swarmpipe.coordinator.token_cli",
        help="create, list or revoke a run's join tokens (in the coordinator's --state-dir)",
    ),
    "broker-config": Subcommand(
        module="swarmpipe.coordinator.broker_config",
        help="write a mosquitto passwd, acl and conf that enforce a run's MQTT rules",
    ),
    "simulate": Subcommand(
        module="swarmpipe.coordinator.simulate",
        help="run placement and rebalancing over a synthetic swarm and print JSON",
    ),
}
"""Each subcommand's module, imported only when the command line names it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmpipe", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines (default), or one JSON object a line with the node id and stage",
    )
    add_subcommands(parser, COMMANDS, dest="command", serve_dest="serve")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from swarmpipe.process.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, who=args.command, fmt=args.log_format)
    try:
        result = args.serve(args)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return int(result)
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        print(f"swarmpipe {args.command}: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except CoordinatorUnavailable as exc:
        print(f"swarmpipe {args.command}: {exc}", file=sys.stderr)
        return EXIT_COORDINATOR_UNREACHABLE
    except NotAdmitted as exc:
        print(f"swarmpipe {args.command}: not admitted: {exc}", file=sys.stderr)
        return EXIT_NOT_ADMITTED
    except SwarmpipeError as exc:
        print(f"swarmpipe {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
