"""The learned bottleneck boundary: a trainable narrowing of the residual stream between stages.

With `model.bottleneck = k > 0`, every stage boundary of the built-in GPT carries two modules.
`BottleneckDown`, the last module of stage s, projects the residual stream [B, T, D] to
[B, T, k], and only that crosses the link (through whatever codec the link uses, so the
boundary composes with int8 and int4). `BottleneckUp`, the first module of stage s+1, projects
it back to D and re-adds a token-and-position embedding of its own, looked up from the token
ids that travel with the microbatch (one byte per token for a byte vocabulary).

Why re-add an embedding: which token sits at each position is what every later layer needs most
and what a k-wide stream is worst at carrying, while its ids cost one byte per token on the
wire. This changes the architecture, not only the wire: on a small model the extra embedding
alone can lower the loss. So `k = D` (the "full-width twin": the same modules, nothing
narrowed) is the fair baseline for a bottleneck, not the plain model.

With `model.bottleneck_recent = R > 1`, Up also re-embeds the R - 1 tokens before each
position, each offset from its own table. The ids are on the receiving side already, so
what they say about the latest few tokens (most of what a small byte-level model knows about
the next byte) need not squeeze through the k numbers. The link is then left to carry what
no window of ids gives: what the earlier stages made of the rest of the context. The twin
re-embeds as many tokens, so the comparison stays fair.

Initialisation keeps a rank-k identity path: Down copies k coordinates of the stream (a random
choice per boundary, seeded like every layer) and Up writes them back where they were, so at
k = D the boundary starts as exactly `x + embedding(tokens)`. Both projections then train end
to end with the rest of the model. The modules of boundary b (between stages b and b+1) draw
from `layer_generator(seed, n_layers + 2 + b)`, past every layer's index, so each stage builds
its boundary modules alone with the parameters the whole model would give them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarmpipe.config import ModelConfig, RunConfig
from swarmpipe.model.adamw import AdamW
from swarmpipe.model.gpt import Embedding, layer_generator


class BottleneckDown(nn.Module):
    """Residual stream [B, T, D] -> what crosses the link [B, T, k]: a learned projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # No bias: a constant offset would cost link bytes and carry no information.
        self.down = nn.Linear(cfg.d_model, cfg.bottleneck, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(x)  # [B, T, k]
        return out


class BottleneckUp(nn.Module):
    """What crossed the link [B, T, k] and the token ids [B, T] -> residual stream [B, T, D]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.bottleneck, cfg.d_model, bias=False)
        self.embed = Embedding(cfg)  # this stage's own copy: tables are never shared across nodes
        # Offsets 1..R-1 back, one table each of vocab + 1 rows: the last row stands for
        # "before the sample's first token". None when R = 1 (the token's own embedding only).
        self.vocab = cfg.vocab
        self.offsets = cfg.bottleneck_recent - 1
        self.recent = (
            nn.Embedding(self.offsets * (cfg.vocab + 1), cfg.d_model) if self.offsets else None
        )
        # Where each offset's table starts in `recent`; built once, moved with the module.
        self.table_start: torch.Tensor
        self.register_buffer(
            "table_start", torch.arange(self.offsets) * (cfg.vocab + 1), persistent=False
        )  # [R - 1]

    def forward(self, z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.up(z) + self.embed(tokens)  # [B, T, D]
        if self.recent is not None:
            # ids[:, t, j] is the token j + 1 places before t, or `vocab` before the start.
            padded = F.pad(tokens, (self.offsets, 0), value=self.vocab)  # [B, T + R - 1]
            ids = padded.unfold(1, self.offsets, 1)[:, :-1].flip(2)  # [B, T, R - 1]
            out = out + self.recent(ids + self.table_start).sum(dim=2)  # [B, T, D]
        return out


def _identity_coordinates(cfg: ModelConfig, generator: torch.Generator) -> torch.Tensor:
    """The k stream coordinates a boundary's identity path carries, as int64 [k]."""
    return torch.randperm(cfg.d_model, generator=generator)[: cfg.bottleneck]


def boundary_generator(cfg: ModelConfig, seed: int, boundary: int) -> torch.Generator:
    """The generator of boundary `boundary` (between stages b and b+1), past every layer's."""
    return layer_generator(seed, cfg.n_layers + 2 + boundary)


def build_bottleneck_down(cfg: ModelConfig, seed: int, boundary: int) -> BottleneckDown:
    """The down-projection ending stage `boundary`, built alone."""
    if cfg.bottleneck < 1:
        raise ValueError("model.bottleneck is 0: the model has no bottleneck boundaries")
    with torch.random.fork_rng(devices=[]):  # as in build_gpt_layer: keep the global RNG
        module = BottleneckDown(cfg)
    coords = _identity_coordinates(cfg, boundary_generator(cfg, seed, boundary))
    with torch.no_grad():
        module.down.weight.zero_()  # [k, D]
        module.down.weight[torch.arange(cfg.bottleneck), coords] = 1.0
    return module


def build_bottleneck_up(cfg: ModelConfig, seed: int, boundary: int) -> BottleneckUp:
    """The up-projection and re-added embedding starting stage `boundary + 1`, built alone."""
    if cfg.bottleneck < 1:
        raise ValueError("model.bottleneck is 0: the model has no bottleneck boundaries")
    with torch.random.fork_rng(devices=[]):
        module = BottleneckUp(cfg)
    generator = boundary_generator(cfg, seed, boundary)
    # The same first draw as the Down of this boundary, so Up inverts Down's copy.
    coords = _identity_coordinates(cfg, generator)
    with torch.no_grad():
        module.up.weight.zero_()  # [D, k]
        module.up.weight[coords, torch.arange(cfg.bottleneck)] = 1.0
        # GPT-2's embedding init, as the model's own embedding gets.
        module.embed.tok.weight.normal_(0.0, 0.02, generator=generator)
        module.embed.pos.weight.normal_(0.0, 0.02, generator=generator)
        if module.recent is not None:  # drawn last: R = 1 builds what it always built
            module.recent.weight.normal_(0.0, 0.02, generator=generator)
    return module


def build_optimizer(module: nn.Module, cfg: RunConfig) -> AdamW:
    """AdamW over `module`, with the boundary projections at `model.bottleneck_lr_scale`
    times the learning rate.

    Why they need their own rate: every other matrix sits in a residual branch, whose output
    is added to the stream, while a boundary's Down and Up multiply the whole stream. Adam
    moves every entry by about the learning rate per step whatever its gradient's size, so
    at train.lr a full-width pair drifts from the identity fast enough to scramble the stream
    (the k = d_model twin then trains far worse than the plain model; with the projections
    frozen it trains better). The scale is one rule for every k, so a bottleneck and its
    twin are trained alike.
    """
    t = cfg.train
    projections: list[torch.Tensor] = []
    for m in module.modules():
        if isinstance(m, BottleneckDown):
            projections.append(m.down.weight)
        elif isinstance(m, BottleneckUp):
            projections.append(m.up.weight)
    chosen = {id(p) for p in projections}
    rest = [p for p in module.parameters() if id(p) not in chosen]
    groups: list[dict[str, Any]] = [{"params": rest}]
    if projections:
        groups.append({"params": projections, "lr": t.lr * cfg.model.bottleneck_lr_scale})
    return AdamW(groups, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
