"""A GPT-style decoder as an ordered list of layers, so a pipeline can cut it anywhere.

Layer 0 is the embedding, layers 1..n the transformer blocks, layer n+1 the
head. Each layer is initialised from its own generator seeded by (seed, index),
so building a stage's layers alone gives exactly the parameters the whole
model would have: the pipeline and the single-process baseline start equal.
No dropout (runs are reproducible) and no weight tying (the embedding and the
head live on different stages).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swarmpipe.config import ModelConfig


class Embedding(nn.Module):
    """Token ids [B, T] int64 -> residual stream [B, T, D]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        out: torch.Tensor = self.tok(tokens) + self.pos(positions)  # [B, T, D]
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then a 4x GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)  # each [B, T, D]
        # [B, H, T, D/H]
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))  # [B, T, D]
        return out


class Head(nn.Module):
    """Residual stream [B, T, D] -> logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln(x))  # [B, T, V]
        return logits


def _init_layer(layer: nn.Module, generator: torch.Generator, n_layers: int) -> None:
    """GPT-2 style: N(0, 0.02) weights, zero biases, residual projections scaled down."""
    for name, p in layer.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.ndim == 1:  # LayerNorm gains
            nn.init.ones_(p)
        else:
            std = 0.02
            if name.startswith(("proj.", "out.")):
                std /= math.sqrt(2 * n_layers)
            with torch.no_grad():
                p.normal_(0.0, std, generator=generator)


def build_gpt_layer(cfg: ModelConfig, index: int, seed: int) -> nn.Module:
    """Layer `index` of the model (0 embedding, 1..n blocks, n+1 head), initialised alone."""
    total = cfg.n_layers + 2
    if not 0 <= index < total:
        raise IndexError(f"layer {index} is outside the model's {total} layers")
    layer: nn.Module
    if index == 0:
        layer = Embedding(cfg)
    elif index == total - 1:
        layer = Head(cfg)
    else:
        layer = Block(cfg)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    _init_layer(layer, generator, cfg.n_layers)
    return layer


def build_gpt_layers(cfg: ModelConfig, seed: int) -> list[nn.Module]:
    return [build_gpt_layer(cfg, i, seed) for i in range(cfg.n_layers + 2)]
