"""Run configuration: TOML into frozen dataclasses, with `--set section.key=value` overrides.

Every option has a default so the testnet runs with none. Unknown sections or keys are
errors, because a typo that silently falls back to a default wastes a whole run.
The coordinator owns the run's config and sends it to each node as JSON in JoinReply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmpipe.errors import ConfigError
from swarmpipe.transport.limits import CHUNK_BYTES, MBIT, check_latency_ms, check_limit

# Config names of the codecs and the schema enum each maps to (see protos/tensor.proto).
_CODEC_ENUMS = {
    "lossless": "CODEC_LOSSLESS",
    "fp16": "CODEC_FP16",
    "bf16": "CODEC_BF16",
    "int8": "CODEC_BLOCKWISE_INT8",
    "int4": "CODEC_BLOCKWISE_INT4",
    "topk": "CODEC_TOPK",
    "lowrank": "CODEC_LOWRANK",
}
CODEC_NAMES = tuple(_CODEC_ENUMS)
SYNC_MODES = ("every_step", "diloco")
PRECISIONS = ("fp32", "bf16")
"""`train.precision`: fp32 everywhere, or bf16 autocast over fp32 master weights."""
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layers": 5, "d_model": 128, "n_heads": 4, "context": 64},
    "small": {"n_layers": 12, "d_model": 768, "n_heads": 12, "context": 256},
    "medium": {"n_layers": 28, "d_model": 1024, "n_heads": 16, "context": 256},
}
"""`model.preset`: the built-in GPT's shape by name (byte vocabulary). Parameters, exactly:
tiny 1,065,344; small 85,645,824; medium 353,482,752 (tests/model/test_presets.py)."""
_DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
DEFAULT_AUTO_CODECS = ("lossless", "fp16", "bf16", "int8", "int4")
"""Auto mode's ladder unless a run sets its own: the dense codecs, least lossy first."""

AUTO_CODEC = "auto"
"""The codec setting that lets each sender pick a codec per link from what it measures."""
AUTO_IN_FLIGHT = "auto"
"""pipeline.in_flight sized by each head from what it measures (node/in_flight.py)."""
MAX_OVERLAP_DEPTH = 8
"""The deepest train.step_overlap: each node holds a frozen copy of its stage's parameters
per version an open step may train on (depth + 1 of them), and past a handful of steps the
staleness costs more than the round trip it hides (docs/latency.md)."""
ROUNDING_ROLES = ("activation", "gradient", "reduce")
"""The tensor roles `pipeline.stochastic_rounding` may name."""
DEFAULT_STOCHASTIC_ROUNDING = ("activation", "gradient")
"""Roles whose int8/int4 encodings round stochastically unless a run says otherwise: over 2000
steps of the default model, int4 rounded to nearest diverged (held-out loss 2.93 against
lossless's 1.51) and with this 1.65; int8 ended 2.5% over lossless with nearest, 1.9% with
this (README, Convergence)."""


def codec_enum(name: str) -> int:
    """The tensor_pb2.Codec value of a codec's config name.

    "auto" is CODEC_UNSPECIFIED: no codec is fixed, each sender chooses per link.
    """
    from swarmpipe.protos import tensor_pb2

    if name == AUTO_CODEC:
        return tensor_pb2.CODEC_UNSPECIFIED
    return tensor_pb2.Codec.Value(_CODEC_ENUMS[name])


def codec_name(value: int) -> str:
    """The config name of a tensor_pb2.Codec value ('unknown' for one we do not know)."""
    from swarmpipe.protos import tensor_pb2

    for name, enum_name in _CODEC_ENUMS.items():
        if tensor_pb2.Codec.Value(enum_name) == value:
            return name
    return "unknown"


def check_device_spec(spec: str, *, what: str) -> None:
    """ConfigError unless `spec` is written as a device (whether it exists is checked where
    the node starts: node/device.py)."""
    kind, sep, index = spec.partition(":")
    if spec in ("auto", "cpu", "cuda") or (kind == "cuda" and sep and index.isdigit()):
        return
    raise ConfigError(f"{what} {spec!r} is not a device; use {_DEVICE_FORMS}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The GPT-style decoder, or a user factory that returns the model as a list of layers."""

    n_layers: int = 6
    """Transformer blocks in the whole model (split across the stages)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    context: int = 64
    """Tokens per sample (bytes, since the vocabulary is byte-level)."""
    vocab: int = 256
    """Vocabulary size; 256 for byte-level text."""
    factory: str = ""
    """`module:function` returning `list[torch.nn.Module]`; empty means the built-in GPT.
    The function receives this ModelConfig; the last layer's output goes to the loss."""
    bottleneck: int = 0
    """Width k of the learned bottleneck boundary between stages (model/bottleneck.py): 0 is
    off; 1..d_model narrows what crosses every link to k numbers per token, and the receiving
    stage re-adds a token embedding (token ids then travel with each microbatch, one byte per
    token for a byte vocabulary). k = d_model is the full-width twin to compare a bottleneck
    against. Built-in GPT only."""
    bottleneck_recent: int = 1
    """How many of the latest tokens (this one and the ones before it) a stage after a
    bottleneck boundary re-embeds from the ids it already has, each offset with its own table
    (model/bottleneck.py says why). 1 re-adds only the token's own embedding."""
    bottleneck_lr_scale: float = 0.1
    """Learning rate of the boundary projections relative to train.lr (model/bottleneck.py
    `build_optimizer` says why they need a smaller one)."""
    preset: str = ""
    """A named shape of the built-in GPT that sets n_layers, d_model, n_heads and context:
    "tiny" (about 1M parameters), "small" (about 85M) or "medium" (about 350M); empty uses
    those fields as given. Setting one of them to another value beside a preset is an error."""

    def __post_init__(self) -> None:
        if self.preset:
            self._apply_preset()
        if self.n_layers < 1 or self.d_model < 1 or self.context < 1 or self.vocab < 2:
            raise ConfigError("model.n_layers, d_model, context must be >= 1 and vocab >= 2")
        if self.n_heads < 1 or self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}"
            )
        if self.factory and ":" not in self.factory:
            raise ConfigError(f"model.factory={self.factory!r} must look like 'package.module:fn'")
        if not self.bottleneck_lr_scale > 0:  # also refuses NaN
            raise ConfigError(
                f"model.bottleneck_lr_scale={self.bottleneck_lr_scale} must be positive"
            )
        if not 0 <= self.bottleneck <= self.d_model:
            raise ConfigError(
                f"model.bottleneck={self.bottleneck} must be 0 (off) or a width in "
                f"1..model.d_model={self.d_model}"
            )
        if not 1 <= self.bottleneck_recent <= self.context:
            raise ConfigError(
                f"model.bottleneck_recent={self.bottleneck_recent} must be in "
                f"1..model.context={self.context}"
            )
        if self.bottleneck_recent > 1 and not self.bottleneck:
            raise ConfigError(
                f"model.bottleneck_recent={self.bottleneck_recent} re-embeds tokens after a "
                "bottleneck boundary, and model.bottleneck is 0; set model.bottleneck too, or "
                "leave bottleneck_recent at 1"
            )
        if self.bottleneck and self.factory:
            raise ConfigError(
                "model.bottleneck works with the built-in GPT only; a model.factory model "
                "can put its own narrowing layers at its stage cuts; set model.bottleneck=0"
            )

    def _apply_preset(self) -> None:
        """Fill the shape fields from `preset`, refusing one set to something else beside it."""
        shape = MODEL_PRESETS.get(self.preset)
        if shape is None:
            raise ConfigError(
                f"model.preset={self.preset!r} does not exist; use one of "
                f"{', '.join(MODEL_PRESETS)} (or leave it empty)"
            )
        if self.factory:
            raise ConfigError("model.preset shapes the built-in GPT; leave it empty with a factory")
        for name, value in shape.items():
            current = getattr(self, name)
            default = ModelConfig.__dataclass_fields__[name].default
            if current not in (default, value):
                raise ConfigError(
                    f"model.{name}={current} conflicts with model.preset={self.preset!r}, "
                    f"which sets it to {value}; drop one of the two"
                )
            object.__setattr__(self, name, value)  # frozen: set once, while being built


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where training text comes from and how samples are drawn from it."""

    paths: tuple[str, ...] = ()
    """Text files or globs; empty means the Python standard library's .py sources,
    which exist offline on every machine that runs swarmpipe."""
    holdout_fraction: float = 0.02
    """Fraction of sample windows kept out of training for evaluation."""
    max_bytes: int = 64 * 1024 * 1024
    """Read at most this much text, so a large glob cannot exhaust a node's memory."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.holdout_fraction < 0.5:
            raise ConfigError("data.holdout_fraction must be in [0, 0.5)")
        if self.max_bytes < 1024:
            raise ConfigError("data.max_bytes must be at least 1024")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """The optimisation: steps, batch sizes and AdamW."""

    steps: int = 50
    """Optimizer steps in the run."""
    global_batch: int = 32
    """Samples per optimizer step, summed over every head."""
    microbatch: int = 8
    """Samples per microbatch (one lease, one trip through the pipeline)."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    seed: int = 0
    """Seeds parameter initialisation and the sample order."""
    eval_every: int = 0
    """Measure the held-out loss through the pipeline at the start of every this many steps
    and once after the last step; 0 never does. Evaluation runs forward only, on the
    parameters the step trains from, and does not count as training samples."""
    eval_samples: int = 64
    """Held-out samples per evaluation: always the first ones, so evaluations compare."""
    precision: str = "fp32"
    """"fp32", or "bf16": forward and backward under bfloat16 autocast (CPU and CUDA) with
    fp32 parameters, gradients and AdamW state, so only the matmuls lose precision."""
    step_overlap: bool | int = False
    """How many steps may open ahead of the current one (a depth k; true is 1, false 0).
    At k = 1, step s+1 opens while step s still trains or reduces, once step s-1 is applied
    everywhere (a one-step gradient delay, as PipeDream-2BW): step s+1's every microbatch
    then trains on the parameters after step s-1, and its gradient is applied to the
    parameters after step s. At k, step s+j opens once step s+j-k-1 is applied everywhere
    and trains on the newest parameters applied everywhere then (up to k steps old): more
    steps in flight hide a longer round trip, at the price of staler gradients. Steps after
    a change of membership, at checkpoints, the first and after a coordinator restart train
    on the newest parameters, as without it. report.json records what each step trained on
    (`trains_on`). Off: every step trains on the parameters of the step before, and the
    pipeline drains at every step. At most 8: each node keeps a frozen copy of its stage's
    parameters per version open steps may train on (k+1)."""
    device: str = "auto"
    """Where each node's stage trains unless its `swarmpipe node --device` says otherwise:
    "auto" (the CUDA GPU with the least memory in use, else the CPU), "cpu", "cuda" (the
    current GPU) or "cuda:N"."""

    def __post_init__(self) -> None:
        if not isinstance(self.step_overlap, bool) and not (
            0 <= self.step_overlap <= MAX_OVERLAP_DEPTH
        ):
            raise ConfigError(
                f"train.step_overlap={self.step_overlap}: give true, false or a depth from 0 "
                f"to {MAX_OVERLAP_DEPTH} (steps opened ahead of the current one)"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"train.precision={self.precision!r}: use one of {', '.join(PRECISIONS)}"
            )
        check_device_spec(self.device, what="train.device")
        if self.eval_every < 0:
            raise ConfigError("train.eval_every must be >= 0 (0 turns evaluation off)")
        if self.eval_samples < 1:
            raise ConfigError("train.eval_samples must be >= 1")
        if self.steps < 1 or self.global_batch < 1 or self.microbatch < 1:
            raise ConfigError("train.steps, global_batch and microbatch must be >= 1")
        if self.microbatch > self.global_batch:
            raise ConfigError(
                f"train.microbatch={self.microbatch} exceeds train.global_batch={self.global_batch}"
            )
        if self.lr <= 0:
            raise ConfigError("train.lr must be positive")
        if self.seed < 0:
            raise ConfigError("train.seed must be >= 0")

    @property
    def overlap_depth(self) -> int:
        """train.step_overlap as a number of steps opened ahead (true: 1, false: 0)."""
        return int(self.step_overlap)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """How the model is cut into stages and what crosses each hop."""

    stages: int = 3
    """Pipeline stages; each node serves one."""
    activation_codec: str = "lossless"
    """Codec for activations sent downstream: lossless, fp16, bf16, int8, int4, topk,
    lowrank, or auto:
    each sender picks, per downstream peer, the least lossy codec whose transfer at the
    link's measured bandwidth fits in its compute time per microbatch."""
    gradient_codec: str = "lossless"
    """Codec for gradients sent upstream: lossless, fp16, bf16, int8, int4, topk,
    lowrank, or auto (each
    gradient's sender picks per upstream peer, as for activations)."""
    auto_activation_codecs: tuple[str, ...] = DEFAULT_AUTO_CODECS
    """The codecs auto mode chooses among for activations, least lossy first: the sender
    takes the first whose transfer fits, or the smallest when none does."""
    auto_gradient_codecs: tuple[str, ...] = DEFAULT_AUTO_CODECS
    """The same for gradients; e.g. append "topk" for links too slow even for int4."""
    link_mbit: float = 0.0
    """Limit on what each node sends to each peer, in Mbit/s (each direction of a link is
    limited on its own, like a full-duplex line); 0 means unlimited, else 0.001 (1 kbit/s) to
    1e7 (10 Tbit/s). For testnets and experiments on fast networks; `swarmpipe node
    --link-mbit` overrides it per node, and `swarmpipe link-limit` changes it during a run."""
    link_latency_ms: float = 0.0
    """One-way delay, in ms, added to everything each node sends to each peer, after the
    send limit releases it (0 to 10000; 0: none): a long line's latency, which costs time
    but not throughput. For testnets; `swarmpipe node --latency-ms` overrides it per node,
    and `swarmpipe link-limit --latency-ms` changes it during a run."""
    int8_block_size: int = 256
    """Elements per absmax block of the int8 and int4 codecs."""
    int8_channel_blocks: bool = True
    """Whether int8 and int4 blocks run down the rows of each channel (last dimension) rather
    than along the flattened tensor: same bytes, and outlier channels no longer coarsen
    every block they cross (4x less error with 1% of channels x20)."""
    stochastic_rounding: tuple[str, ...] = DEFAULT_STOCHASTIC_ROUNDING
    """Tensor roles whose int8/int4 encodings round stochastically (unbiased, at up to one
    step of error instead of half): any of "activation", "gradient" (activation gradients
    sent upstream) and "reduce" (the replicas' gradient exchange); [] rounds every encoding
    to nearest. Other codecs ignore it."""
    int8_centered: tuple[str, ...] = ()
    """Tensor roles (as in stochastic_rounding) whose int8/int4 blocks each also send their
    midpoint and quantise around it: one more fp32 per block, for a fraction of the error
    on values offset from zero (a learned bottleneck's outputs: int4's error 0.60 -> 0.16 of
    the spread on its most offset channel). Gradients and reduce traffic are centred on zero
    already."""
    zstd: tuple[str, ...] = ()
    """Tensor roles (as in stochastic_rounding) whose payloads, under any codec, also pass
    through the lossless zstd stage (compression/entropy.py), kept only where it shrinks
    them: about 12% off int4 codes, a few percent off int8, little off float casts, at some
    CPU per tensor. The receiver needs nothing: the header says how to undo it. Auto mode
    plans with the bytes before zstd, so what it sends is never more than it planned."""
    activation_code_max: int = 0
    """Largest int8/int4 code of activations, below the codec's own (127, 7): fewer levels,
    which only zstd turns into fewer bytes, so it needs "activation" in pipeline.zstd. 0 uses
    the codec's range. With int8, 15 (31 levels) costs about 4.8 bits a value after zstd at
    half int4's error, and 11 about 4.6 bits: between int4 and int8 where neither fits."""
    topk_fraction: float = 0.01
    """Share of a tensor's entries the topk codec sends (the largest magnitudes), in (0, 1]."""
    lowrank_rank: int = 8
    """Columns of each factor the lowrank codec sends; higher is closer and larger."""
    in_flight: int | str = "auto"
    """Microbatches a head keeps in the pipeline at once: a number, or "auto" to size the
    window from measurements (node/in_flight.py): the unloaded round trip of a microbatch
    through the pipeline over the bottleneck's time per microbatch (the slowest stage's
    compute or the head's link), shared among the heads, plus one; 2 until measured, at
    most 16."""
    hop_timeout_s: float = 120.0
    """Upper bound on one hop's call, downstream included. A failed hop is retried."""
    reduce_timeout_s: float = 60.0
    """How long a replica waits for the others' gradients at a step's end before
    dropping the missing ones (a replica whose Last Will fired is dropped at once); their
    manifests, which say what each holds, are waited for half that again."""
    hop_timeout_min_s: float = 5.0
    """Floor of a hop's measured deadline (round-trip EWMA plus deviations), so
    a burst of fast calls cannot make the next slow-but-healthy one look dead."""
    reduce_codec: str = "lossless"
    """Codec of the replicas' gradient (or DiLoCo parameter delta) exchange: lossless,
    fp16, bf16, int8 or int4. Every replica adds the decoded form of its own
    contribution too, so lossy codecs keep the replicas bit-identical."""
    sync: str = "every_step"
    """How replicas of a stage stay equal: "every_step" sums gradients before every
    optimizer step; "diloco" takes `diloco_inner_steps` local AdamW steps on each
    replica's own gradients, then averages parameters with an outer Nesterov step."""
    peer_max_calls: int = 0
    """Calls one peer (a node by its credential, else an address) may have open at once on
    any node's or the coordinator's server; 0: twice peer_max_streams. Past it:
    RESOURCE_EXHAUSTED (transport/peer_limits.py)."""
    peer_max_streams: int = 0
    """Streaming calls one peer may have open at once on a server; 0: derived from the run,
    2 x (window x 4 + 4) with the in-flight window (16 for "auto"): 136."""
    peer_calls_per_s: float = 1000.0
    """Calls one peer may start per second on a server, sustained (a burst of as many)."""
    stream_idle_s: float = 0.0
    """Longest wait, in seconds, for a stream's next message before the server ends it; 0:
    the longer of hop_timeout_s and reduce_timeout_s, and at least twice a 1 MiB chunk's time
    at link_mbit."""
    diloco_inner_steps: int = 10
    """Local optimizer steps between two parameter averages (sync = "diloco")."""
    diloco_outer_lr: float = 0.7
    """Outer learning rate applied to the averaged parameter delta (sync = "diloco")."""
    diloco_outer_momentum: float = 0.9
    """Nesterov momentum of the outer step (sync = "diloco"); 0 means plain averaging
    when diloco_outer_lr is 1."""

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError("pipeline.stages must be >= 1")
        for name in ("activation_codec", "gradient_codec"):
            value = getattr(self, name)
            if value not in (*CODEC_NAMES, AUTO_CODEC):
                raise ConfigError(
                    f"pipeline.{name}={value!r} is not one of "
                    f"{', '.join(CODEC_NAMES)}, {AUTO_CODEC}"
                )
        for name in ("auto_activation_codecs", "auto_gradient_codecs"):
            ladder = getattr(self, name)
            unknown = [c for c in ladder if c not in CODEC_NAMES]
            if not ladder or unknown or len(set(ladder)) != len(ladder):
                raise ConfigError(
                    f"pipeline.{name}={list(ladder)} must list distinct codecs from "
                    f"{', '.join(CODEC_NAMES)}, least lossy first"
                    + (f" ({', '.join(map(repr, unknown))} unknown)" if unknown else "")
                )
        check_limit(self.link_mbit * MBIT, what=f"pipeline.link_mbit={self.link_mbit}")
        check_latency_ms(
            self.link_latency_ms, what=f"pipeline.link_latency_ms={self.link_latency_ms}"
        )
        if self.int8_block_size < 1:
            raise ConfigError("pipeline.int8_block_size must be >= 1")
        unknown = [r for r in self.stochastic_rounding if r not in ROUNDING_ROLES]
        if unknown:
            raise ConfigError(
                f"pipeline.stochastic_rounding={list(self.stochastic_rounding)} may name only "
                f"{', '.join(ROUNDING_ROLES)} ({', '.join(map(repr, unknown))} unknown)"
            )
        unknown = [r for r in self.int8_centered if r not in ROUNDING_ROLES]
        if unknown:
            raise ConfigError(
                f"pipeline.int8_centered={list(self.int8_centered)} may name only "
                f"{', '.join(ROUNDING_ROLES)} ({', '.join(map(repr, unknown))} unknown)"
            )
        unknown = [r for r in self.zstd if r not in ROUNDING_ROLES]
        if unknown:
            raise ConfigError(
                f"pipeline.zstd={list(self.zstd)} may name only "
                f"{', '.join(ROUNDING_ROLES)} ({', '.join(map(repr, unknown))} unknown)"
            )
        if self.activation_code_max < 0:
            raise ConfigError(
                f"pipeline.activation_code_max={self.activation_code_max} must be 0 (the "
                "codec's own range) or a largest code >= 1"
            )
        if self.activation_code_max and "activation" not in self.zstd:
            raise ConfigError(
                f"pipeline.activation_code_max={self.activation_code_max} saves bytes only "
                'through zstd: add "activation" to pipeline.zstd, or set it to 0'
            )
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ConfigError(
                f"pipeline.topk_fraction={self.topk_fraction} must be in (0, 1]: the share of "
                "entries the topk codec sends, e.g. 0.01"
            )
        if self.lowrank_rank < 1:
            raise ConfigError(
                f"pipeline.lowrank_rank={self.lowrank_rank} must be >= 1 (e.g. 8): the factor "
                "width of the lowrank codec"
            )
        if self.hop_timeout_s <= 0 or self.reduce_timeout_s <= 0:
            raise ConfigError("pipeline.hop_timeout_s and reduce_timeout_s must be positive")
        if not 0 < self.hop_timeout_min_s <= self.hop_timeout_s:
            raise ConfigError(
                f"pipeline.hop_timeout_min_s={self.hop_timeout_min_s} must be positive and at "
                f"most pipeline.hop_timeout_s={self.hop_timeout_s}"
            )
        if self.reduce_codec not in CODEC_NAMES:
            raise ConfigError(
                f"pipeline.reduce_codec={self.reduce_codec!r} is not one of "
                f"{', '.join(CODEC_NAMES)}"
            )
        if self.sync not in SYNC_MODES:
            raise ConfigError(f"pipeline.sync={self.sync!r} is not one of {', '.join(SYNC_MODES)}")
        if self.diloco_inner_steps < 1:
            raise ConfigError("pipeline.diloco_inner_steps must be >= 1")
        if self.diloco_outer_lr <= 0:
            raise ConfigError("pipeline.diloco_outer_lr must be positive (try 0.7)")
        if not 0 <= self.diloco_outer_momentum < 1:
            raise ConfigError("pipeline.diloco_outer_momentum must be in [0, 1) (try 0.9)")
        if isinstance(self.in_flight, str):
            if self.in_flight != AUTO_IN_FLIGHT:
                raise ConfigError(
                    f"pipeline.in_flight={self.in_flight!r}: give a number >= 1 or "
                    f"{AUTO_IN_FLIGHT!r}"
                )
        elif self.in_flight < 1:
            raise ConfigError("pipeline.in_flight must be >= 1")
        if self.peer_max_calls < 0 or self.peer_max_streams < 0:
            raise ConfigError(
                "pipeline.peer_max_calls and peer_max_streams must be >= 1, or 0 to derive "
                "them from the run"
            )
        if not (math.isfinite(self.peer_calls_per_s) and self.peer_calls_per_s > 0):
            raise ConfigError(
                f"pipeline.peer_calls_per_s={self.peer_calls_per_s} must be a positive rate "
                "(e.g. 1000)"
            )
        if self.stream_idle_s < 0:
            raise ConfigError("pipeline.stream_idle_s must be >= 0 (0: derived from the run)")
        # A full chunk paced at the run's send limit must fit in the bound twice over, or
        # honest slow streams would be cut.
        chunk_s = CHUNK_BYTES / (self.link_mbit * MBIT) if self.link_mbit > 0 else 0.0
        if self.stream_idle_s and not (
            math.isfinite(self.stream_idle_s) and self.stream_idle_s >= 2 * chunk_s
        ):
            raise ConfigError(
                f"pipeline.stream_idle_s={self.stream_idle_s} must be at least "
                f"{max(2 * chunk_s, 0):.3g} s (twice a 1 MiB chunk at pipeline.link_mbit="
                f"{self.link_mbit:g}) and finite, or 0 to derive it"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """The coordinator's own behaviour."""

    lease_timeout_s: float = 300.0
    """A lease not committed within this long is leased again (counted as replayed)."""
    min_nodes: int = 0
    """Nodes that must be online before step 0 opens (0: one per stage). Nodes
    that come later download their stage's state from a live replica first."""
    join_hold_s: float = 30.0
    """How long the swarm may wait at a step boundary for a joining node whose
    download the previous step outran, so a slow link cannot keep it out forever."""
    restart_grace_s: float = 60.0
    """How long nodes keep training without their coordinator (retrying its calls and its
    broker) before they give up and exit 1, and how long a coordinator started again on its
    state database waits for the nodes it remembers to reconnect before they count as gone."""
    apply_timeout_s: float = 0.0
    """How long a step's APPLY waits for a node's acknowledgement. A node still owing it
    then leaves the step (logged): the step completes without it and the node fetches its
    stage's state again. 0: 1.5 times pipeline.reduce_timeout_s plus 20 s, 110 s by default
    (the replicas' reduce, contributions then manifests, is the longest legitimate wait
    inside an APPLY)."""
    rebalance_every_s: float = 30.0
    """Seconds between rebalancing rounds (coordinator/placement.py `rebalance`); a node's
    rate moving by a quarter calls one sooner. 0: never rebalance for throughput (a stage
    that loses its last replica is still refilled at once, and one left with a single
    replica while another has three still gets a second)."""
    move_cooldown_s: float = 900.0
    """A node that joined or moved this recently is not moved for throughput or safety."""
    move_min_gain: float = 0.10
    """A batch of throughput moves must raise the throughput bound by this fraction."""
    move_horizon_s: float = 3600.0
    """How far ahead a move's gain is weighed against its cost (the state download)."""
    move_overhead_s: float = 30.0
    """Seconds a move costs besides the download (restart, build, connect, enter the plan)."""
    node_cert_hours: float = 168.0
    """How long a node's TLS certificate (a run with --tls) is valid. A node renews it with
    the coordinator once two thirds of that time have passed, so a run may last any length
    of time; a short life limits what a stolen node key is good for."""

    def __post_init__(self) -> None:
        if self.min_nodes < 0:
            raise ConfigError("coordinator.min_nodes must be >= 0")
        if self.join_hold_s < 0:
            raise ConfigError("coordinator.join_hold_s must be >= 0 (0: never wait for joiners)")
        if self.lease_timeout_s <= 0:
            raise ConfigError("coordinator.lease_timeout_s must be positive")
        if self.restart_grace_s <= 0:
            raise ConfigError("coordinator.restart_grace_s must be positive")
        if not 0.01 <= self.node_cert_hours <= 24 * 366:  # NaN fails too
            raise ConfigError(
                "coordinator.node_cert_hours must be between 0.01 (36 s) and 8784 (a year)"
            )
        if not 0 <= self.apply_timeout_s < math.inf:  # NaN fails too
            raise ConfigError(
                "coordinator.apply_timeout_s must be >= 0 and finite (0: derived from "
                "pipeline.reduce_timeout_s)"
            )
        placement_knobs = (
            self.rebalance_every_s,
            self.move_cooldown_s,
            self.move_min_gain,
            self.move_horizon_s,
            self.move_overhead_s,
        )
        if not all(v >= 0 for v in placement_knobs):  # NaN fails too
            raise ConfigError(
                "coordinator.rebalance_every_s, move_cooldown_s, move_min_gain, "
                "move_horizon_s and move_overhead_s must be >= 0"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Periodic checkpoints of every stage, so a stage whose last replica is gone can resume."""

    every_steps: int = 10
    """One replica of each stage saves the stage's state after every this many steps
    (0: never; then a stage that loses every replica restarts from fresh parameters)."""
    keep: int = 2
    """Checkpoints kept per stage; older ones are deleted once a newer one is complete."""
    dir: str = ""
    """Empty: nodes upload to the coordinator, which keeps them under its --state-dir.
    A path: a shared folder (NFS, a mounted bucket) every node reads and writes directly."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ConfigError("checkpoint.every_steps must be >= 0 (0 turns checkpoints off)")
        if self.keep < 1:
            raise ConfigError("checkpoint.keep must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class RobustConfig:
    """Defences against a replica or peer that sends poisoned tensors (node/robust_reduce.py)."""

    reduce_norm_ratio: float = 10.0
    """A replica's contribution to the reduce is dropped when its norm per token (per
    sample for DiLoCo deltas), or its token count, exceeds this many times the median of
    the other replicas'. Honest replicas on a shared data stream differ by a small factor
    (microbatch noise, uneven traffic); 10 leaves them room while a x1000 gradient fails."""
    clip_radius: float = 4.0
    """With three or more contributions the replicas combine them by a centred clip: each
    one's offset from the centre counts at most this many times the median offset, offsets
    measured in units of 1/sqrt(its tokens), how far an honest mean strays. At 4 honest ones
    are almost never clipped (once in 360 step-aggregates of the tests' model, never in 60 of
    the default one), so a clean run takes the plain mean whichever replica got which
    microbatch, as single-process training does; at 1 the farthest honest one was shortened
    at every step and two clean runs of one seed differed by up to 42 % at a loss spike.
    Whatever passes the screens pulls at most this radius."""
    clip_iterations: int = 3
    """Rounds of the centred clip (the first already lands on the plain mean when nothing
    is clipped)."""
    direction_sigmas: float = 0.0
    """The noise screens (node/robust_reduce.py). A contribution whose log-magnitudes are
    correlated with those of AdamW's second moment by fewer than this many standard deviations
    of a random vector's is dropped; so is one whose cosine with every other one with traffic
    and with the momentum is within this many (|cosine| < this / sqrt(parameters)), when two
    of the others relate by 1.5 times that. 0 (the default) turns both off. Turn them on (3 is
    a fair value) where honest gradients are well above noise (large microbatches): on the
    tiny test model's last stage an honest gradient came out unrelated in direction at 2-5 %
    of steps."""
    tensor_sigmas: float = 10.0
    """The tensor-scale screen (node/robust_reduce.py), for gradients. A contribution whose
    parameter tensors have as equal a root-mean-square as isotropic noise's (the spread of
    their mean squares within this many standard deviations of noise's) is dropped while
    another contribution, or AdamW's second moment, differs between tensors by 1.5 times
    this. Judges from step 0, needing no optimizer history. Over 400 steps honest gradients
    of the tests' and the default model came out at 626 sigma and up, noise of their norm
    at most 4.5 (scripts/tensor_scale_margins.py). 0 turns it off."""
    data_norm_ratio: float = 1000.0
    """A stage refuses (INVALID_ARGUMENT) an activation or gradient whose root-mean-square
    value exceeds this many times the median of the last `data_norm_window` it accepted
    of that kind: relative, because the scale of activations depends on the model. Honest
    gradients have come out at 111 and 117 times the median at loss spikes (a clean int8
    testnet benched its honest sender at 100) and 130-165 times from a stage restored
    from its checkpoint, so the bound sits well above them."""
    data_norm_window: int = 64
    """Accepted tensors of each kind the data-plane median is taken over; until 8 have
    been seen only the finite check applies."""
    bench_s: float = 600.0
    """How long the coordinator keeps a reported node out of the run (Join refused)."""
    bench_verdicts: int = 2
    """A replica is benched once a strict majority of its stage's other replicas dropped its
    reduce contribution at this many steps among the last four (coordinator/suspects.py):
    the screens are statistical and an honest gradient fails one now and then; a hostile
    replica fails at every reduce it is judged in. Each drop is reported either way. A
    conclusive verdict (the tensor-scale screen with a witness, or a norm 10x past
    reduce_norm_ratio) benches at once."""

    def __post_init__(self) -> None:
        for name in ("reduce_norm_ratio", "data_norm_ratio"):
            if not getattr(self, name) > 1:
                raise ConfigError(f"robust.{name} must be > 1 (it is a ratio to a median)")
        if not self.clip_radius > 0:
            raise ConfigError("robust.clip_radius must be positive")
        if self.clip_iterations < 1:
            raise ConfigError("robust.clip_iterations must be >= 1")
        if self.direction_sigmas < 0:
            raise ConfigError("robust.direction_sigmas must be >= 0 (0 turns it off)")
        if not self.tensor_sigmas >= 0:
            raise ConfigError("robust.tensor_sigmas must be >= 0 (0 turns it off)")
        if self.data_norm_window < 8:
            raise ConfigError("robust.data_norm_window must be >= 8")
        if self.bench_s < 0:
            raise ConfigError("robust.bench_s must be >= 0 (0: report without benching)")
        if not 1 <= self.bench_verdicts <= 4:
            raise ConfigError("robust.bench_verdicts must be 1 to 4 (steps among the last four)")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything that defines a run; the coordinator sends it to every node."""

    run_id: str = "testnet"
    """Names the run's MQTT topics (`swarmpipe/<run_id>/...`)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)

    def __post_init__(self) -> None:
        if not self.run_id or any(c in self.run_id for c in "/#+ "):
            raise ConfigError(f"run_id={self.run_id!r} must be non-empty without '/', '#', '+'")
        if self.train.step_overlap and self.pipeline.sync != "every_step":
            raise ConfigError(
                'train.step_overlap needs pipeline.sync = "every_step": DiLoCo\'s rounds '
                "already leave the replicas apart between averages"
            )
        n_layers = self.model.n_layers + 2  # embedding and head count as layers
        if self.pipeline.stages > n_layers:
            raise ConfigError(
                f"pipeline.stages={self.pipeline.stages} exceeds the model's {n_layers} layers"
            )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"run spec is not valid JSON: {exc}") from exc
        built: RunConfig = _build(cls, raw, "")
        return built


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Check and convert one TOML/JSON value to the annotated field type."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"[{where}] must be a table")
        return _build(tp, value, where)  # type: ignore[arg-type]
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, where) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{where} must have {len(args)} items")
        return tuple(_coerce(a, v, where) for a, v in zip(args, value, strict=True))
    if origin in (typing.Union, types.UnionType):
        # A number or a word (pipeline.in_flight = 4 or "auto"), or a switch or a number
        # (train.step_overlap = true or 3): the member the value is; __post_init__ checks
        # which words and numbers are allowed.
        for member in typing.get_args(tp):
            if member in (int, float, str, bool) and isinstance(value, member):
                if not (member is int and isinstance(value, bool)):
                    return value
        names = " or ".join(m.__name__ for m in typing.get_args(tp))
        raise ConfigError(f"{where} must be {names}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{where} must be {tp.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported config type {tp!r}")


def _build(cls: type[Any], raw: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        place = f"[{where}]" if where else "the top level"
        raise ConfigError(
            f"unknown config key(s) {', '.join(unknown)} in {place}; "
            f"known: {', '.join(sorted(names))}"
        )
    kwargs = {
        key: _coerce(hints[key], value, f"{where}.{key}" if where else key)
        for key, value in raw.items()
    }
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare words are strings: --set pipeline.activation_codec=int8
    return key.strip().split("."), value


def add_config_arguments(parser: argparse.ArgumentParser, *, with_file: bool = True) -> None:
    """The --config and --set flags every command that defines a run takes."""
    if with_file:
        parser.add_argument("--config", help="run config (TOML); defaults apply without one")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value; repeatable",
    )


def load_config(
    path: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    *,
    base: RunConfig | None = None,
) -> RunConfig:
    """Read a TOML file (or the defaults, or `base`) and apply `section.key=value` overrides."""
    raw: dict[str, Any] = json.loads(base.to_json()) if base is not None else {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for item in overrides:
        keys, value = _parse_override(item)
        table = raw
        for k in keys[:-1]:
            table = table.setdefault(k, {})
            if not isinstance(table, dict):
                raise ConfigError(f"--set {item!r}: {k} is not a section")
        table[keys[-1]] = value
    config: RunConfig = _build(RunConfig, raw, "")
    return config
