"""The `swarmpipe` command: coordinator, node, testnet, bench and link-limit subcommands.

Errors the user can act on (SwarmpipeError) print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
from collections.abc import Sequence

from swarmpipe.errors import ConfigError, CoordinatorUnavailable, SwarmpipeError

EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_COORDINATOR_UNREACHABLE = 3


def build_parser() -> argparse.ArgumentParser:
    from swarmpipe.bench import main as bench_main
    from swarmpipe.control import link_control
    from swarmpipe.coordinator import main as coordinator_main
    from swarmpipe.node import main as node_main
    from swarmpipe.testnet import main as testnet_main

    parser = argparse.ArgumentParser(prog="swarmpipe", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module, help_text in (
        ("coordinator", coordinator_main, "run the coordinator (embeds an MQTT broker)"),
        ("node", node_main, "run a node daemon that serves one pipeline stage"),
        ("testnet", testnet_main, "run a local swarm of processes and write a report"),
        ("bench", bench_main, "print benchmark figures as JSON"),
        ("link-limit", link_control, "change nodes' send limits while a run goes on"),
    ):
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(serve=module.serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from swarmpipe.process.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, who=args.command)
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
    except SwarmpipeError as exc:
        print(f"swarmpipe {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
