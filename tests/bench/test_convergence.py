"""The convergence benchmark's simulated boundaries do exactly what the pipeline does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmpipe.bench.convergence_merge import merge_results
from swarmpipe.bench.convergence_report import aggregate, summarise
from swarmpipe.bench.convergence_run import SimulatedPipeline
from swarmpipe.bench.convergence_settings import BoundarySetting, build_settings, rounding_label
from swarmpipe.compression import CODECS_BY_NAME, decode_tensor, encode_tensor
from swarmpipe.config import load_config
from swarmpipe.data import Corpus
from swarmpipe.model import build_stage, token_loss_sum
from swarmpipe.model.reference import train_single_process

SMALL = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.context=16",
    "train.global_batch=8",
    "train.microbatch=4",
    "data.max_bytes=2000000",
]


def _setting(codec: str, bottleneck: int = 0, recent: int = 1) -> BoundarySetting:
    return BoundarySetting(
        kind="x",
        name="x",
        activation_codec=codec,
        gradient_codec=codec,
        bottleneck=bottleneck,
        recent=recent,
    )


@pytest.mark.parametrize(("bottleneck", "recent"), [(0, 1), (4, 1), (32, 1), (4, 3)])
def test_lossless_simulation_matches_single_process_training(bottleneck: int, recent: int) -> None:
    pipe = SimulatedPipeline(SMALL, _setting("lossless", bottleneck, recent))
    assert pipe.config.model.bottleneck_recent == recent
    corpus = Corpus.load(pipe.config.data, 16, 0)
    simulated = [pipe.train_step(step, corpus) for step in range(5)]
    baseline = train_single_process(
        load_config(
            None, [*SMALL, f"model.bottleneck={bottleneck}", f"model.bottleneck_recent={recent}"]
        ),
        steps=5,
    )
    assert baseline[-1] < baseline[0], "the baseline did not learn; the test means nothing"
    for got, want in zip(simulated, baseline, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", ["lossless", "int8"])
def test_a_gpu_run_starts_from_the_cpu_weights_and_trains_alike(codec: str) -> None:
    corpus = Corpus.load(load_config(None, SMALL).data, 16, 0)
    overrides = [*SMALL, "pipeline.stochastic_rounding=[]"]
    cpu = SimulatedPipeline(overrides, _setting(codec, 4))
    gpu = SimulatedPipeline(overrides, _setting(codec, 4), "cuda")
    for a, b in zip(cpu.runtimes, gpu.runtimes, strict=True):
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            assert q.is_cuda and torch.equal(p, q.cpu())
    losses = [(cpu.train_step(step, corpus), gpu.train_step(step, corpus)) for step in range(3)]
    for c, g in losses:
        assert abs(c - g) < 1e-2 * c, losses
    # The same shapes and codecs, so the same bytes up to the few a checksum's varint varies.
    for kind, n in cpu.bytes_per_token().items():
        assert gpu.bytes_per_token()[kind] == pytest.approx(n, rel=1e-3)
    assert abs(cpu.evaluate(corpus, 8) - gpu.evaluate(corpus, 8)) < 2e-2


def test_an_int8_boundary_sends_decode_of_encode_both_ways() -> None:
    """One microbatch through 2 stages by hand, the codec on each hop, against the simulation.

    Rounding to nearest, so the hand-made hops round exactly as the simulated ones."""
    overrides = [*SMALL, "pipeline.stages=2", "pipeline.stochastic_rounding=[]"]
    pipe = SimulatedPipeline(overrides, _setting("int8"))
    config = load_config(None, overrides)
    tokens, labels = Corpus.load(config.data, 16, 0).samples(0, 4)

    def wire(t: torch.Tensor) -> torch.Tensor:
        return decode_tensor(*encode_tensor(t, "int8", block_size=256))

    first, second = build_stage(config, 0), build_stage(config, 1)
    out = first(tokens)
    received = wire(out.detach()).requires_grad_(True)
    loss = token_loss_sum(second(received), labels)
    loss.backward()
    assert received.grad is not None
    out.backward(wire(received.grad))

    loss_sum, n_tokens = pipe.microbatch("0:0:4", tokens, labels)
    assert n_tokens == labels.numel()
    assert loss_sum == pytest.approx(float(loss.detach()), rel=1e-6)
    lossless = token_loss_sum(second(out.detach()), labels).detach()
    assert abs(float(lossless) - loss_sum) > 1e-6, "int8 changed nothing: the test means nothing"
    ours = pipe.runtimes[0].gradient_sum()
    theirs = [p.grad for p in first.parameters()]
    for a, b in zip(ours, theirs, strict=True):
        assert a is not None and b is not None
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)


def test_bytes_per_token_count_tensors_labels_and_first_token_ids() -> None:
    corpus = Corpus.load(load_config(None, SMALL).data, 16, 0)
    plain = SimulatedPipeline(SMALL, _setting("lossless"))
    plain.train_step(0, corpus)
    narrow = SimulatedPipeline(SMALL, _setting("int8", 4))
    narrow.train_step(0, corpus)
    p, n = plain.bytes_per_token(), narrow.bytes_per_token()
    # fp32 at d_model 32 is 128 bytes a token; headers add a little.
    assert 128 < p["activation"] < 130 and 128 < p["gradient"] < 130
    assert p["token_ids"] == 0
    assert 1 <= p["microbatch_header"] < 1.05  # labels, one byte a token
    # k = 4 int8 codes plus an fp32 scale per 256 of them, headers; one byte per sample of
    # 16 tokens for its first id (the others are the labels shifted), and the field's tag.
    assert 4 < n["activation"] < 4.5 and 4 < n["gradient"] < 4.5
    assert 1 / 16 < n["token_ids"] < 1 / 16 + 0.05
    assert n["microbatch_header"] == pytest.approx(p["microbatch_header"] + n["token_ids"])


def test_unregistered_codecs_are_skipped_with_a_note() -> None:
    settings, notes = build_settings(["lossless", "twin"], 32, 4, "int8")
    assert [s.name for s in settings] == ["lossless", "twin-k32-lossless"]
    assert notes == []
    with pytest.raises(SystemExit, match="unknown setting 'no-such'"):
        build_settings(["no-such"], 32, 4, "int8")
    settings, notes = build_settings(["lowrank", "bottleneck"], 32, 4, "int8")
    if "lowrank" in CODECS_BY_NAME:  # registered on another branch
        assert settings[0].name == "lowrank" and notes == []
    else:
        assert notes == ["lowrank: skipped, no codec of that name is registered in this build"]
    assert settings[-1].name == "bottleneck-k4-int8, nearest" and settings[-1].bottleneck == 4


def test_rows_are_named_with_how_their_codecs_round() -> None:
    kinds = ["lossless", "fp16", "int8", "int4", "bottleneck", "twin"]
    both, _ = build_settings(kinds, 32, 4, "int4", ["activation", "gradient"])
    assert [s.name for s in both] == ["lossless", "fp16", "int8, stochastic rounding",
        "int4, stochastic rounding", "bottleneck-k4-int4, stochastic rounding",
        "twin-k32-lossless"]  # fmt: skip
    nearest, _ = build_settings(kinds, 32, 4, "int8", ["reduce"])
    assert [s.name for s in nearest][2:5] == ["int8, nearest", "int4, nearest",
                                              "bottleneck-k4-int8, nearest"]  # fmt: skip
    assert rounding_label("int8", "int8", ["gradient"]) == ", stochastic rounding on gradients"
    assert rounding_label("lossless", "int8", ["activation"]) == ", nearest"
    assert rounding_label("lossless", "fp16", ["activation", "gradient"]) == ""


def test_rows_are_named_with_the_roles_their_codecs_centre() -> None:
    kinds = ["lossless", "int4", "bottleneck"]
    rows, _ = build_settings(kinds, 32, 8, "int4", ["gradient"], centered=["activation"])
    assert [r.name for r in rows] == ["lossless",
        "int4, centered activations, stochastic rounding on gradients",
        "bottleneck-k8-int4, centered activations, stochastic rounding on gradients"]  # fmt: skip
    both, _ = build_settings(["int8"], 32, 8, "int8", [], centered=["activation", "gradient"])
    assert both[0].name == "int8, centered activations and gradients, nearest"


def test_rows_are_named_with_the_roles_zstd_compresses() -> None:
    kinds = ["lossless", "bottleneck", "twin"]
    rows, _ = build_settings(kinds, 32, 8, "int4", ["gradient"], zstd=["activation"])
    assert [r.name for r in rows] == ["lossless, zstd activations",
        "bottleneck-k8-int4, zstd activations, stochastic rounding on gradients",
        "twin-k32-lossless, zstd activations"]  # fmt: skip
    (plain,), _ = build_settings(["int8"], 32, 8, "int8", [], zstd=[])
    assert plain.name == "int8, nearest"


def test_rows_are_named_with_their_narrowed_activation_codes() -> None:
    kinds = ["lossless", "int4", "int8", "bottleneck"]
    rows, _ = build_settings(kinds, 32, 8, "int8", [], zstd=["activation"], code_max=11)
    assert [r.name for r in rows] == ["lossless, zstd activations",
        "int4, zstd activations, nearest",  # 11 is past int4's own 7: nothing narrowed
        "int8, activation codes to 11, zstd activations, nearest",
        "bottleneck-k8-int8, activation codes to 11, zstd activations, nearest"]  # fmt: skip


def test_rows_are_named_with_the_tokens_their_boundaries_re_embed() -> None:
    kinds = ["lossless", "bottleneck", "twin"]
    roles = ["activation", "gradient"]
    rows, _ = build_settings(kinds, 32, 5, "int8", roles, zstd=["activation"], recent=4)
    assert [(r.name, r.recent) for r in rows] == [("lossless, zstd activations", 1),
        ("bottleneck-k5-int8, re-embeds the last 4 tokens, zstd activations, "
         "stochastic rounding", 4),
        ("twin-k32-lossless, re-embeds the last 4 tokens, zstd activations", 4)]  # fmt: skip
    (plain,), _ = build_settings(["bottleneck"], 32, 5, "int8", recent=1)
    assert plain.name == "bottleneck-k5-int8, nearest" and plain.recent == 1


def test_a_bottleneck_may_send_its_gradients_with_another_codec() -> None:
    (row,), _ = build_settings(
        ["bottleneck"], 32, 8, "int4", ["activation", "gradient"], bottleneck_gradient_codec="int8"
    )
    assert (row.activation_codec, row.gradient_codec) == ("int4", "int8")
    assert row.name == "bottleneck-k8-int4-grad-int8, stochastic rounding"
    (row,), _ = build_settings(
        ["bottleneck"], 32, 8, "int4", ["activation"], bottleneck_gradient_codec="lossless"
    )
    assert row.name == "bottleneck-k8-int4-grad-lossless, stochastic rounding"
    (same,), _ = build_settings(["bottleneck"], 32, 8, "int4", bottleneck_gradient_codec="int4")
    assert same.name == "bottleneck-k8-int4, nearest"  # naming the same codec twice is the default
    with pytest.raises(SystemExit, match="--bottleneck-gradient-codec 'int3'"):
        build_settings(["bottleneck"], 32, 8, "int4", bottleneck_gradient_codec="int3")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_command_writes_json_and_a_table_with_parallel_jobs(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "swarmpipe", "bench", "convergence", "--steps", "2",
           "--settings", "twin,lossless,bottleneck", "--jobs", "2", "--eval-every", "1",
           "--eval-samples", "8", "--seeds", "2", "--out", str(tmp_path)]  # fmt: skip
    for item in SMALL:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout)
    saved = json.loads((tmp_path / "convergence.json").read_text())
    assert saved["complete"] and printed["order"] == saved["order"]
    assert saved["order"] == ["lossless", "bottleneck-k4-int8, stochastic rounding",
                              "twin-k32-lossless"]  # fmt: skip
    assert saved["seeds"] == [0, 1] and len(saved["runs"]) == 6
    for run in saved["runs"]:
        assert len(run["train_losses"]) == 2 and [s for s, _ in run["eval_curve"]] == [1, 2]
    for row in saved["settings"].values():
        per_seed = row["eval_loss_per_seed"]
        assert set(per_seed) == {"0", "1"} and per_seed["0"] != per_seed["1"]  # other weights
        assert row["eval_loss"] == pytest.approx(sum(per_seed.values()) / 2)
        assert [s for s, _ in row["eval_curve"]] == [1, 2]
    summary = saved["summary"]["bottleneck-k4-int8, stochastic rounding"]
    assert summary["activation_reduction_vs_lossless"] > 20  # 128 B vs ~4 + 1 B per token
    assert "eval_loss_vs_twin" in summary
    table = (tmp_path / "convergence.md").read_text()
    # Each of the two tables (the summary, the held-out curve) has a header and 3 rows.
    assert sum(line.startswith("| ") for line in table.splitlines()) == 8
    assert "| lossless | " in table.split("| step 1 | step 2 |")[1]


def _run(
    name: str, seed: int, loss: float, bottleneck: int = 0, recent: int | None = None
) -> dict[str, Any]:
    kind = "twin" if bottleneck == 32 else "bottleneck" if bottleneck else name.partition(",")[0]
    setting = {"kind": kind, "name": name, "bottleneck": bottleneck}
    if recent is not None:  # runs written before the field existed lack it
        setting["recent"] = recent
    wire = {"activation": 512.0, "gradient": 512.0, "token_ids": 0.0, "microbatch_header": 4.0}
    return {"setting": setting, "seed": seed, "eval_loss": loss, "seconds": 1.0, "hops": 2,
            "parameters": 10, "eval_curve": [(10, loss + 1), (20, loss)],
            "bytes_per_token_per_hop": wire}  # fmt: skip


def test_a_row_reports_the_bytes_of_its_newest_wire() -> None:
    old = _run("bottleneck-k4-int8", 0, 2.0, 4)
    old["bytes_per_token_per_hop"] = {**old["bytes_per_token_per_hop"], "token_ids": 1.01}
    new = {**_run("bottleneck-k4-int8", 1, 2.1, 4), "wire": 2}
    new["bytes_per_token_per_hop"] = {**new["bytes_per_token_per_hop"], "token_ids": 0.02}
    row = aggregate([old, new])["bottleneck-k4-int8"]
    assert row["bytes_per_token_per_hop"]["token_ids"] == 0.02 and row["wire"] == 2
    assert list(row["eval_loss_per_seed"]) == ["0", "1"]
    assert row["eval_loss"] == pytest.approx(2.05)


def test_settings_are_compared_seed_by_seed() -> None:
    # Seed 1 is a worse trajectory for both settings: paired, int8 is 1% and 3% over lossless;
    # comparing the means alone would also count seed 2, which int8 has not finished yet.
    runs = [_run("lossless", 0, 2.0), _run("lossless", 1, 3.0), _run("lossless", 2, 1.0),
            _run("int8", 1, 3.09), _run("int8", 0, 2.02)]  # fmt: skip
    rows = aggregate(runs)
    assert rows["int8"]["eval_loss_per_seed"] == {"0": 2.02, "1": 3.09}
    assert rows["int8"]["eval_loss"] == pytest.approx(2.555)
    assert rows["int8"]["eval_curve"] == [(10, pytest.approx(3.555)), (20, pytest.approx(2.555))]
    summary = summarise(rows, ["lossless", "int8"], {})["int8"]
    assert summary["eval_loss_vs_lossless"] == pytest.approx(0.02)
    assert summary["eval_loss_vs_lossless_range"] == [pytest.approx(0.01), pytest.approx(0.03)]
    assert "eval_loss_vs_twin" not in summary


def _result(runs: list[dict[str, Any]], **changes: Any) -> dict[str, Any]:
    result = {"format": "swarmpipe.bench.convergence/2", "model": {"d_model": 32}, "stages": 3,
              "block_size": 256, "steps": 20, "eval_samples": 8, "corpus": "c0ffee",
              "train": {"seed": 0, "lr": 1e-3},
              "command": "swarmpipe bench convergence --seeds 1", "notes": [],
              "order": list(dict.fromkeys(r["setting"]["name"] for r in runs)), "runs": runs,
              "complete": True}  # fmt: skip
    return {**result, **changes}


def test_merge_combines_seeds_and_settings_from_several_files() -> None:
    first = _result([_run("int8, nearest", 0, 2.02), _run("twin-k32-lossless", 0, 1.9, 32),
                     _run("lossless", 0, 2.0),
                     _run("bottleneck-k4-int8", 0, 1.995, 4)])  # fmt: skip
    second = _result(
        [_run("lossless", 1, 3.0), _run("int8, nearest", 1, 3.09)],
        train={"seed": 1, "lr": 1e-3}, command="swarmpipe bench convergence --set train.seed=1",
    )  # fmt: skip
    merged = merge_results([("a.json", first), ("b.json", second)])
    assert merged["order"] == ["lossless", "int8, nearest", "bottleneck-k4-int8",
                               "twin-k32-lossless"]  # fmt: skip
    assert merged["seeds"] == [0, 1] and len(merged["runs"]) == 6
    assert {r["source"] for r in merged["runs"]} == {first["command"], second["command"]}
    int8 = merged["summary"]["int8, nearest"]
    assert int8["eval_loss_vs_lossless"] == pytest.approx(0.02)
    assert merged["summary"]["bottleneck-k4-int8"]["eval_loss_vs_twin"] == pytest.approx(0.05)
    assert merged["command"] == "swarmpipe bench convergence --merge a.json b.json"
    # A merged result merges again, keeping where each run came from.
    again = merge_results([("m.json", merged)])
    assert again["summary"] == merged["summary"]
    assert {r["source"] for r in again["runs"]} == {first["command"], second["command"]}


def test_merge_refuses_runs_that_do_not_compare() -> None:
    base = _result([_run("lossless", 0, 2.0)])
    with pytest.raises(SystemExit, match=r"b\.json: steps is 30 but a\.json has 20"):
        merge_results([("a.json", base), ("b.json", _result([_run("fp16", 0, 2.1)], steps=30))])
    other_text = _result([_run("fp16", 0, 2.1)], corpus="decade")
    with pytest.raises(SystemExit, match=r"b\.json: corpus is 'decade' but a\.json has 'c0ffee'"):
        merge_results([("a.json", base), ("b.json", other_text)])
    with pytest.raises(SystemExit, match=r"b\.json: 'lossless' seed 0 is also in a\.json"):
        merge_results([("a.json", base), ("b.json", base)])
    other_lr = _result([_run("fp16", 0, 2.1)], train={"seed": 0, "lr": 0.1})
    with pytest.raises(SystemExit, match="train settings other than the seed differ"):
        merge_results([("a.json", base), ("b.json", other_lr)])
    late = _run("lossless", 1, 2.0)
    late["eval_curve"] = [(20, 2.0)]
    with pytest.raises(SystemExit, match="evaluated at different steps"):
        merge_results([("a.json", base), ("b.json", _result([late]))])
    with pytest.raises(SystemExit, match="format None"):
        merge_results([("a.json", base), ("b.json", {"format": None})])


def test_each_bottleneck_is_compared_with_the_twin_that_re_embeds_as_many_tokens() -> None:
    old = _result([_run("lossless", 0, 2.0), _run("twin-k32-lossless", 0, 1.9, 32),
                   _run("bottleneck-k4-int8", 0, 1.995, 4)])  # fmt: skip
    new = _result(
        [_run("twin-k32-lossless, re-embeds the last 4 tokens", 0, 1.8, 32, recent=4),
         _run("bottleneck-k4-int8, re-embeds the last 4 tokens", 0, 1.854, 4, recent=4),
         _run("bottleneck-k8-int8", 0, 1.938, 8, recent=1)],
        model={"d_model": 32, "bottleneck_recent": 1},  # the default, written out
        command="swarmpipe bench convergence --bottleneck-recent 4",
    )  # fmt: skip
    merged = merge_results([("old.json", old), ("new.json", new)])
    summary = merged["summary"]
    assert summary["bottleneck-k4-int8"]["eval_loss_vs_twin"] == pytest.approx(0.05)
    assert summary["bottleneck-k8-int8"]["eval_loss_vs_twin"] == pytest.approx(0.02)
    four = summary["bottleneck-k4-int8, re-embeds the last 4 tokens"]
    assert four["eval_loss_vs_twin"] == pytest.approx(0.03)
    assert merged["model"]["bottleneck_recent"] == 1 and merged["model"]["d_model"] == 32
    # A file whose whole model re-embedded more is another model, and is refused.
    other = _result([_run("lossless", 1, 2.0)], model={"d_model": 32, "bottleneck_recent": 4},
                    train={"seed": 1, "lr": 1e-3})  # fmt: skip
    with pytest.raises(SystemExit, match=r"other.json: model is .*'bottleneck_recent': 4"):
        merge_results([("old.json", old), ("other.json", other)])
