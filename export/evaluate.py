"""`swarmpipe eval`: an exported model's held-out loss, measured as the run measured it.

The same held-out samples (the first train.eval_samples of the run's corpus) and the
same mean token loss as the run's evaluations (`model.reference.evaluate`), so the
figure compares with the report's `evals` at the exported step. Prints one JSON object:
model, run_id, step, samples, loss, and the corpus's fingerprint (the default corpus is
the running Python's standard library, so another machine may hold other text; data.paths
are read as the run's config names them, relative paths from the current folder).
"""

from __future__ import annotations

import argparse


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"evaluate at least 1 sample, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a file `swarmpipe export` wrote")
    parser.add_argument(
        "--samples",
        type=_count,
        help="held-out samples to evaluate (default: the run's train.eval_samples)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def serve(args: argparse.Namespace) -> int:
    import json

    import torch

    from swarmpipe.data import Corpus
    from swarmpipe.model.exported import load_exported, read_exported_info
    from swarmpipe.model.reference import evaluate

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    info = read_exported_info(args.model)
    model = load_exported(args.model)
    config = info.config
    count = args.samples or config.train.eval_samples
    corpus = Corpus.load(config.data, config.model.context, config.train.seed)
    loss = evaluate(model, corpus, count)
    result = {
        "model": str(args.model),
        "run_id": info.run_id,
        "step": info.step,
        "samples": min(count, corpus.n_holdout),
        "loss": loss,
        "corpus": corpus.fingerprint,
    }
    print(json.dumps(result))
    return 0
