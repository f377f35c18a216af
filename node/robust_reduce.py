"""Robust aggregation of the replicas' contributions: a poisoned one cannot move the others.

Every replica of a stage runs `aggregate` on the same agreed contributions
(replica_sync.py makes sure they are the same, byte for byte), so every one
drops the same senders and takes the same step. Six screens, in order:

1. Finite. A NaN or infinity anywhere drops the contribution.
2. Counts. A contribution covering 0 tokens must be all zeros, and its token
   count may be at most `norm_ratio` times the median of the others': the
   divisor is the summed count, so an inflated count would let a sender
   scale its weight in the mean without showing a large norm.
3. Norm. Each contribution is normalised by its count (per token for
   gradients, per sample for DiLoCo deltas) so that replicas that saw
   different amounts of traffic compare fairly; its norm must be at most
   `norm_ratio` times the median of the *other* replicas' normalised norms.
   Comparing with the others, not with a median that includes itself, is what
   makes the screen work with two replicas (a gradient sent 1000 times too
   large is 1000 times its only peer's) while a single honest outlier among
   three still passes.
4. Tensor scales (`tensor_sigmas`, on by default; needs the tensors' sizes,
   so gradients only). An honest gradient's root-mean-square differs between
   parameter tensors by orders of magnitude (embeddings, layer norms,
   attention, MLP), in a pattern its replicas share from the first step;
   isotropic noise of any total norm has the same RMS in every tensor, up to
   sampling. The test of equal variances across tensors (Bartlett's
   likelihood ratio, zero mean known) is chi-squared with T-1 degrees of
   freedom for noise; a contribution whose statistic is within `tensor_sigmas`
   standard deviations of that mean, as flat as noise, is dropped when another
   contribution with traffic, or AdamW's second moment, is not flat by
   EVIDENCE times the bound (a step whose contributions are all flat drops
   nobody); a step's only contribution at step 0, with no witness at all, is
   judged by the bound alone. It needs no optimizer history, so it closes
   step 0, where two contributions with traffic used to go into the sum
   unjudged. Over 400
   steps (3 replicas, every stage of 1-, 2- and 3-stage cuts; 976 honest
   contributions a stage) honest gradients came out at 626 sigma and up on
   the tests' model and 4134 and up on the default one, noise of their norms
   at most 4.5 (scripts/tensor_scale_margins.py), so the bound of 10 is on by
   default. DiLoCo deltas pass no sizes: an AdamW step is about lr per element
   in every tensor, whatever the gradient's scale, so evenness is no sign of
   noise there. Not built: noise shaped to an honest tensor profile (a hostile
   sender holds its own gradient's); only the direction screens judge that.
5. Magnitude profile (with the direction screen, from step 1). AdamW's second
   moment (exp_avg_sq, identical everywhere) says which parameters have had
   large gradients; an honest gradient's magnitudes follow it, isotropic noise's
   do not: the correlation of log(g**2) with log(exp_avg_sq) over the n values,
   times sqrt(n), is about N(0, 1) for noise, and its size must reach
   `direction_sigmas`. Unlike the direction screen this needs no other
   contribution, so it judges a step's lone contribution too (the fastest
   replica leases what it can, and a hostile replica had a step's only traffic
   in `bench hostile`). Honest gradients came out at 38 to 930 sigma (default
   model, 40 steps, 1 and 3 stages) and 98 to 220 (the tests' tiny model, 100
   steps); noise at most 3.8.
6. Direction. Noise of a plausible norm passes the norm screen; what gives
   it away is that it is unrelated to everything: its cosine with every
   other witness is what a random vector's would be, within
   `direction_sigmas` / sqrt(n) of zero (n parameters). The witnesses are the
   other contributions with traffic and the optimizer's first moment (AdamW's
   exp_avg, bit-identical on every replica, carried by state transfer and
   checkpoints). Each is compared with each other one, not with their sum,
   because a noise vector in the sum would dilute an honest replica's
   relation to the others. Unrelatedness alone is not enough: the vector is
   dropped only when two of the *other* witnesses relate to each other by
   EVIDENCE times the bound, showing that this step's honest vectors do
   relate. So two contributions with traffic are judged beside the momentum
   (one replica idle left noise in the plain sum of `bench hostile`), a step
   whose vectors all come out unrelated drops nobody (the screen used to drop
   them all), and at step 0 with two, nothing is judged: either could be the
   odd one. Over 100 steps of the default model (3 replicas, cut into 1, 2 or
   3 stages) no honest vector came closer to unrelated than 14 sigma against
   the bound's 3; on the last stage of the test suite's tiny model (4-sample
   microbatches) an honest gradient came out as unrelated as noise while the
   other two related at 2-5 % of 196 steps (down to 1.5 sigma), so the screen
   stays opt-in. At step 0 with two this screen judges nobody (the
   tensor-scale screen does): withholding both instead cost more than it
   saved (scripts/hostile_floor.py, seed 3: 6.0 % mean and 34 % worst step
   against 1.4 % and 9.6 %), since the steps it withholds are the ones where
   the loss falls fastest. Only
   |cosine| counts: a negative one is not evidence of malice (a sign-flipped
   gradient is left to the centred clip).

Then, with three or more contributions left (over at least one token each),
the aggregate is a centred clip (in the spirit of Karimireddy, He and Jaggi,
"Learning from History for Byzantine Robust Optimization", 2021, as hivemind
uses it): start from the coordinate-wise median of the normalised vectors and
move, a fixed number of times, by the count-weighted mean of each vector's
offset clipped to its radius. An honest mean over w tokens strays from the
true one by about 1/sqrt(w), so offsets are measured in those units: vector
n's radius is `clip_radius` times the median of offset * sqrt(count), divided
by sqrt(its count). A contribution that passed the screens but points
somewhere odd so pulls at most its radius. When nothing is clipped the first
move lands exactly on the weighted mean, the plain average, whichever replica
got which microbatch. The default radius of 4 almost never clips an honest
contribution (once in 360 step-aggregates of the tests' tiny model,
scripts/hostile_floor.py); a radius of 1 in plain offsets, as before, clipped
the farthest honest one at every step, so the update depended on the dealing
of microbatches: two clean runs of one seed differed by up to 42 % at a loss
spike of the default model and neither equalled single-process training. With one or two
contributions left the plain sum stays (a median of two is their mean: there
is nothing to be robust with), so a lossless two-replica run still equals
single-process training.

Determinism. Replicas must agree bit for bit. Contributions are visited in
node-id order; the decision scalars (norms, medians, tau, clip factors) are
summed in float64 and rounded to float32 before use, and the vectors change
only by elementwise operations, which do not depend on thread count. So equal
inputs give equal outputs on one torch build and CPU family (tested); across
CPU families a float64 sum could in principle land on the other side of a
float32 rounding boundary, one chance in about 1e9 per scalar.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

Contribution = tuple[torch.Tensor, int, int]  # flat vector, tokens, samples
Per = Literal["tokens", "samples"]
MOMENTUM = "(momentum)"  # the reference vector's name among the direction screen's witnesses
MOMENT = "(second moment)"  # exp_avg_sq's name among the tensor-scale screen's witnesses
# The direction screen drops a vector as noise only when two of the other witnesses relate
# at least this many times its bound (4.5 sigma at 3; two independent vectors do so about once
# in 150 000 pairs), so a step whose honest vectors all come out unrelated (small batches of a
# sparse stage) drops nobody instead of everybody. Random tokens on the test model's random
# weights relate at 5.3 sigma: 2x would miss the noise among them.
EVIDENCE = 1.5
# A norm this many times past the norm screen's bound is a conclusive verdict (the coordinator
# benches on the first): honest gradients reached 16x and 26x the others' median at loss
# spikes, against a bound of 10x; a sender of x1000 comes out at about 1000x.
CONCLUSIVE_NORMS = 10.0


class Verdicts(NamedTuple):
    """What the screens found."""

    rejected: dict[str, str]
    """Node id -> one line saying why its contribution was dropped."""
    conclusive: set[str]
    """The dropped senders whose verdict no honest gradient has come near."""


@dataclass(frozen=True, slots=True)
class Aggregate:
    """The agreed step's input and what the screens dropped."""

    total: Contribution
    """(flat sum, tokens, samples) over the accepted contributions; for the centred clip
    the robust mean times the accepted count, so dividing by the count gives the mean."""
    accepted: tuple[str, ...]
    rejected: dict[str, str] = field(default_factory=dict)
    """Node id -> one line saying why its contribution was dropped."""
    clipped: tuple[str, ...] = ()
    """Senders whose offset the centred clip shortened in any of its iterations."""
    conclusive: tuple[str, ...] = ()
    """Dropped senders whose verdict no honest gradient has come near (the tensor-scale
    screen with a witness, a norm CONCLUSIVE_NORMS times past its bound): the coordinator
    benches on one such verdict, not two."""


def _f32(x: float) -> float:
    """Round a decision scalar to float32, so tiny float64 differences do not flip it."""
    return float(torch.tensor(x, dtype=torch.float32).item())


def _norm(v: torch.Tensor) -> float:
    return _f32(float(torch.linalg.vector_norm(v.double()).item()))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else _f32((ordered[mid - 1] + ordered[mid]) / 2)


def _count(c: Contribution, per: Per) -> int:
    return c[1] if per == "tokens" else c[2]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    denominator = float(torch.linalg.vector_norm(a64)) * float(torch.linalg.vector_norm(b64))
    return _f32(float(torch.dot(a64, b64)) / denominator) if denominator > 0 else 0.0


def screen(
    contributions: Mapping[str, Contribution],
    *,
    per: Per,
    norm_ratio: float,
    direction_sigmas: float = 0.0,
    reference: torch.Tensor | None = None,
    profile: torch.Tensor | None = None,
    sizes: Sequence[int] | None = None,
    tensor_sigmas: float = 0.0,
) -> Verdicts:
    """Node id -> why its contribution fails the finite, count, norm, tensor-scale, profile
    and direction screens, and the nodes among them whose verdict is conclusive.

    `sizes` are the element counts of the parameter tensors the flat vectors are cut from,
    in order; without them (DiLoCo deltas, whose AdamW-normalised steps are about equally
    large in every tensor) the tensor-scale screen does not run.

    `reference` is a vector every replica holds bit-identical (the optimizer's first moment):
    one more witness for the direction screen, which runs only when three or more replicas
    had traffic: with two, either could be the odd one, and honest gradients of a small batch
    come near orthogonal to each other and to the momentum early in training.
    """
    rejected: dict[str, str] = {}
    conclusive: set[str] = set()
    unit = "token" if per == "tokens" else "sample"
    norms: dict[str, float] = {}
    counts: dict[str, int] = {}
    for node in sorted(contributions):
        c = contributions[node]
        flat, count = c[0], _count(c, per)
        if not bool(torch.isfinite(flat).all()):
            rejected[node] = "its contribution contains NaN or infinite values"
        elif count == 0:
            if bool(flat.any()):
                rejected[node] = f"a nonzero contribution over 0 {unit}s"
            # An all-zero one adds nothing and has no per-{unit} norm to compare.
        else:
            counts[node] = count
            norms[node] = _f32(_norm(flat) / count)
    for node in sorted(norms):
        others = [n for n in norms if n != node]
        if not others:
            continue
        median_count = _median([float(counts[n]) for n in others])
        if counts[node] > norm_ratio * median_count:
            rejected[node] = (
                f"it claims {counts[node]} {unit}s, over {norm_ratio:g}x the median of the "
                f"other replicas' ({median_count:g})"
            )
            continue
        median_norm = _median([norms[n] for n in others])
        if median_norm > 0 and norms[node] > norm_ratio * median_norm:
            if norms[node] > CONCLUSIVE_NORMS * norm_ratio * median_norm:
                conclusive.add(node)
            rejected[node] = (
                f"norm {norms[node]:.3g} per {unit} is {norms[node] / median_norm:.3g}x the "
                f"median of the other replicas' ({median_norm:.3g}); the bound is "
                f"{norm_ratio:g}x"
            )
    left = [n for n in sorted(norms) if n not in rejected and norms[n] > 0]
    if reference is not None and not bool(reference.any()):
        reference = None  # no momentum yet (step 0): nothing to compare with
    if tensor_sigmas > 0 and sizes is not None and len(sizes) > 1:
        even, witnessed = _flat(contributions, left, sizes, tensor_sigmas, profile)
        rejected |= even
        conclusive |= witnessed
        left = [n for n in left if n not in rejected]
    if direction_sigmas > 0 and profile is not None and bool(profile.any()):
        for node in left:
            z = _profile_sigmas(contributions[node][0], profile)
            if abs(z) < direction_sigmas:
                rejected[node] = (
                    f"its magnitudes are as unrelated to the optimizer's second moment as "
                    f"random noise's ({z:.3g} sigma; the bound is {direction_sigmas:g})"
                )
        left = [n for n in left if n not in rejected]
    if direction_sigmas > 0:
        rejected |= _unrelated(contributions, left, direction_sigmas, reference)
    return Verdicts(rejected, conclusive)


def tensor_mean_squares(flat: torch.Tensor, sizes: Sequence[int]) -> list[float]:
    """The mean square of each parameter tensor's slice of `flat`, rounded to float32."""
    return _tensor_means(flat, sizes, square=True)


def _tensor_means(values: torch.Tensor, sizes: Sequence[int], *, square: bool) -> list[float]:
    if sum(sizes) != values.numel():
        raise ValueError(
            f"tensor sizes sum to {sum(sizes)} but the contribution has {values.numel()} values"
        )
    # One tensor at a time in float64, so the copy is never larger than the largest tensor.
    sums = torch.stack(
        [
            (chunk.double().square() if square else chunk.double()).sum()
            for chunk in torch.split(values, list(sizes))
        ]
    )
    return [_f32(s / n) for s, n in zip(sums.tolist(), sizes, strict=True)]


def flatness_sigmas(mean_squares: Sequence[float], sizes: Sequence[int]) -> float | None:
    """How many standard deviations above what isotropic noise gives the spread of the
    tensors' mean squares is, or None with fewer than two nonzero tensors to compare.

    Bartlett's statistic for equal variances (zero mean known), M = n ln(pooled) -
    sum(n_t ln(ms_t)), with its small-sample correction, is about chi-squared with T-1
    degrees of freedom when every value is drawn alike. All-zero tensors are left out: an
    honest stage may have a parameter nothing reached, and zeroing one tensor must not be
    all it takes to make noise look uneven."""
    pairs = [(ms, size) for ms, size in zip(mean_squares, sizes, strict=True) if ms > 0]
    t = len(pairs)
    if t < 2:
        return None
    n = sum(size for _, size in pairs)
    pooled = math.fsum(ms * size for ms, size in pairs) / n
    m = math.fsum(size * math.log(pooled / ms) for ms, size in pairs)
    correction = 1 + (math.fsum(1 / size for _, size in pairs) - 1 / n) / (3 * (t - 1))
    return _f32((m / correction - (t - 1)) / math.sqrt(2 * (t - 1)))


def _flat(
    contributions: Mapping[str, Contribution],
    left: list[str],
    sizes: Sequence[int],
    sigmas: float,
    profile: torch.Tensor | None,
) -> tuple[dict[str, str], set[str]]:
    """The tensor-scale screen: who has the same RMS in every tensor, as isotropic noise
    has, while another contribution or the second moment shows that honest ones do not;
    and which of them had such a witness.

    A verdict with a witness is conclusive: every honest gradient measured came out at
    hundreds of sigma or more against the bound's 10, noise at 4.5 at most, so the
    coordinator benches on the first one. A step's only contribution at step 0 has no
    witness at all; it is judged by that prior alone: the cost of the prior being wrong for
    some model is one step's update, never a bench (such a verdict is not conclusive, a
    bench takes two of them, and from step 1 the second moment is a witness)."""
    spread: dict[str, float] = {}
    for node in left:
        z = flatness_sigmas(tensor_mean_squares(contributions[node][0], sizes), sizes)
        if z is not None:
            spread[node] = z
    if profile is not None:
        # exp_avg_sq is a mean of squares already: its per-tensor means are mean squares.
        z = flatness_sigmas(_tensor_means(profile, sizes, square=False), sizes)
        if z is not None:
            spread[MOMENT] = z
    rejected: dict[str, str] = {}
    witnessed: set[str] = set()
    for node in left:
        if node not in spread or spread[node] >= sigmas:
            continue
        witness = max((n for n in spread if n != node), key=lambda n: spread[n], default=None)
        if witness is None:
            because = "nothing else at this step to compare with, and honest gradients differ"
        elif spread[witness] >= EVIDENCE * sigmas:
            name = "the optimizer second moment" if witness == MOMENT else witness
            because = f"{name}'s differ ({spread[witness]:.3g} sigma)"
            witnessed.add(node)
        else:
            continue  # nothing shows that this step's honest tensors differ: drop nobody
        rejected[node] = (
            f"its {len(sizes)} parameter tensors have as equal a root-mean-square as random "
            f"noise's ({spread[node]:.3g} sigma from equal; the bound is {sigmas:g}) while "
            f"{because}"
        )
    return rejected, witnessed


def _profile_sigmas(flat: torch.Tensor, profile: torch.Tensor) -> float:
    """How many standard deviations of a random vector's the correlation of log(flat**2)
    with log(profile) is away from zero, over the n values: for noise whose values are drawn
    independently of the profile it is about N(0, 1). Honest gradients follow the profile
    (tens to hundreds of sigma), at times the other way round (-85 seen on the default
    model's last stage): only the size counts, as for the direction screen's cosines."""
    tiny = 1e-30  # an exact zero (an unused embedding row) is a magnitude too
    a = torch.log(flat.double().square() + tiny)
    b = torch.log(profile.double() + tiny)
    a = a - a.mean()
    b = b - b.mean()
    denominator = float(torch.linalg.vector_norm(a)) * float(torch.linalg.vector_norm(b))
    if denominator == 0:
        return 0.0
    return _f32(float(torch.dot(a, b)) / denominator * flat.numel() ** 0.5)


def _unrelated(
    contributions: Mapping[str, Contribution],
    left: list[str],
    sigmas: float,
    reference: torch.Tensor | None,
) -> dict[str, str]:
    """The direction screen: who is as unrelated to everything as random noise, while
    something else shows that relation is what this step's honest vectors have."""
    witnesses: list[str] = list(left)
    vectors = {n: contributions[n][0] for n in left}
    if reference is not None:
        vectors[MOMENTUM] = reference
        witnesses.append(MOMENTUM)
    # Two contributions with traffic are judged only beside the momentum: with nothing
    # else, either could be the odd one.
    if len(left) < 2 or len(witnesses) < 3:
        return {}
    bound = _f32(sigmas / vectors[left[0]].numel() ** 0.5)
    cosines = {
        (a, b): _cosine(vectors[a], vectors[b])
        for i, a in enumerate(witnesses)
        for b in witnesses[i + 1 :]
    }
    rejected: dict[str, str] = {}
    for node in left:
        closest = max(abs(c) for pair, c in cosines.items() if node in pair)
        evidence = max(abs(c) for pair, c in cosines.items() if node not in pair)
        if closest < bound and evidence >= EVIDENCE * bound:
            rejected[node] = (
                f"its direction is as unrelated to every other replica's"
                f"{' and to the gradient momentum' if reference is not None else ''} as a "
                f"random vector's (largest |cosine| {closest:.3g}; the bound is {bound:.3g}) "
                f"while the others relate (|cosine| {evidence:.3g})"
            )
    return rejected


def plain_sum(contributions: Mapping[str, Contribution]) -> Contribution:
    """The sum in node-id order: what every replica adds when there is nothing to clip."""
    first = next(iter(contributions.values()))[0]
    total = torch.zeros_like(first)
    tokens = samples = 0
    for node in sorted(contributions):
        flat, t, s = contributions[node]
        total += flat
        tokens += t
        samples += s
    return total, tokens, samples


def centred_clip(
    contributions: Mapping[str, Contribution], *, per: Per, radius: float, iterations: int
) -> tuple[Contribution, tuple[str, ...]]:
    """The count-weighted centred clip of the normalised contributions, times the count.

    Returns the contribution to apply and the senders whose offset was clipped in
    any iteration.
    """
    nodes = [n for n in sorted(contributions) if _count(contributions[n], per) > 0]
    tokens = sum(c[1] for c in contributions.values())
    samples = sum(c[2] for c in contributions.values())
    if not nodes:
        return plain_sum(contributions), ()
    weights = {n: float(_count(contributions[n], per)) for n in nodes}
    total_weight = sum(weights.values())
    units = {n: contributions[n][0] / weights[n] for n in nodes}  # per token (or sample)
    # torch.median takes the lower of the two middle values: an input vector's own value.
    centre = torch.stack([units[n] for n in nodes]).median(dim=0).values
    # An honest mean over w tokens strays from the true one by about 1/sqrt(w): the offsets
    # are compared, and each one's radius set, in units of that.
    spread = _median([_norm(units[n] - centre) * math.sqrt(weights[n]) for n in nodes])
    tau = {n: _f32(radius * spread / math.sqrt(weights[n])) for n in nodes}
    clipped: set[str] = set()
    for _ in range(iterations):
        offsets = {n: units[n] - centre for n in nodes}
        step = torch.zeros_like(centre)
        for n in nodes:
            distance = _norm(offsets[n])
            factor = 1.0
            if distance > tau[n]:
                factor = _f32(tau[n] / distance)
                clipped.add(n)
            step.add_(offsets[n], alpha=_f32(weights[n] * factor / total_weight))
        centre = centre + step
    return (centre * total_weight, tokens, samples), tuple(sorted(clipped))


def aggregate(
    contributions: Mapping[str, Contribution],
    *,
    per: Per,
    norm_ratio: float,
    clip_radius: float,
    clip_iterations: int,
    direction_sigmas: float = 0.0,
    reference: torch.Tensor | None = None,
    profile: torch.Tensor | None = None,
    sizes: Sequence[int] | None = None,
    tensor_sigmas: float = 0.0,
) -> Aggregate:
    """Screen the contributions, drop the failures, and combine the rest (see the module)."""
    rejected, conclusive = screen(
        contributions,
        per=per,
        norm_ratio=norm_ratio,
        direction_sigmas=direction_sigmas,
        reference=reference,
        profile=profile,
        sizes=sizes,
        tensor_sigmas=tensor_sigmas,
    )
    kept = {n: contributions[n] for n in sorted(contributions) if n not in rejected}
    sure = tuple(sorted(conclusive))
    if not kept:
        first = next(iter(contributions.values()))[0]
        zero = (torch.zeros_like(first), 0, 0)
        return Aggregate(total=zero, accepted=(), rejected=rejected, conclusive=sure)
    # An idle replica's all-zero contribution (0 tokens) adds nothing: count the others.
    if sum(1 for c in kept.values() if _count(c, per) > 0) < 3:
        return Aggregate(
            total=plain_sum(kept), accepted=tuple(kept), rejected=rejected, conclusive=sure
        )
    total, clipped = centred_clip(kept, per=per, radius=clip_radius, iterations=clip_iterations)
    return Aggregate(
        total=total, accepted=tuple(kept), rejected=rejected, clipped=clipped, conclusive=sure
    )
