"""Where to cut the built-in GPT so that every stage has the same compute.

A pipeline runs at the pace of its slowest stage, so equal layer counts are the wrong
target: the first stage also carries the embedding and the last the head (final LayerNorm,
unembedding and the loss's softmax). The cost model counts each layer's floating-point
operations per token of one training step (forward, then backward at twice the forward's
matmul work), and the cut minimises the most expensive stage; among cuts that tie, it
takes the one whose stage costs are closest to each other (least sum of squares).
`swarmpipe bench stage-balance` times each stage's forward and backward on this machine
beside the model's shares, for this cut and for equal layer counts.

No torch here: the coordinator and the simulator may plan with it.
"""

from __future__ import annotations

from swarmpipe.config import ModelConfig
from swarmpipe.errors import ConfigError

ELEMENTWISE_OPS = 10
"""Operations counted per element of each LayerNorm, GELU, residual add and softmax: a
rough figure for work that is memory-bound rather than a matmul, so it is small beside d."""


def gpt_layer_flops(cfg: ModelConfig, index: int) -> int:
    """Operations per token of one training step for layer `index` (0 embedding, 1..n
    blocks, n+1 head), forward and backward."""
    d, t, v = cfg.d_model, cfg.context, cfg.vocab
    last = cfg.n_layers + 1
    if not 0 <= index <= last:
        raise IndexError(f"layer {index} is outside the model's {last + 1} layers")
    if index == 0:
        # Two lookups and an add forward; backward scatters the gradient into both tables.
        return 3 * ELEMENTWISE_OPS * d
    if index == last:
        matmul = 2 * d * v  # unembedding
        elementwise = ELEMENTWISE_OPS * (d + v)  # LayerNorm; softmax and the loss over V
        return 3 * matmul + 2 * elementwise
    # Block: qkv (3d), proj (d), fc (4d) and out (4d) are 12 d x d weights, 2 ops per
    # multiply-add; attention's scores and weighted sum take 2 * T * d each (the math path
    # computes the whole T x T square; a fused causal kernel skips half of it).
    matmul = 2 * 12 * d * d + 4 * t * d
    elementwise = ELEMENTWISE_OPS * (2 * d + 4 * d + 2 * d + t * cfg.n_heads)
    return 3 * matmul + 2 * elementwise


def gpt_layer_costs(cfg: ModelConfig) -> list[int]:
    """`gpt_layer_flops` of every layer in order."""
    return [gpt_layer_flops(cfg, i) for i in range(cfg.n_layers + 2)]


def balanced_ranges(costs: list[int], stages: int) -> list[range]:
    """Cut layers with these costs into `stages` contiguous, non-empty ranges whose most
    expensive stage is as cheap as it can be; ties go to the most even cut."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ConfigError(
            f"cannot cut {n} layers into {stages} stages; use between 1 and {n} pipeline.stages"
        )
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int) -> int:
        return prefix[b] - prefix[a]

    # First pass: the least possible maximum. best[k][i]: layers [0, i) in k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            best[k][i] = min(max(best[k - 1][j], cost(j, i)) for j in range(k - 1, i))
    limit = best[stages][n]
    # Second pass: among cuts with no stage above that maximum, the least sum of squares.
    square = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    square[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                c = cost(j, i)
                if c <= limit and square[k - 1][j] + c * c < square[k][i]:
                    square[k][i] = square[k - 1][j] + c * c
                    choice[k][i] = j
    ends, i = [], n
    for k in range(stages, 0, -1):
        ends.append(i)
        i = choice[k][i]
    bounds = [0, *reversed(ends)]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def gpt_stage_ranges(cfg: ModelConfig, stages: int) -> list[range]:
    """The built-in GPT's layers cut into `stages` of equal compute by `gpt_layer_costs`."""
    return balanced_ranges(gpt_layer_costs(cfg), stages)
