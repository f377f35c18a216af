"""The rows of `swarmpipe bench convergence`: what each stage boundary does, and its name.

A row (`BoundarySetting`) is a codec on both directions of every hop, the learned
bottleneck composed with a codec, or the bottleneck's full-width twin. Its name says
everything that changes what it measures (how its codecs round, centre, narrow their codes,
which tokens it re-embeds), so that rows run with different settings never share a name,
in one table or across the files `--merge` combines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CODEC_SETTINGS = ("lossless", "fp16", "int8", "int4", "lowrank")
"""Settings that put one codec on both directions of every hop, in table order."""

SETTING_KINDS = (*CODEC_SETTINGS, "bottleneck", "twin")
"""What `--settings` may name: the codec settings, the bottleneck, and its full-width twin."""


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
