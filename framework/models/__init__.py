"""Transformer models as Keras 3 layers and models; no gin, no trainer."""

from framework.models.dropout import Dropout
from framework.models.transformer import Mlp, MultiHeadAttention, TransformerBlock
from framework.models.vit import VisionTransformer, vit_b16, vit_l16, vit_small, vit_tiny

__all__ = [
    "Dropout",
    "Mlp",
    "MultiHeadAttention",
    "TransformerBlock",
    "VisionTransformer",
    "vit_b16",
    "vit_l16",
    "vit_small",
    "vit_tiny",
]
