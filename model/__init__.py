"""The model as an ordered list of layers, and how it is cut into pipeline stages.

`build_gpt_layers` is the built-in GPT decoder (embedding, blocks, head), each
layer initialised from its own seed so that any stage can be built alone.
`stage_layer_ranges` and `build_stage` cut the layer list into contiguous
stages; `build_full_model` is the uncut model of the single-process baseline
(`swarmpipe.model.reference`). `token_loss_sum` is the loss the last stage
backpropagates: summed, so gradients are divided by the token count once per step.
`BottleneckDown`/`BottleneckUp` are the learned boundary `model.bottleneck` puts at
every stage cut; `StageModule` runs a stage's modules and hands token ids to the
ones that re-add token embeddings. `build_optimizer` is every stage's (and the
baseline's) AdamW, with the boundary projections at their own learning rate.
`load_exported` reads back the single-process model that `swarmpipe export` wrote.
"""

from swarmpipe.model.bottleneck import (
    BottleneckDown,
    BottleneckUp,
    build_bottleneck_down,
    build_bottleneck_up,
    build_optimizer,
)
from swarmpipe.model.exported import load_exported
from swarmpipe.model.gpt import Block, Embedding, Head, build_gpt_layer, build_gpt_layers
from swarmpipe.model.partition import (
    StageModule,
    build_full_model,
    build_stage,
    n_model_layers,
    stage_layer_ranges,
    stage_module_counts,
    token_loss_sum,
)

__all__ = [
    "Block",
    "BottleneckDown",
    "BottleneckUp",
    "Embedding",
    "Head",
    "StageModule",
    "build_bottleneck_down",
    "build_bottleneck_up",
    "build_full_model",
    "build_gpt_layer",
    "build_gpt_layers",
    "build_optimizer",
    "build_stage",
    "load_exported",
    "n_model_layers",
    "stage_layer_ranges",
    "stage_module_counts",
    "token_loss_sum",
]
