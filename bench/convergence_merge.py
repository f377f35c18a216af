"""`swarmpipe bench convergence --merge`: one result from the runs of several.

Runs trained apart (other seeds, other rows, other machines) combine into one table only
when they trained the same model on the same data for the same steps; `merge_results`
refuses anything else, naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from swarmpipe.bench.convergence_report import aggregate, summarise, twins_of
from swarmpipe.bench.convergence_settings import SETTING_KINDS

MERGE_MUST_MATCH = ("format", "model", "corpus", "stages", "block_size", "steps", "eval_samples")
"""Fields of a result that every file `--merge` combines must share (and `train` but its seed)."""


def _comparable(result: dict[str, Any], key: str) -> Any:
    """`result[key]` as merge compares it: a model written before one of today's model
    options existed trained with that option's default, so the default fills it in."""
    value = result.get(key)
    if key == "model" and isinstance(value, dict):
        from swarmpipe.config import ModelConfig

        value = {f.name: f.default for f in fields(ModelConfig)} | value
    return value


def merge_results(results: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One result from the runs of several (named source, result) pairs: rows ordered as the
    table orders them, each run marked with the command that trained it.

    SystemExit, naming the file, if two results trained different models, data or step
    counts, or both hold the same setting and seed: a table must compare like with like.
    """
    if not results:
        raise SystemExit("--merge needs at least one convergence.json")
    first_name, first = results[0]

    def train_but_seed(result: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in result.get("train", {}).items() if k != "seed"}

    runs: list[dict[str, Any]] = []
    seen: dict[tuple[str, int], str] = {}
    for name, result in results:
        if result.get("format") != first.get("format") or "runs" not in result:
            raise SystemExit(
                f"{name}: format {result.get('format')!r}; --merge reads "
                f"{first.get('format')!r} results (written by bench convergence --seeds)"
            )
        for key in MERGE_MUST_MATCH:
            mine, theirs = _comparable(result, key), _comparable(first, key)
            if mine != theirs:
                raise SystemExit(
                    f"{name}: {key} is {mine!r} but {first_name} has "
                    f"{theirs!r}; only runs of the same model, data and steps compare"
                )
        if train_but_seed(result) != train_but_seed(first):
            raise SystemExit(
                f"{name}: train settings other than the seed differ from {first_name}'s"
            )
        for run in result["runs"]:
            row, seed = run["setting"]["name"], run["seed"]
            if (row, seed) in seen:
                raise SystemExit(
                    f"{name}: {row!r} seed {seed} is also in {seen[row, seed]}; "
                    "keep one of the two runs"
                )
            seen[row, seed] = name
            runs.append({**run, "source": run.get("source", result.get("command", name))})
    settings_by_name = {run["setting"]["name"]: run["setting"] for run in runs}
    for setting_name in settings_by_name:
        points = {
            tuple(step for step, _ in run["eval_curve"])
            for run in runs
            if run["setting"]["name"] == setting_name
        }
        if len(points) > 1:
            raise SystemExit(
                f"{setting_name!r}: its runs were evaluated at different steps "
                f"({sorted(points)}); merge runs made with the same --eval-every"
            )
    # Table order: by kind as SETTING_KINDS lists them, then as the files listed the rows.
    listed = [n for _, result in results for n in result.get("order", [])]
    listed += [n for n in settings_by_name if n not in listed]
    order = sorted(
        dict.fromkeys(n for n in listed if n in settings_by_name),
        key=lambda n: SETTING_KINDS.index(settings_by_name[n]["kind"]),
    )
    twins = twins_of([settings_by_name[n] for n in order], first["model"]["d_model"])
    rows = aggregate(runs)
    return {
        **{key: _comparable(first, key) for key in MERGE_MUST_MATCH},
        "command": "swarmpipe bench convergence --merge " + " ".join(name for name, _ in results),
        "train": first["train"],
        "seeds": sorted({run["seed"] for run in runs}),
        "order": order,
        "notes": list(dict.fromkeys(n for _, result in results for n in result.get("notes", []))),
        "runs": runs,
        "settings": rows,
        "summary": summarise(rows, order, twins),
        "complete": all(result.get("complete", False) for _, result in results),
    }
