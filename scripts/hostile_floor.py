"""How close to a clean run any drop-based defence can keep a hostile replica's loss curve.

    PYTHONPATH=... .venv/bin/python scripts/hostile_floor.py --steps 30 --seeds 3 [--set K=V ...]

An offline replay of `bench hostile` in one process: the one-stage model of the
run's config, each step's microbatches (the samples the coordinator leases at
that step) dealt at random among three replicas, each replica's gradient sum
combined by `robust_reduce.aggregate` as the nodes combine it, and the same
AdamW step applied (StageRuntime.apply_step). Which replica gets which microbatch
is the one thing a testnet leaves to timing; here a seed picks it. It prints
JSON, one entry per seed and policy, each beside `clean`:

- clean: three honest replicas (what `bench hostile` runs as its clean run);
- clean_again: the same with another dealing of the microbatches, which is how
  two clean testnets of one seed differ: the floor of any comparison of runs;
- single: the plain sum of every gradient, single-process training;
- drop: n2 honest, but its contribution dropped whenever it has traffic until
  the coordinator's rule (coordinator/suspects.py) benches it, on the first
  verdict as for a conclusive one: the floor of any defence that drops what it
  catches, even one that catches it at once;
- noise: n2 sends noise of its gradient's norm (node/hostile.py) and the
  screens of the run's config judge it.

Figures are the per-step relative difference of the loss from clean's: mean,
max, the steps past 2 %, and the mean over the last four; each drop is listed
as (step, sender, the start of the screen's reason), and each step at which the centred
clip shortened a contribution as (step, senders).
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import torch

from swarmpipe.config import load_config
from swarmpipe.coordinator.suspects import REDUCE, Suspects
from swarmpipe.data import Corpus
from swarmpipe.model.partition import token_loss_sum
from swarmpipe.node.hostile import Hostile
from swarmpipe.node.replica_sync import gradient_momentum
from swarmpipe.node.robust_reduce import Contribution, aggregate, plain_sum
from swarmpipe.node.stage_runtime import StageRuntime

NODES = ("n0", "n1", "n2")
HOSTILE = "n2"
POLICIES = ("clean", "clean_again", "single", "drop", "noise")


def replay(overrides: list[str], steps: int, policy: str, seed: int) -> dict[str, Any]:
    """One run under `policy`: its loss per step, the drops and the bench."""
    config = load_config(None, ["pipeline.stages=1", *overrides])
    robust = config.robust
    runtime = StageRuntime(config, 0)
    sizes = [p.numel() for p in runtime.module.parameters()]
    corpus = Corpus.load(config.data, config.model.context, config.train.seed)
    train = config.train
    dealer = random.Random(seed + (1000 if policy == "clean_again" else 0))
    suspects = Suspects(bench_s=1e9, verdicts=robust.bench_verdicts)
    benched: dict[str, int] = {}
    losses: list[float] = []
    drops: list[tuple[int, str, str]] = []
    clipped: list[tuple[int, tuple[str, ...]]] = []
    for step in range(steps):
        serving = [n for n in NODES if n not in benched]
        sums: dict[str, list[Contribution]] = {n: [] for n in serving}
        loss_sum, tokens = 0.0, 0
        for offset in range(0, train.global_batch, train.microbatch):
            count = min(train.microbatch, train.global_batch - offset)
            x, y = corpus.samples(step * train.global_batch + offset, count)
            runtime.module.zero_grad(set_to_none=True)
            loss = token_loss_sum(runtime.module(x), y)
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in runtime.module.parameters()])
            sums[dealer.choice(serving)].append((flat.double(), y.numel(), count))
            loss_sum += float(loss.detach())
            tokens += y.numel()
        runtime.module.zero_grad(set_to_none=True)
        losses.append(loss_sum / tokens)
        contributions: dict[str, Contribution] = {}
        for node, parts in sums.items():
            total = sum(
                (p[0] for p in parts), torch.zeros(runtime.n_parameters, dtype=torch.float64)
            )
            contributions[node] = (
                total.float(),
                sum(p[1] for p in parts),
                sum(p[2] for p in parts),
            )
        if policy == "single":
            runtime.apply_step(step, plain_sum(contributions))
            continue
        dropped: set[str] = set()
        if HOSTILE in contributions and contributions[HOSTILE][1] > 0:
            flat, t, s = contributions[HOSTILE]
            if policy == "noise":
                contributions[HOSTILE] = (
                    Hostile("noise").tamper(flat, node_id=HOSTILE, step=step),
                    t,
                    s,
                )
            elif policy == "drop":
                dropped.add(HOSTILE)
        result = aggregate(
            {n: c for n, c in contributions.items() if n not in dropped},
            per="tokens",
            norm_ratio=robust.reduce_norm_ratio,
            clip_radius=robust.clip_radius,
            clip_iterations=robust.clip_iterations,
            direction_sigmas=robust.direction_sigmas,
            reference=gradient_momentum(runtime),
            profile=gradient_momentum(runtime, "exp_avg_sq"),
            sizes=sizes,
            tensor_sigmas=robust.tensor_sigmas,
        )
        runtime.apply_step(step, result.total)
        if result.clipped:
            clipped.append((step, result.clipped))
        for suspect in sorted(dropped | set(result.rejected)):
            # Which screen: an honest replica dropped in a clean replay is a false drop.
            drops.append((step, suspect, result.rejected.get(suspect, "the policy")[:48]))
            for reporter in (n for n in serving if n != suspect):
                peers = set(serving) - {suspect}
                entry = suspects.report(
                    reporter=reporter,
                    suspect=suspect,
                    step=step,
                    kind=REDUCE,
                    reason="",
                    stage=0,
                    stage_peers=peers,
                    now=0.0,
                    # The policy's drop stands for a defence sure at once.
                    conclusive=suspect in dropped or suspect in result.conclusive,
                )
                if entry is not None:
                    benched[suspect] = step
    return {"losses": losses, "dropped_at": drops, "clipped_at": clipped, "benched": benched}


def compare(losses: list[float], clean: list[float]) -> dict[str, Any]:
    diffs = [abs(a - b) / b for a, b in zip(losses, clean, strict=True)]
    return {
        "mean": sum(diffs) / len(diffs),
        "max": max(diffs),
        "steps_over_2_percent": [i for i, d in enumerate(diffs) if d > 0.02],
        "mean_last_4": sum(diffs[-4:]) / len(diffs[-4:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3, help="dealings of microbatches")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--set", action="append", default=[], help="config KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # As bench hostile: the direction screen on unless a --set says otherwise.
    overrides = ["robust.direction_sigmas=3", *args.set]
    out: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        runs = {p: replay(overrides, args.steps, p, seed) for p in args.policies.split(",")}
        clean = runs["clean"]["losses"]
        for policy, run in runs.items():
            out.append(
                {
                    "seed": seed,
                    "policy": policy,
                    **compare(run["losses"], clean),
                    "dropped_at": run["dropped_at"],
                    "clipped_at": run.get("clipped_at", []),
                    "benched": run["benched"],
                    "losses": [round(x, 4) for x in run["losses"]],
                }
            )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
