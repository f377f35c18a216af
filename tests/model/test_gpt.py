"""The GPT's layers: shapes, causality, and an init that depends only on (seed, layer index)."""

from __future__ import annotations

import math

import torch

from swarmpipe.config import ModelConfig
from swarmpipe.model import Block, Embedding, Head, build_gpt_layer, build_gpt_layers

CFG = ModelConfig(n_layers=3, d_model=32, n_heads=4, context=16)


def _run(layers: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    x = tokens
    for layer in layers:
        x = layer(x)
    return x


def test_layer_kinds_and_shapes() -> None:
    layers = build_gpt_layers(CFG, seed=0)
    assert len(layers) == CFG.n_layers + 2
    assert isinstance(layers[0], Embedding) and isinstance(layers[-1], Head)
    assert all(isinstance(b, Block) for b in layers[1:-1])
    tokens = torch.randint(0, CFG.vocab, (2, CFG.context))
    h = layers[0](tokens)
    assert h.shape == (2, CFG.context, CFG.d_model)
    assert layers[1](h).shape == h.shape
    assert layers[-1](h).shape == (2, CFG.context, CFG.vocab)
    # Shorter sequences than the context work too (positions 0..T-1).
    assert _run(layers, tokens[:, :5]).shape == (2, 5, CFG.vocab)


def test_attention_is_causal() -> None:
    layers = build_gpt_layers(CFG, seed=0)
    tokens = torch.randint(0, CFG.vocab, (1, CFG.context))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % CFG.vocab
    a, b = _run(layers, tokens), _run(layers, changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_a_layer_built_alone_equals_the_same_layer_of_the_whole_model() -> None:
    whole = build_gpt_layers(CFG, seed=7)
    for i, layer in enumerate(whole):
        alone = build_gpt_layer(CFG, i, seed=7)
        for (na, pa), (nb, pb) in zip(
            layer.named_parameters(), alone.named_parameters(), strict=True
        ):
            assert na == nb and torch.equal(pa, pb)


def _qkv(layer: torch.nn.Module) -> torch.Tensor:
    assert isinstance(layer, Block)
    return layer.qkv.weight


def test_init_depends_on_seed_and_index_but_not_on_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = _qkv(build_gpt_layer(CFG, 1, seed=0))
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG is untouched
    torch.manual_seed(999)
    assert torch.equal(a, _qkv(build_gpt_layer(CFG, 1, seed=0)))
    assert not torch.equal(a, _qkv(build_gpt_layer(CFG, 1, seed=1)))
    assert not torch.equal(a, _qkv(build_gpt_layer(CFG, 2, seed=0)))


@torch.no_grad()
def test_gpt2_style_init() -> None:
    big = ModelConfig(n_layers=8, d_model=128, n_heads=4)
    block = build_gpt_layer(big, 1, seed=0)
    assert isinstance(block, Block)
    assert abs(float(block.fc.weight.std()) - 0.02) < 0.002
    residual_std = 0.02 / math.sqrt(2 * big.n_layers)
    assert abs(float(block.out.weight.std()) - residual_std) < 0.1 * residual_std
    assert torch.equal(block.qkv.bias, torch.zeros_like(block.qkv.bias))
    assert torch.equal(block.ln1.weight, torch.ones_like(block.ln1.weight))
    for layer in build_gpt_layers(big, seed=0):
        assert all(bool(torch.isfinite(p).all()) for p in layer.parameters())
