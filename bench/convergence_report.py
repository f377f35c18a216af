"""The tables of `swarmpipe bench convergence`: rows from runs, comparisons, Markdown.

`aggregate` folds the runs (one per setting and seed) into one row per setting;
`summarise` compares each row with lossless and with its twin, seed by seed;
`markdown_table` renders what README.md's Convergence section shows. All are pure functions
of the result's JSON, so a merged result renders exactly as a trained one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from swarmpipe.bench.convergence_run import WIRE


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One row per setting from its finished runs (one per seed): the mean held-out loss,
    each seed's, and the mean curve over the seeds that finished. Its bytes are the newest
    wire's among its runs (bytes depend on the setting and the header, not on the seed)."""
    rows: dict[str, dict[str, Any]] = {}
    for run in sorted(runs, key=lambda r: (-r.get("wire", 1), r["seed"])):
        name = run["setting"]["name"]
        row = rows.setdefault(
            name,
            {
                "setting": run["setting"],
                "eval_loss_per_seed": {},
                "curves": [],
                "bytes_per_token_per_hop": run["bytes_per_token_per_hop"],
                "wire": run.get("wire", 1),
                "hops": run["hops"],
                "parameters": run["parameters"],
                "seconds": 0.0,
            },
        )
        row["eval_loss_per_seed"][str(run["seed"])] = run["eval_loss"]
        row["curves"].append(run["eval_curve"])
        row["seconds"] += run["seconds"]
    for row in rows.values():
        row["eval_loss_per_seed"] = dict(
            sorted(row["eval_loss_per_seed"].items(), key=lambda item: int(item[0]))
        )
        losses = list(row["eval_loss_per_seed"].values())
        row["eval_loss"] = sum(losses) / len(losses)
        curves = row.pop("curves")
        row["eval_curve"] = [
            (points[0][0], sum(p[1] for p in points) / len(points))
            for points in zip(*curves, strict=True)
        ]
    return rows


def _paired(row: dict[str, Any], base: dict[str, Any]) -> list[float]:
    """`row`'s held-out loss relative to `base`'s, for each seed both finished."""
    mine, theirs = row["eval_loss_per_seed"], base["eval_loss_per_seed"]
    return [mine[seed] / theirs[seed] - 1 for seed in mine if seed in theirs]


def twins_of(settings: Sequence[dict[str, Any]], d_model: int) -> dict[int, str]:
    """The twin row of each `recent` (model.bottleneck_recent): the first full-width row (in
    `settings`' order) that re-embeds as many tokens. Rows written before `recent` existed
    re-embedded one."""
    twins: dict[int, str] = {}
    for setting in settings:
        if setting["bottleneck"] == d_model:
            twins.setdefault(setting.get("recent", 1), setting["name"])
    return twins


def summarise(
    rows: dict[str, dict[str, Any]], order: Sequence[str], twins: dict[int, str]
) -> dict[str, dict[str, Any]]:
    """Per finished row: eval loss relative to lossless and to its twin (seed by seed, then
    the mean and the range over seeds), bytes ratio to lossless. A bottleneck row's twin is
    the one of `twins` (see twins_of) that re-embeds as many tokens after each boundary.

    The activation figure a bottleneck saves is the tensor plus the token ids it needs.
    """
    base = rows.get("lossless")
    out: dict[str, dict[str, Any]] = {}
    for name in order:
        row = rows.get(name)
        if row is None:
            continue
        b = row["bytes_per_token_per_hop"]
        entry: dict[str, Any] = {"activation_with_ids": b["activation"] + b["token_ids"]}
        comparisons = [("lossless", base)]
        twin = twins.get(row["setting"].get("recent", 1))
        if row["setting"]["bottleneck"] and twin is not None:
            comparisons.append(("twin", rows.get(twin)))
        for label, other in comparisons:
            ratios = _paired(row, other) if other is not None else []
            if ratios:
                entry[f"eval_loss_vs_{label}"] = sum(ratios) / len(ratios)
                entry[f"eval_loss_vs_{label}_range"] = [min(ratios), max(ratios)]
        if base is not None:
            bb = base["bytes_per_token_per_hop"]
            entry["activation_reduction_vs_lossless"] = bb["activation"] / (
                b["activation"] + b["token_ids"]
            )
            entry["gradient_reduction_vs_lossless"] = bb["gradient"] / b["gradient"]
        out[name] = entry
    return out


def markdown_table(result: dict[str, Any]) -> str:
    """The table README.md's Convergence section shows, from a result of `serve`."""
    lines = [
        "| setting | k | held-out loss | vs lossless | vs twin "
        "| activation B/token | token-id B/token | gradient B/token | activation bytes ÷ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in result["order"]:
        row = result["settings"].get(name)
        if row is None:
            continue
        b = row["bytes_per_token_per_hop"]
        s = result["summary"][name]

        def pct(key: str, s: dict[str, Any] = s) -> str:
            if key not in s:
                return "—"
            low, high = s[f"{key}_range"]
            spread = f" ({100 * low:+.1f} to {100 * high:+.1f})" if low != high else ""
            return f"{100 * s[key]:+.2f}%{spread}"

        reduction = s.get("activation_reduction_vs_lossless")
        losses = row["eval_loss_per_seed"]
        loss = f"{row['eval_loss']:.4f}" + (
            f" ({min(losses.values()):.4f} to {max(losses.values()):.4f}, {len(losses)} seeds)"
            if len(losses) > 1
            else ""
        )
        lines.append(
            f"| {name} | {row['setting']['bottleneck'] or '—'} | {loss} "
            f"| {pct('eval_loss_vs_lossless')} | {pct('eval_loss_vs_twin')} "
            f"| {b['activation']:.2f} | {b['token_ids']:.2f} | {b['gradient']:.2f} "
            f"| {f'{reduction:.1f}x' if reduction is not None else '—'} |"
        )
    # The held-out curve, mean over each row's seeds: where settings part, not only the end.
    steps = sorted({step for row in result["settings"].values() for step, _ in row["eval_curve"]})
    curves = ["", "| setting | " + " | ".join(f"step {step}" for step in steps) + " |"]
    curves.append("|---" * (len(steps) + 1) + "|")
    for name in result["order"]:
        row = result["settings"].get(name)
        if row is not None:
            at = dict(row["eval_curve"])
            cells = [f"{at[step]:.4f}" if step in at else "—" for step in steps]
            curves.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += curves
    notes = list(result["notes"])
    notes.append("the second table: held-out loss at each evaluation, mean over the row's seeds")
    labels = [
        r["bytes_per_token_per_hop"]["microbatch_header"] for r in result["settings"].values()
    ]
    if labels:
        notes.append(
            "every setting also sends the labels in the microbatch header "
            f"(about {min(labels):.2f} B/token per hop without token ids)"
        )
    if any(r.get("wire", 1) < WIRE for r in result.get("runs", [])):
        notes.append(
            "some runs measured their bytes under an older header (int32 labels, every token "
            "id); a row's bytes are its newest runs', and training is the same under both"
        )
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def brief(result: dict[str, Any]) -> dict[str, Any]:
    """`result` without the per-step losses, which the file keeps."""
    return {
        **result,
        "runs": [{k: v for k, v in run.items() if k != "train_losses"} for run in result["runs"]],
    }
