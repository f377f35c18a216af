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
import concurrent.futures
import json
import logging
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: `swarmpipe --help` stays fast
    import torch

    from swarmpipe.compression import EncoderState
    from swarmpipe.data import Corpus

logger = logging.getLogger(__name__)

CODEC_SETTINGS = ("lossless", "fp16", "int8", "int4", "lowrank")
"""Settings that put one codec on both directions of every hop, in table order."""

WIRE = 2
"""Which MicrobatchHeader a run's byte figures were measured with: 1 sent int32 labels and
every token id, 2 sends labels in the id width and each sample's first id (node/token_ids.py).
Training is the same under both; only the header bytes differ."""

SETTING_KINDS = (*CODEC_SETTINGS, "bottleneck", "twin")
"""What `--settings` may name: the codec settings, the bottleneck, and its full-width twin."""

PROGRESS_EVERY = 100
"""Steps between progress lines in the log."""

EVAL_BATCH = 64
"""Held-out samples per forward pass of an evaluation; bounds its memory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundarySetting:
    """One row of the table: what every stage boundary does to the tensors crossing it."""

    kind: str
    """The entry of SETTING_KINDS that asked for this row; orders the table."""
    name: str
    """The row's label, e.g. `int8` or `bottleneck-k4-int8`."""
    activation_codec: str
    """Codec of the activations sent downstream (a compression registry name)."""
    gradient_codec: str
    """Codec of the activation gradients sent back upstream."""
    bottleneck: int = 0
    """model.bottleneck for this row: 0 (the plain model) or the boundary width k."""
    recent: int = 1
    """model.bottleneck_recent for this row: how many of the latest tokens a stage after a
    boundary re-embeds. A bottleneck row is compared with the twin that re-embeds as many."""


def rounding_label(activation_codec: str, gradient_codec: str, roles: Sequence[str]) -> str:
    """How a row's quantising codecs round under `pipeline.stochastic_rounding=roles`, as the
    suffix of its name (", nearest", ", stochastic rounding"); "" when neither quantises.

    Rounding changes what a row measures (int4 rounded to nearest diverges where stochastic
    rounding trains), so rows run with different settings must never share a name.
    """
    from swarmpipe.compression import get_codec

    quantised = [
        role
        for role, codec in (("activation", activation_codec), ("gradient", gradient_codec))
        if get_codec(codec).rounds
    ]
    stochastic = [role for role in quantised if role in roles]
    if not quantised:
        return ""
    if not stochastic:
        return ", nearest"
    if stochastic == quantised:
        return ", stochastic rounding"
    return ", stochastic rounding on " + " and ".join(f"{r}s" for r in stochastic)


def centering_label(activation_codec: str, gradient_codec: str, roles: Sequence[str]) -> str:
    """The suffix `, centered activations` (or gradients, or both) when
    `pipeline.int8_centered=roles` centres a row's quantising codecs, else empty: part of the
    row's name, like rounding."""
    from swarmpipe.compression import get_codec

    centred = [
        role
        for role, codec in (("activation", activation_codec), ("gradient", gradient_codec))
        if get_codec(codec).rounds and role in roles
    ]
    return ", centered " + " and ".join(f"{r}s" for r in centred) if centred else ""


def entropy_label(roles: Sequence[str]) -> str:
    """The suffix `, zstd activations` (or gradients, or both) when `pipeline.zstd=roles`
    passes a row's hops through the lossless zstd stage: training is the same, the bytes not."""
    named = [role for role in ("activation", "gradient") if role in roles]
    return ", zstd " + " and ".join(f"{r}s" for r in named) if named else ""


def recent_label(recent: int) -> str:
    """The suffix `, re-embeds the last 4 tokens` when a boundary row's receiving stages
    re-embed more than the token itself (`--bottleneck-recent`): a different model, so a
    different row, compared with the twin that re-embeds as many."""
    return f", re-embeds the last {recent} tokens" if recent > 1 else ""


def code_max_label(activation_codec: str, code_max: int) -> str:
    """The suffix `, activation codes to 15` when `pipeline.activation_code_max` narrows a
    row's activation codes (its codec's own largest code is higher), else empty."""
    from swarmpipe.compression import get_codec

    if code_max and code_max < get_codec(activation_codec).qmax:
        return f", activation codes to {code_max}"
    return ""


def build_settings(
    kinds: Sequence[str],
    d_model: int,
    bottleneck: int,
    bottleneck_codec: str,
    stochastic_rounding: Sequence[str] = (),
    *,
    bottleneck_gradient_codec: str | None = None,
    centered: Sequence[str] = (),
    zstd: Sequence[str] = (),
    code_max: int = 0,
    recent: int = 1,
) -> tuple[list[BoundarySetting], list[str]]:
    """The rows `kinds` asks for, and a note for each one skipped (a codec not registered).

    The bottleneck row sends its activations with `bottleneck_codec` and its gradients with
    `bottleneck_gradient_codec` (the same codec when None); a row whose two differ is named
    with both, e.g. `bottleneck-k8-int4-grad-int8`.

    A row of a quantising codec is named with how it rounds under `stochastic_rounding`
    (the run's `pipeline.stochastic_rounding`), e.g. `int8, stochastic rounding`, and with the
    roles `centered` (`pipeline.int8_centered`) centres, e.g. `int4, centered activations,
    stochastic rounding`, and with the roles `zstd` (`pipeline.zstd`) compresses losslessly,
    e.g. `int4, zstd activations`, and with `code_max` (`pipeline.activation_code_max`),
    e.g. `int8, activation codes to 15`. The bottleneck and twin rows re-embed the `recent`
    latest tokens after each boundary (`model.bottleneck_recent`), named when above 1.
    """
    from swarmpipe.compression import CODECS_BY_NAME

    gradient_codec = bottleneck_gradient_codec or bottleneck_codec
    for flag, codec in (
        ("--bottleneck-codec", bottleneck_codec),
        ("--bottleneck-gradient-codec", gradient_codec),
    ):
        if codec not in CODECS_BY_NAME and "bottleneck" in kinds:
            raise SystemExit(f"{flag} {codec!r} is not a registered codec")
    settings: list[BoundarySetting] = []
    notes: list[str] = []
    for kind in kinds:
        if kind not in SETTING_KINDS:
            raise SystemExit(f"unknown setting {kind!r}; choose from {', '.join(SETTING_KINDS)}")
        if kind == "bottleneck":
            name = f"bottleneck-k{bottleneck}-{bottleneck_codec}"
            if gradient_codec != bottleneck_codec:
                name += f"-grad-{gradient_codec}"
            name += recent_label(recent)
            name += centering_label(bottleneck_codec, gradient_codec, centered)
            name += code_max_label(bottleneck_codec, code_max)
            name += entropy_label(zstd)
            name += rounding_label(bottleneck_codec, gradient_codec, stochastic_rounding)
            settings.append(
                BoundarySetting(
                    kind=kind,
                    name=name,
                    activation_codec=bottleneck_codec,
                    gradient_codec=gradient_codec,
                    bottleneck=bottleneck,
                    recent=recent,
                )
            )
        elif kind == "twin":
            settings.append(
                BoundarySetting(
                    kind=kind,
                    name=f"twin-k{d_model}-lossless" + recent_label(recent) + entropy_label(zstd),
                    activation_codec="lossless",
                    gradient_codec="lossless",
                    bottleneck=d_model,
                    recent=recent,
                )
            )
        elif kind not in CODECS_BY_NAME:
            notes.append(f"{kind}: skipped, no codec of that name is registered in this build")
        else:
            name = (
                kind
                + centering_label(kind, kind, centered)
                + code_max_label(kind, code_max)
                + entropy_label(zstd)
                + rounding_label(kind, kind, stochastic_rounding)
            )
            settings.append(
                BoundarySetting(kind=kind, name=name, activation_codec=kind, gradient_codec=kind)
            )
    return settings, notes


class SimulatedPipeline:
    """Every stage of a run in this process, each hop between them through the wire codecs.

    Microbatches and steps follow the pipeline's arithmetic (node/stage_runtime.py):
    summed token losses, gradients accumulated per stage and divided by the step's
    token count before each stage's own AdamW step.
    """

    def __init__(
        self, overrides: Sequence[str], setting: BoundarySetting, device: str = "cpu"
    ) -> None:
        from swarmpipe.config import load_config
        from swarmpipe.model.bottleneck import build_optimizer
        from swarmpipe.node.stage_runtime import StageRuntime
        from swarmpipe.node.transport import EncodeOptions

        self.config = load_config(
            None,
            [
                *overrides,
                f"model.bottleneck={setting.bottleneck}",
                f"model.bottleneck_recent={setting.recent}",
            ],
        )
        self.setting = setting
        # The node's own codec parameters and, per hop and direction, its encoder memory
        # (error feedback, warm starts), so each hop encodes exactly as a node would.
        self.options = EncodeOptions.from_pipeline(self.config.pipeline)
        self._states: dict[tuple[int, str], EncoderState] = {}
        self.runtimes = [StageRuntime(self.config, s) for s in range(self.config.pipeline.stages)]
        # Built on the CPU, so every device starts from the same weights; then moved, and
        # the optimizer rebuilt over the moved parameters (it holds no state yet).
        self.device = device
        if device != "cpu":
            for runtime in self.runtimes:
                runtime.module.to(device)
                runtime.optimizer = build_optimizer(runtime.module, self.config)
        self.hops = len(self.runtimes) - 1
        # Bytes over every hop, and the tokens that crossed each hop, since the start.
        self.wire = {"activation": 0, "gradient": 0, "token_ids": 0, "microbatch_header": 0}
        self.hop_tokens = 0

    def _cross(
        self, tensor: torch.Tensor, codec: str, hop: int, direction: str, *, count: bool = True
    ) -> torch.Tensor:
        """`tensor` as the other side of `hop` receives it; counts its bytes when `count`."""
        from swarmpipe.compression import EncoderState, decode_tensor, encode_tensor

        key = (hop, direction)
        if key not in self._states:
            self._states[key] = EncoderState(error_feedback=direction != "activation")
        o = self.options
        header, payload = encode_tensor(
            tensor,
            codec,
            block_size=o.block_size,
            rounding=o.rounding(codec, direction, tensor.device),
            channel_blocks=o.channel_blocks,
            centered=direction in o.centered_blocks,
            entropy=o.entropy(direction),
            code_max=o.code_max(direction),
            topk_fraction=o.topk_fraction,
            rank=o.lowrank_rank,
            state=self._states[key],
        )
        if count:
            self.wire[direction] += header.ByteSize() + len(payload)
        return decode_tensor(header, payload, device=self.device)

    def _count_headers(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Count the MicrobatchHeader bytes of every hop: labels, and the first token ids if
        they travel. The header is the same on each hop, so it is built once."""
        from swarmpipe.node.token_ids import encode_token_ids, first_tokens_of
        from swarmpipe.protos import stage_pb2

        vocab = self.config.model.vocab
        firsts = (
            encode_token_ids(first_tokens_of(tokens, labels), vocab)
            if self.setting.bottleneck
            else b""
        )
        # What node/head.py sends, without the ids and names whose size does not grow.
        header = stage_pb2.MicrobatchHeader(
            labels=encode_token_ids(labels, vocab), first_tokens=firsts
        )
        self.wire["microbatch_header"] += self.hops * header.ByteSize()
        if firsts:
            ids = stage_pb2.MicrobatchHeader(first_tokens=firsts).ByteSize()
            self.wire["token_ids"] += self.hops * ids
        self.hop_tokens += self.hops * labels.numel()

    def microbatch(
        self, microbatch_id: str, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[float, int]:
        """One microbatch down the stages and its gradient back up: (loss sum, tokens)."""
        s = self.setting
        ids, targets = tokens.to(self.device), labels.to(self.device)
        x = ids
        for index, runtime in enumerate(self.runtimes[:-1]):
            out = runtime.forward(f"{microbatch_id}/{index}", microbatch_id, x, ids)
            x = self._cross(out, s.activation_codec, index, "activation")
        self._count_headers(tokens, labels)
        last = self.runtimes[-1].forward_last(microbatch_id, x, targets, ids)
        grad = last.grad_input
        for index in range(len(self.runtimes) - 2, -1, -1):
            assert grad is not None  # only stage 0 returns no input gradient
            grad = self._cross(grad, s.gradient_codec, index, "gradient")
            grad = self.runtimes[index].backward(f"{microbatch_id}/{index}", grad)
        return last.loss_sum, last.tokens

    def train_step(self, step: int, corpus: Corpus) -> float:
        """Step `step`: samples [step*G, (step+1)*G) in microbatches, then AdamW on every
        stage; the step's mean token loss."""
        t = self.config.train
        loss_sum, tokens = 0.0, 0
        for offset in range(0, t.global_batch, t.microbatch):
            count = min(t.microbatch, t.global_batch - offset)
            start = step * t.global_batch + offset
            x, y = corpus.samples(start, count)  # each [count, T]
            loss, n = self.microbatch(f"{step}:{start}:{count}", x, y)
            loss_sum += loss
            tokens += n
        for runtime in self.runtimes:
            runtime.apply_step(step)
        return loss_sum / tokens

    def evaluate(self, corpus: Corpus, count: int) -> float:
        """Mean token loss on the first `count` held-out samples, through the forward codecs."""
        import torch

        from swarmpipe.model import token_loss_sum

        x_all, y_all = corpus.heldout(count)  # each [count, T]
        x_all, y_all = x_all.to(self.device), y_all.to(self.device)
        loss_sum = 0.0
        with torch.no_grad():
            for start in range(0, x_all.shape[0], EVAL_BATCH):
                x = tokens = x_all[start : start + EVAL_BATCH]
                for index, runtime in enumerate(self.runtimes):
                    x = runtime.module(x if index == 0 else x.float(), tokens)
                    if index < self.hops:
                        x = self._cross(
                            x, self.setting.activation_codec, index, "activation", count=False
                        )
                loss_sum += float(token_loss_sum(x, y_all[start : start + EVAL_BATCH]))
        return loss_sum / y_all.numel()

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes per token crossing one hop, for each kind of traffic."""
        n = max(self.hop_tokens, 1)
        return {kind: total / n for kind, total in self.wire.items()}


def train_setting(
    overrides: Sequence[str],
    setting: BoundarySetting,
    seed: int,
    *,
    steps: int,
    eval_every: int,
    eval_samples: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train one setting with `seed` for `steps` steps; its losses, held-out curve, bytes
    and time."""
    from swarmpipe.data import Corpus

    started = time.perf_counter()
    pipe = SimulatedPipeline([*overrides, f"train.seed={seed}"], setting, device)
    cfg = pipe.config
    corpus = Corpus.load(cfg.data, cfg.model.context, cfg.train.seed)
    train_losses: list[float] = []
    curve: list[tuple[int, float]] = []
    for step in range(steps):
        train_losses.append(pipe.train_step(step, corpus))
        done = step + 1
        if done == steps or (eval_every and done % eval_every == 0):
            curve.append((done, pipe.evaluate(corpus, eval_samples)))
            logger.info(
                "%s seed %d: step %d/%d train loss %.4f eval loss %.4f",
                setting.name,
                seed,
                done,
                steps,
                train_losses[-1],
                curve[-1][1],
            )
        elif done % PROGRESS_EVERY == 0:  # a long run shows its pace between evaluations
            logger.info(
                "%s seed %d: step %d/%d train loss %.4f after %.0f s",
                setting.name,
                seed,
                done,
                steps,
                train_losses[-1],
                time.perf_counter() - started,
            )
    return {
        "setting": asdict(setting),
        "seed": seed,
        "eval_loss": curve[-1][1],
        "eval_curve": curve,
        "train_loss_last": train_losses[-1],
        "train_losses": train_losses,
        "bytes_per_token_per_hop": pipe.bytes_per_token(),
        "hops": pipe.hops,
        "parameters": sum(r.n_parameters for r in pipe.runtimes),
        "seconds": time.perf_counter() - started,
        "device": device_name(device),
        "corpus": corpus.fingerprint,
        "wire": WIRE,
    }


def device_name(device: str) -> str:
    """What `device` is, for the record: `cpu`, or the accelerator's own name."""
    import torch

    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def _start_worker(threads: int, log_level: int) -> None:
    """A worker process's setup: its torch threads, and logging (it is an entry point)."""
    import torch

    from swarmpipe.process.logs import configure_logging

    configure_logging(logging.getLevelName(log_level), who="bench convergence")
    torch.set_num_threads(threads)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swarmpipe.config import add_config_arguments

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
    print(json.dumps(_brief(result), indent=2))
    return 0


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    """`result` without the per-step losses, which the file keeps."""
    return {
        **result,
        "runs": [{k: v for k, v in run.items() if k != "train_losses"} for run in result["runs"]],
    }


def _check_device(device: str) -> None:
    """SystemExit unless torch can train on `device` here."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise SystemExit(f"--device {device!r} is not a torch device: {exc}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device!r}: torch sees no CUDA device here")
    if kind not in ("cpu", "cuda"):
        raise SystemExit(f"--device {device!r}: the bench trains on cpu or cuda")


def serve(args: argparse.Namespace) -> int:
    from swarmpipe.config import load_config
    from swarmpipe.data import Corpus

    if args.merge:
        return _merge(args)
    if min(args.steps, args.seeds, args.jobs, args.threads, args.eval_samples) < 1:
        raise SystemExit("--steps, --seeds, --jobs, --threads and --eval-samples must be >= 1")
    config = load_config(None, args.set)  # a bad --set fails here, before any work
    _check_device(args.device)
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

    work = {
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_samples": args.eval_samples,
        "device": args.device,
    }
    # Seed-major: with several seeds, every setting's first seed finishes first.
    plan = [(setting, seed) for seed in seeds for setting in settings]
    if args.jobs == 1:
        _start_worker(args.threads, logging.getLogger().getEffectiveLevel())
        for setting, seed in plan:
            record(train_setting(args.set, setting, seed, **work))
    else:
        # spawn, not fork: the parent may hold torch threads, which fork does not copy safely.
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=args.jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(args.threads, logging.getLogger().getEffectiveLevel()),
        ) as pool:
            futures = [pool.submit(train_setting, args.set, s, seed, **work) for s, seed in plan]
            for future in concurrent.futures.as_completed(futures):
                record(future.result())
    print(json.dumps(_brief(result), indent=2))
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
