"""`swarmpipe generate`: text sampled from an exported byte-level model.

The prompt's UTF-8 bytes are the first tokens; each next byte is drawn from the model's
distribution (divided by --temperature, cut to the --top-k most likely), the same for the
same --seed. Prints the prompt and what follows, decoded as UTF-8 (a byte sequence that
is not valid UTF-8 shows as U+FFFD).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from swarmpipe.errors import ConfigError

BYTE_VOCAB = 256


def _non_negative(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not value >= 0:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a file `swarmpipe export` wrote")
    parser.add_argument("--prompt", required=True, help="text to continue, e.g. 'def '")
    parser.add_argument(
        "--tokens", type=_non_negative(int), default=200, help="bytes to generate (200)"
    )
    parser.add_argument(
        "--temperature",
        type=_non_negative(float),
        default=1.0,
        help="sharpens (<1) or flattens (>1) the distribution; 0 always takes the likeliest "
        "byte (1.0)",
    )
    parser.add_argument(
        "--top-k",
        type=_non_negative(int),
        default=0,
        help="sample among the k likeliest bytes only; 0 uses all (0)",
    )
    parser.add_argument("--seed", type=_non_negative(int), default=0, help="sampling seed (0)")
    parser.add_argument(
        "--threads",
        type=_non_negative(int),
        default=0,
        help="torch threads (0: torch's default; 1 is often fastest for a small model on a "
        "busy machine)",
    )


def serve(args: argparse.Namespace) -> int:
    import torch

    from swarmpipe.model.exported import load_exported, read_exported_info
    from swarmpipe.model.sampling import sample_tokens

    if args.threads:
        torch.set_num_threads(args.threads)

    prompt = args.prompt.encode("utf-8")
    if not prompt:
        raise ConfigError("--prompt is empty; give the model at least one character to continue")
    info = read_exported_info(args.model)
    vocab = info.config.model.vocab
    if vocab > BYTE_VOCAB:
        raise ConfigError(
            f"this model's vocabulary has {vocab} ids; generate samples byte-level models "
            f"(model.vocab={BYTE_VOCAB}) only"
        )
    if max(prompt) >= vocab:
        raise ConfigError(
            f"the prompt holds byte {max(prompt)}, outside this model's vocabulary of {vocab}"
        )
    model = load_exported(args.model)
    new = sample_tokens(
        model,
        list(prompt),
        context=info.config.model.context,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    sys.stdout.write((prompt + bytes(new)).decode("utf-8", errors="replace") + "\n")
    return 0
