"""`swarmpipe bench stage-balance`: each stage's measured compute for the cost model's cut,
beside the cut into equal layer counts, and the model's predicted shares beside the
measured ones.

A stage's time is one microbatch's forward and backward (the last stage with its loss), the
median of `--repeats` after a warm-up, on this machine's CPU (or `--device`). Each repeat
times every stage of both cuts in turn, so a burst of load from elsewhere on a shared machine
lands on all of them rather than on whichever stage ran then. `imbalance` is
the slowest stage over the mean: 1.0 is a perfectly even pipeline, and the pipeline's
throughput is bounded by the slowest stage, so `speedup_bound` (equal counts' slowest stage
over the cost cut's) is what the cut can gain. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from swarmpipe.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--stages", type=int, default=3, help="pipeline stages (default 3)")
    parser.add_argument("--microbatch", type=int, default=8, help="samples per timed microbatch")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per stage (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one per node)")
    parser.add_argument("--device", default="cpu", help="where to time: cpu, cuda or cuda:N")


def serve(args: argparse.Namespace) -> int:
    import torch

    from swarmpipe.config import load_config
    from swarmpipe.errors import ConfigError
    from swarmpipe.model.partition import stage_layer_ranges
    from swarmpipe.model.stage_cost import gpt_layer_costs, gpt_stage_ranges
    from swarmpipe.node.device import resolve_device

    if min(args.stages, args.microbatch, args.repeats, args.threads) < 1:
        raise ConfigError("--stages, --microbatch, --repeats and --threads must be >= 1")
    config = load_config(None, [*args.set, f"pipeline.stages={args.stages}"])
    if config.model.factory or config.model.bottleneck:
        raise ConfigError("stage-balance times the built-in GPT without a bottleneck")
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    m = config.model
    costs = gpt_layer_costs(m)
    cuts = {
        "cost_model": gpt_stage_ranges(m, args.stages),
        "equal_layers": stage_layer_ranges(m.n_layers + 2, args.stages),
    }
    result: dict[str, Any] = {
        "model": {
            "preset": m.preset,
            "n_layers": m.n_layers,
            "d_model": m.d_model,
            "context": m.context,
        },
        "stages": args.stages,
        "microbatch": args.microbatch,
        "device": str(device),
        "threads": args.threads,
    }
    runners = {
        name: [_stage_runner(config, r, args, device) for r in ranges]
        for name, ranges in cuts.items()
    }
    times: dict[str, list[list[float]]] = {name: [[] for _ in rs] for name, rs in cuts.items()}
    for stage_runs in runners.values():
        for run in stage_runs:
            run()  # warm-up: allocator, kernels
    for _ in range(args.repeats):
        for name, stage_runs in runners.items():
            for i, run in enumerate(stage_runs):
                start = time.perf_counter()
                run()
                times[name][i].append(time.perf_counter() - start)
    for name, ranges in cuts.items():
        seconds = [statistics.median(t) for t in times[name]]
        predicted = [sum(costs[i] for i in r) for r in ranges]
        result[name] = {
            "layers": [[r.start, r.stop] for r in ranges],
            "seconds": [round(s, 5) for s in seconds],
            "measured_share": [round(s / sum(seconds), 4) for s in seconds],
            "predicted_share": [round(p / sum(predicted), 4) for p in predicted],
            "imbalance": round(max(seconds) / statistics.mean(seconds), 3),
        }
    shares = result["cost_model"]
    result["model_error"] = round(
        max(
            abs(a - b)
            for a, b in zip(shares["measured_share"], shares["predicted_share"], strict=True)
        ),
        4,
    )
    result["speedup_bound"] = round(
        max(result["equal_layers"]["seconds"]) / max(shares["seconds"]), 3
    )
    print(json.dumps(result, indent=2))
    return 0


def _stage_runner(
    config: Any, layers: range, args: argparse.Namespace, device: Any
) -> Callable[[], None]:
    """One microbatch's forward and backward through these layers, as a call to time."""
    import torch

    from swarmpipe.model.gpt import build_gpt_layer
    from swarmpipe.model.partition import StageModule, token_loss_sum

    m = config.model
    module = StageModule(*(build_gpt_layer(m, i, config.train.seed) for i in layers)).to(device)
    first, last = layers.start == 0, layers.stop == m.n_layers + 2
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(m.vocab, (args.microbatch, m.context), generator=gen).to(device)
    acts = torch.randn(args.microbatch, m.context, m.d_model, generator=gen).to(device)

    def once() -> None:
        x = tokens if first else acts.detach().requires_grad_(True)
        out = module(x)
        if last:
            torch.autograd.backward(token_loss_sum(out, tokens))
        else:
            torch.autograd.backward(out, torch.ones_like(out))
        module.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return once
