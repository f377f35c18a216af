"""The model: a GPT-style decoder as a list of layers, and how it is cut into stages."""

from swarmpipe.model.gpt import build_gpt_layer, build_gpt_layers
from swarmpipe.model.partition import (
    build_full_model,
    build_stage,
    n_model_layers,
    stage_layer_ranges,
    token_loss_sum,
)

__all__ = [
    "build_full_model",
    "build_gpt_layer",
    "build_gpt_layers",
    "build_stage",
    "n_model_layers",
    "stage_layer_ranges",
    "token_loss_sum",
]
