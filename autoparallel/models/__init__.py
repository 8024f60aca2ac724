"""Models for planning and tests."""

from autoparallel.capture.activation_checkpointing import apply_ac
from autoparallel.models.llama3 import (
    LLAMA3_CONFIGS,
    Attention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
    count_params,
)
from autoparallel.models.moe import MOE_CONFIGS, MoEArgs, MoETransformer
from autoparallel.models.simple import FFN, BlockModel

__all__ = [
    "LLAMA3_CONFIGS",
    "MOE_CONFIGS",
    "MoEArgs",
    "MoETransformer",
    "Attention",
    "BlockModel",
    "FFN",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_ac",
    "count_params",
]
