"""How far honest gradients and noise fall from the tensor-scale screen's bound.

    PYTHONPATH=... .venv/bin/python scripts/tensor_scale_margins.py --steps 300 [--set K=V ...]

Trains the run's model in one process for `--steps` steps (the plain sum, so
single-process training), each step's microbatches dealt at random among three
replicas as a testnet leaves them to timing. Every replica's gradient sum with
traffic is cut into the stage slices of a 1-, 2- and 3-stage run (a stage's
parameters are a contiguous run of the whole model's, and a lossless pipeline's
stage gradient is the whole model's gradient there), and for each slice it
records `robust_reduce.flatness_sigmas`: how far above isotropic noise's the
spread of its tensors' mean squares is. Beside it, noise of the slice's norm
(node/hostile.py, as `SWARMPIPE_HOSTILE=noise` sends it) and AdamW's second
moment, the screen's other witness. Prints JSON per stage slice: the honest
minimum and low percentiles, how many honest contributions each candidate
bound would have dropped, and the noise's maximum.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import torch

from swarmpipe.config import load_config
from swarmpipe.data import Corpus
from swarmpipe.model.partition import token_loss_sum
from swarmpipe.node.hostile import Hostile
from swarmpipe.node.robust_reduce import flatness_sigmas, tensor_mean_squares
from swarmpipe.node.stage_runtime import StageRuntime

REPLICAS = ("n0", "n1", "n2")
BOUNDS = (3.0, 5.0, 10.0, 20.0, 50.0)


def stage_slices(overrides: list[str], max_stages: int) -> list[tuple[str, int, int]]:
    """(name, first tensor, tensor count) of every stage of 1..max_stages-stage cuts."""
    out = []
    for stages in range(1, max_stages + 1):
        config = load_config(None, [*overrides, f"pipeline.stages={stages}"])
        first = 0
        for stage in range(stages):
            count = len(list(StageRuntime(config, stage).module.parameters()))
            out.append((f"{stages} stages, stage {stage}", first, count))
            first += count
    return out


def summary(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    if not ordered:
        return {"count": 0}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {
        "count": len(ordered),
        "min": round(ordered[0], 2),
        "p01": at(0.01),
        "p10": at(0.10),
        "median": at(0.5),
        "max": round(ordered[-1], 2),
    }


def measure(overrides: list[str], steps: int, max_stages: int, seed: int) -> dict[str, Any]:
    config = load_config(None, [*overrides, "pipeline.stages=1"])
    runtime = StageRuntime(config, 0)
    sizes = [p.numel() for p in runtime.module.parameters()]
    slices = stage_slices(overrides, max_stages)
    corpus = Corpus.load(config.data, config.model.context, config.train.seed)
    train = config.train
    dealer = random.Random(seed)
    honest: dict[str, list[float]] = {name: [] for name, _, _ in slices}
    noise: dict[str, list[float]] = {name: [] for name, _, _ in slices}
    moment: dict[str, list[float]] = {name: [] for name, _, _ in slices}
    lowest: dict[str, tuple[float, int]] = {}
    for step in range(steps):
        sums: dict[str, torch.Tensor] = {}
        tokens: dict[str, int] = {}
        for offset in range(0, train.global_batch, train.microbatch):
            count = min(train.microbatch, train.global_batch - offset)
            x, y = corpus.samples(step * train.global_batch + offset, count)
            runtime.module.zero_grad(set_to_none=True)
            token_loss_sum(runtime.module(x), y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in runtime.module.parameters()])
            node = dealer.choice(REPLICAS)
            sums[node] = sums.get(node, torch.zeros_like(flat, dtype=torch.float64)) + flat
            tokens[node] = tokens.get(node, 0) + y.numel()
        runtime.module.zero_grad(set_to_none=True)
        second = None
        state = runtime.optimizer.state
        if state:
            second = torch.cat(
                [state[p]["exp_avg_sq"].reshape(-1) for p in runtime.module.parameters()]
            )
        for name, first, count in slices:
            part = sizes[first : first + count]
            start = sum(sizes[:first])
            for node, total in sorted(sums.items()):
                flat = total.float()[start : start + sum(part)]
                z = flatness_sigmas(tensor_mean_squares(flat, part), part)
                if z is None:  # fewer than two nonzero tensors: not judged
                    continue
                honest[name].append(z)
                if name not in lowest or z < lowest[name][0]:
                    lowest[name] = (z, step)
                fake = Hostile("noise").tamper(flat, node_id=node, step=step)
                z = flatness_sigmas(tensor_mean_squares(fake, part), part)
                noise[name].append(z if z is not None else float("nan"))
            if second is not None:
                squares = second[start : start + sum(part)].double()
                means = [float(c.mean()) for c in torch.split(squares, part)]
                z = flatness_sigmas(means, part)
                if z is not None:
                    moment[name].append(z)
        total_tokens = sum(tokens.values())
        summed = sum(sums.values(), torch.zeros_like(next(iter(sums.values()))))
        runtime.apply_step(step, (summed.float(), total_tokens, train.global_batch))
    return {
        name: {
            "tensors": count,
            "honest": summary(honest[name]),
            "honest_lowest_at_step": lowest[name][1],
            "honest_below": {f"{b:g}": sum(z < b for z in honest[name]) for b in BOUNDS},
            "noise": summary(noise[name]),
            "second_moment": summary(moment[name]),
        }
        for name, _, count in slices
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stages", type=int, default=3, help="cuts of 1 to this many stages")
    parser.add_argument("--seed", type=int, default=0, help="dealing of microbatches")
    parser.add_argument("--set", action="append", default=[], help="config KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(measure(args.set, args.steps, args.stages, args.seed), indent=1))


if __name__ == "__main__":
    main()
