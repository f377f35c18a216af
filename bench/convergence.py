"""`swarmpipe bench convergence`: held-out loss after N steps per codec at every stage boundary.

Each setting trains the same model, data order and global batch in one process,
with every stage a real `StageRuntime` (the node's own forward, backward and
AdamW code) and every hop between stages through the wire form exactly as a
node sends it: activations `encode_tensor` then `decode_tensor` on the way
down, the activation gradients the same on the way up. No network and no
scheduling, so the only difference between settings is what the codecs (and
the bottleneck's architecture) do to the numbers, and a long run fits on one
core. Settings: the codecs (`lossless`, `fp16`, `int8`, `int4`, `lowrank` once
registered), the learned bottleneck `model.bottleneck=k` composed with a codec,
and its full-width twin (k = d_model, lossless): the fair baseline for the
bottleneck, since re-adding token embeddings changes the model too.

Bytes per token are what crosses one hop per token, header included: the
tensor (its TensorHeader plus payload) each way and, with the bottleneck, the
first token id of each sample in the MicrobatchHeader (the other ids are the
labels shifted by one). Labels (one byte a token, in every setting alike) are
reported apart. Writes `convergence.json` and `convergence.md` into
`--out` after each finished setting (so a long run can be read before it
ends) and prints the JSON at the end.

One seed is one trajectory: any change to the numbers crossing a boundary (fp16's
included) sends training down another path, and on the default model two paths end a
few percent apart after 2000 steps whatever the codec. `--seeds N` trains every
setting with N seeds (`train.seed` and the next N - 1: initial weights and sample
order) and compares settings seed by seed: "vs lossless" is the mean over seeds of
each seed's ratio to lossless with that seed, beside its range.

Rows of int8 and int4 are named with how they round (`pipeline.stochastic_rounding`).
`--merge a.json b.json` trains nothing: it combines the runs of earlier results (other
seeds, other rows, other machines) into one table, refusing results whose model, data,
steps or training settings differ.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from swarmpipe.bench.convergence_merge import merge_results
from swarmpipe.bench.convergence_report import (
    aggregate,
    brief,
    markdown_table,
    summarise,
    twins_of,
)
from swarmpipe.bench.convergence_run import check_device, train_all
from swarmpipe.bench.convergence_settings import SETTING_KINDS, build_settings
from swarmpipe.config import add_config_arguments, load_config

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per setting")
    parser.add_argument(
        "--settings",
        default=",".join(SETTING_KINDS),
        help=f"comma-separated rows, trained in this order, from {', '.join(SETTING_KINDS)}",
    )
    parser.add_argument(
        "--bottleneck", type=int, default=4, help="width k of the bottleneck row's boundary"
    )
    parser.add_argument(
        "--bottleneck-codec", default="int8", help="codec the bottleneck row composes with"
    )
    parser.add_argument(
        "--bottleneck-gradient-codec",
        default=None,
        help="codec of the bottleneck row's activation gradients (default: --bottleneck-codec); "
        "the table's byte ratio counts activations, so the two directions may differ",
    )
    parser.add_argument(
        "--bottleneck-recent",
        type=int,
        default=1,
        help="latest tokens the stage after each boundary re-embeds from the ids it has, in "
        "the bottleneck and twin rows (model.bottleneck_recent; 1: the token itself)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=500, help="held-out evaluation every N steps (0: end)"
    )
    parser.add_argument(
        "--eval-samples", type=int, default=2048, help="held-out samples per evaluation"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="seeds per setting (train.seed and the next ones); comparisons pair them",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs (setting, seed) trained at once (processes)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per job")
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device the stages train on (cpu, cuda, cuda:1): a run on a GPU takes a "
        "different but equally valid path, like another seed",
    )
    parser.add_argument(
        "--out", default="bench-results/convergence", help="directory for the JSON and Markdown"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="train nothing: combine the runs of these convergence.json files (other seeds, "
        "other settings, other machines; same model, data and steps) into one table in --out",
    )
    add_config_arguments(parser, with_file=False)


def _merge(args: argparse.Namespace) -> int:
    results = []
    for name in args.merge:
        try:
            results.append((name, json.loads(Path(name).read_text())))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--merge {name}: cannot read it as JSON ({exc})") from None
    result = merge_results(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps(result, indent=2))
    (out / "convergence.md").write_text(markdown_table(result))
    print(json.dumps(brief(result), indent=2))
    return 0


def serve(args: argparse.Namespace) -> int:
    from swarmpipe.data import Corpus

    if args.merge:
        return _merge(args)
    if min(args.steps, args.seeds, args.jobs, args.threads, args.eval_samples) < 1:
        raise SystemExit("--steps, --seeds, --jobs, --threads and --eval-samples must be >= 1")
    config = load_config(None, args.set)  # a bad --set fails here, before any work
    args.device = check_device(args.device)
    if config.model.bottleneck:
        raise SystemExit("leave model.bottleneck unset: the bottleneck and twin rows set it")
    if config.model.bottleneck_recent != 1:
        raise SystemExit(
            "leave model.bottleneck_recent unset: --bottleneck-recent sets it for the "
            "bottleneck and twin rows"
        )
    kinds = [k for k in args.settings.split(",") if k]
    settings, notes = build_settings(
        kinds,
        config.model.d_model,
        args.bottleneck,
        args.bottleneck_codec,
        config.pipeline.stochastic_rounding,
        bottleneck_gradient_codec=args.bottleneck_gradient_codec,
        centered=config.pipeline.int8_centered,
        zstd=config.pipeline.zstd,
        code_max=config.pipeline.activation_code_max,
        recent=args.bottleneck_recent,
    )
    if any(s.bottleneck for s in settings):  # validate k and the recent tokens
        load_config(
            None,
            [
                *args.set,
                f"model.bottleneck={args.bottleneck}",
                f"model.bottleneck_recent={args.bottleneck_recent}",
            ],
        )
    twins = twins_of([asdict(s) for s in settings], config.model.d_model)
    seeds = [config.train.seed + i for i in range(args.seeds)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "format": "swarmpipe.bench.convergence/2",
        "command": "swarmpipe bench convergence " + " ".join(_argv_of(args)),
        "model": json.loads(config.to_json())["model"],
        "train": json.loads(config.to_json())["train"],
        "stages": config.pipeline.stages,
        "block_size": config.pipeline.int8_block_size,
        "steps": args.steps,
        "eval_samples": args.eval_samples,
        # Which text: runs on another machine (another Python's standard library, the
        # default corpus) are not comparable, and --merge checks this.
        "corpus": Corpus.load(config.data, config.model.context, config.train.seed).fingerprint,
        "seeds": seeds,
        # The table's order is fixed; --settings orders the work (the first rows finish first).
        "order": [s.name for s in sorted(settings, key=lambda s: SETTING_KINDS.index(s.kind))],
        "notes": notes,
        "runs": [],
        "settings": {},
        "summary": {},
        "complete": False,
    }

    def record(run: dict[str, Any]) -> None:
        result["runs"].append(run)
        result["settings"] = aggregate(result["runs"])
        result["summary"] = summarise(result["settings"], result["order"], twins)
        result["complete"] = len(result["runs"]) == len(settings) * len(seeds)
        (out / "convergence.json").write_text(json.dumps(result, indent=2))
        (out / "convergence.md").write_text(markdown_table(result))
        logger.info(
            "%s seed %d done: eval loss %.4f", run["setting"]["name"], run["seed"], run["eval_loss"]
        )

    # Seed-major: with several seeds, every setting's first seed finishes first.
    plan = [(setting, seed) for seed in seeds for setting in settings]
    for run in train_all(
        args.set,
        plan,
        jobs=args.jobs,
        threads=args.threads,
        steps=args.steps,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        device=args.device,
    ):
        record(run)
    print(json.dumps(brief(result), indent=2))
    return 0


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The flags this run was given, to record how to reproduce it."""
    argv = [
        f"--steps {args.steps}",
        f"--settings {args.settings}",
        f"--bottleneck {args.bottleneck}",
        f"--bottleneck-codec {args.bottleneck_codec}",
        *(
            [f"--bottleneck-gradient-codec {args.bottleneck_gradient_codec}"]
            if args.bottleneck_gradient_codec is not None
            else []
        ),
        *([f"--bottleneck-recent {args.bottleneck_recent}"] if args.bottleneck_recent != 1 else []),
        f"--eval-every {args.eval_every}",
        f"--eval-samples {args.eval_samples}",
        f"--seeds {args.seeds}",
    ]
    if args.device != "cpu":
        argv.append(f"--device {args.device}")
    return argv + [f"--set {s}" for s in args.set]
