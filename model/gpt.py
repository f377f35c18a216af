"""A GPT-style decoder as an ordered list of layers, so a pipeline can cut it anywhere.

Layer 0 is the embedding, layers 1..n the transformer blocks, layer n+1 the
head. Each layer is initialised from its own generator seeded by (seed, index),
so building a stage's layers alone gives exactly the parameters the whole
model would have: the pipeline and the single-process baseline start equal.
No dropout (runs are reproducible) and no weight tying (the embedding and the
head live on different stages).

Shapes: B samples, T tokens (<= context), D = d_model, H heads, V = vocab.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from swarmpipe.config import ModelConfig


class Embedding(nn.Module):
    """Token ids [B, T] int64 -> residual stream [B, T, D]: token plus learned position."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # [T]
        out: torch.Tensor = self.tok(tokens) + self.pos(positions)  # [B, T, D]
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then a 4x GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)  # residual projection
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)  # each [B, T, D]
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))  # [B, T, D]
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))  # [B, T, D]
        return out


class Head(nn.Module):
    """Residual stream [B, T, D] -> logits [B, T, V]: final LayerNorm and the unembedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln(x))  # [B, T, V]
        return logits


def layer_generator(seed: int, index: int) -> torch.Generator:
    """The generator that initialises layer `index` of the model seeded by `seed`.

    SeedSequence mixes the pair, so (seed, index) pairs never share a stream the
    way `seed * K + index` would once index reaches K.
    """
    state = np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _init_layer(layer: nn.Module, generator: torch.Generator, n_layers: int) -> None:
    """GPT-2 style: N(0, 0.02) weights, zero biases, unit LayerNorm gains, and the
    projections that write into the residual stream scaled by 1/sqrt(2 n_layers),
    so the stream's variance does not grow with depth."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # LayerNorm gain
                p.fill_(1.0)
            else:
                std = 0.02
                if name.startswith(("proj.", "out.")):
                    std /= math.sqrt(2 * n_layers)
                p.normal_(0.0, std, generator=generator)


def build_gpt_layer(cfg: ModelConfig, index: int, seed: int) -> nn.Module:
    """Layer `index` of the model (0 embedding, 1..n blocks, n+1 head), initialised alone."""
    total = cfg.n_layers + 2
    if not 0 <= index < total:
        raise IndexError(f"layer {index} is outside the model's {total} layers")
    # torch's default init draws from the global RNG; restoring it afterwards
    # keeps a process's later random draws independent of which layers it built.
    # (The meta device would skip that init, but entering it imports torch._dynamo,
    # which costs over a second in every node process.)
    layer: nn.Module
    with torch.random.fork_rng(devices=[]):
        if index == 0:
            layer = Embedding(cfg)
        elif index == total - 1:
            layer = Head(cfg)
        else:
            layer = Block(cfg)
    _init_layer(layer, layer_generator(seed, index), cfg.n_layers)
    return layer


def build_gpt_layers(cfg: ModelConfig, seed: int) -> list[nn.Module]:
    """Every layer of the model in order: embedding, n_layers blocks, head."""
    return [build_gpt_layer(cfg, i, seed) for i in range(cfg.n_layers + 2)]
