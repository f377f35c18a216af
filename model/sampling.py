"""Sampling text from a trained model, one token at a time, reproducibly from a seed.

No KV cache: each new token runs the model over the last `context` tokens again. The
models swarmpipe trains on one machine are small and their context short (64 bytes by
default), so that costs milliseconds a token and keeps any user factory's model usable
as it is (it only has to map ids [B, T] to logits [B, T, V]).
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    prompt: list[int],
    *,
    context: int,
    tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """`tokens` new ids continuing `prompt`, the same for the same seed.

    `temperature` 0 always takes the most likely id (greedy; the seed does not matter);
    `top_k` > 0 samples among the k most likely ids only.
    """
    if not prompt:
        raise ValueError("the prompt is empty: the model needs at least one token to continue")
    if tokens < 0 or temperature < 0 or top_k < 0 or context < 1:
        raise ValueError("tokens, temperature and top_k must be >= 0, context >= 1")
    # A generator of our own: the result depends on the seed alone, and torch's global
    # generator (which a caller may be using) is left where it was.
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(tokens):
        window = torch.tensor([ids[-context:]], dtype=torch.long)  # [1, T]
        logits = model(window)[0, -1].float()  # [V]: the distribution of the next id
        if temperature == 0:
            ids.append(int(torch.argmax(logits)))
            continue
        logits = logits / temperature
        if 0 < top_k < logits.numel():
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return ids[len(prompt) :]
