"""Vision Transformer (Dosovitskiy et al., 2020) built from `framework.models.transformer`.

Patch embedding, a class token, learned positions, pre-LN blocks, a final norm and a linear head:
the layout of the original ViT, so `vit_b16()` has the paper's 86.6 M parameters for 1000 classes.
"""

from __future__ import annotations

import keras
from keras import ops

from framework.models.dropout import Dropout
from framework.models.transformer import (
    TransformerBlock,
    add_blocks,
    apply_blocks,
    blocks_of,
    build_blocks,
)


class VisionTransformer(keras.Model):
    """ViT classifier: images [batch, size, size, channels] -> logits [batch, num_classes].

    `approximate_gelu=True` computes GELU by its tanh approximation, as the original ViT and
    big_vision did: their published weights then give the same outputs here (timm's use the
    exact form, the default). `framework.models.weights` imports published weights.
    `attention="blockwise"` computes attention in chunks of `attention_chunk` tokens
    (`framework.models.attention`).
    """

    def __init__(
        self,
        *,
        image_size: int = 224,
        patch_size: int = 16,
        num_classes: int = 1000,
        dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_dim: int = 3072,
        dropout: float = 0.0,
        channels: int = 3,
        scan_layers: bool = False,
        approximate_gelu: bool = False,
        attention: str = "plain",
        attention_chunk: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if image_size % patch_size:
            raise ValueError(
                f"image_size {image_size} is not a multiple of patch_size {patch_size}"
            )
        self.image_size = image_size
        self.channels = channels
        self.approximate_gelu = approximate_gelu
        self.num_patches = (image_size // patch_size) ** 2
        self.patch_embed = keras.layers.Conv2D(
            dim, patch_size, strides=patch_size, name="patch_embed"
        )
        self.class_token = self.add_weight(
            shape=(1, 1, dim), initializer="zeros", name="class_token"
        )
        self.positions = self.add_weight(
            shape=(1, self.num_patches + 1, dim),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="positions",
        )
        self.embed_dropout = Dropout(dropout)
        add_blocks(
            self,
            depth,
            num_heads,
            mlp_dim,
            dropout,
            scan=scan_layers,
            approximate_gelu=approximate_gelu,
            attention=attention,
            chunk_size=attention_chunk,
        )
        self.norm = keras.layers.LayerNormalization(epsilon=1e-6, dtype="float32", name="norm")
        self.head = keras.layers.Dense(num_classes, dtype="float32", name="head")
        self.build((None, image_size, image_size, channels))

    @property
    def blocks(self) -> list[TransformerBlock]:
        return blocks_of(self)

    def build(self, input_shape):
        batch = input_shape[0]
        self.patch_embed.build(input_shape)
        tokens = (batch, self.num_patches + 1, self.patch_embed.filters)
        build_blocks(self, tokens)
        self.norm.build(tokens)
        self.head.build((batch, self.patch_embed.filters))
        self.built = True

    def call(self, images, training=None):
        patches = self.patch_embed(images)
        batch = ops.shape(patches)[0]
        tokens = ops.reshape(patches, (batch, self.num_patches, patches.shape[-1]))
        class_token = ops.cast(ops.tile(self.class_token, (batch, 1, 1)), tokens.dtype)
        x = ops.concatenate([class_token, tokens], axis=1) + ops.cast(self.positions, tokens.dtype)
        x = self.embed_dropout(x, training=training)
        x = apply_blocks(self, x, training=training)
        return self.head(self.norm(x)[:, 0])


def vit_tiny(**overrides) -> VisionTransformer:
    """ViT-Ti/16: width 192, 12 blocks, 3 heads (5.7 M parameters at 224 px, 1000 classes)."""
    return VisionTransformer(
        **{"dim": 192, "depth": 12, "num_heads": 3, "mlp_dim": 768, **overrides}
    )


def vit_small(**overrides) -> VisionTransformer:
    """ViT-S/16: width 384, 12 blocks, 6 heads (22 M parameters)."""
    return VisionTransformer(
        **{"dim": 384, "depth": 12, "num_heads": 6, "mlp_dim": 1536, **overrides}
    )


def vit_b16(**overrides) -> VisionTransformer:
    """ViT-B/16: width 768, 12 blocks, 12 heads (86.6 M parameters)."""
    return VisionTransformer(
        **{"dim": 768, "depth": 12, "num_heads": 12, "mlp_dim": 3072, **overrides}
    )


def vit_l16(**overrides) -> VisionTransformer:
    """ViT-L/16: width 1024, 24 blocks, 16 heads (304 M parameters)."""
    return VisionTransformer(
        **{"dim": 1024, "depth": 24, "num_heads": 16, "mlp_dim": 4096, **overrides}
    )
