"""Transformer building blocks as Keras 3 layers, shared by the ViT and the language models.

Each `TransformerBlock` is one layer, so `framework.remat` can checkpoint a model block by block.
Softmax and layer norms run in float32 under mixed precision, as TPU training recipes do.
The tensors MaxText-style remat policies keep are tagged with `remat.checkpoint_name`: "qkv_proj"
(fused query/key/value projection), "attn_out" (attention output projection), "mlp_in" (first MLP
layer, after its activation) and "mlp_out" (second MLP layer).
"""

from __future__ import annotations

import keras
from keras import ops

from framework.models.attention import blockwise_attention, plain_attention
from framework.models.dropout import Dropout
from framework.models.scan import ScannedBlocks, stack_weights, unstack_weights
from framework.remat import checkpoint_name

ATTENTION = {"plain": plain_attention, "blockwise": blockwise_attention}


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {attention!r}")


class MultiHeadAttention(keras.layers.Layer):
    """Multi-head self-attention with one fused query/key/value projection.

    Which keys a query sees: `attention_mask` (boolean, broadcasting to [batch, heads, query,
    key]; True means "attend"; not `mask`, which Keras gives a meaning of its own), and
    `segment_ids` [batch, length] (a query sees its own segment's keys; with `causal`, none
    after it). `attention` is "plain" (whole [batch, heads, S, S] scores) or "blockwise" (in
    chunks of `chunk_size` queries and keys, by default from the length): the same function,
    see `framework.models.attention`.
    """

    def __init__(
        self,
        num_heads: int,
        dropout: float = 0.0,
        causal: bool = False,
        attention: str = "plain",
        chunk_size: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        _check_attention(attention)
        self.num_heads = num_heads
        self.dropout_rate = dropout
        self.causal = causal
        self.attention_kind = attention
        self.chunk_size = chunk_size

    def build(self, input_shape):
        dim = input_shape[-1]
        if dim % self.num_heads:
            raise ValueError(f"model width {dim} is not divisible by num_heads={self.num_heads}")
        self.head_dim = dim // self.num_heads
        self.qkv = keras.layers.Dense(3 * dim, name="qkv")
        self.qkv.build(input_shape)
        self.out = keras.layers.Dense(dim, name="out")
        self.out.build(input_shape)
        # Holds the attention dropout's seed state (the masks are drawn by the attention).
        self.attention_dropout = Dropout(self.dropout_rate)

    def call(self, x, attention_mask=None, segment_ids=None, training=None):
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        qkv = checkpoint_name(self.qkv(x), "qkv_proj")
        qkv = ops.reshape(qkv, (batch, length, 3, self.num_heads, self.head_dim))
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        options = {"chunk_size": self.chunk_size} if self.attention_kind == "blockwise" else {}
        if training and self.dropout_rate > 0:
            options.update(
                dropout_rate=self.dropout_rate,
                dropout_seed=self.attention_dropout.seed_generator.next(),
            )
        context = ATTENTION[self.attention_kind](
            query,
            key,
            value,
            mask=attention_mask,
            segment_ids=segment_ids,
            causal=self.causal,
            **options,
        )
        context = ops.reshape(context, (batch, length, self.num_heads * self.head_dim))
        return checkpoint_name(self.out(context), "attn_out")

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "dropout": self.dropout_rate,
            "causal": self.causal,
            "attention": self.attention_kind,
            "chunk_size": self.chunk_size,
        }


def gelu_tanh(x):
    """GELU's tanh approximation, which Flax's `nn.gelu` computes by default (so the original ViT
    and big_vision were trained with it); Keras' "gelu" is the exact erf form, as PyTorch's."""
    return keras.activations.gelu(x, approximate=True)


class Mlp(keras.layers.Layer):
    """The position-wise feed-forward network: Dense, GELU, Dense.

    `approximate_gelu` picks GELU's tanh approximation over the exact form: weights trained
    with one give slightly different outputs under the other.
    """

    def __init__(
        self, hidden_dim: int, dropout: float = 0.0, approximate_gelu: bool = False, **kwargs
    ):
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim
        self.dropout_rate = dropout
        self.approximate_gelu = approximate_gelu

    def build(self, input_shape):
        activation = gelu_tanh if self.approximate_gelu else "gelu"
        self.fc1 = keras.layers.Dense(self.hidden_dim, activation=activation, name="fc1")
        self.fc1.build(input_shape)
        self.fc2 = keras.layers.Dense(input_shape[-1], name="fc2")
        self.fc2.build((*input_shape[:-1], self.hidden_dim))
        self.dropout = Dropout(self.dropout_rate)

    def call(self, x, training=None):
        hidden = checkpoint_name(self.fc1(x), "mlp_in")
        return checkpoint_name(self.fc2(self.dropout(hidden, training=training)), "mlp_out")

    def get_config(self):
        return {
            **super().get_config(),
            "hidden_dim": self.hidden_dim,
            "dropout": self.dropout_rate,
            "approximate_gelu": self.approximate_gelu,
        }


class TransformerBlock(keras.layers.Layer):
    """Pre-LayerNorm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    `causal`, `attention` and `chunk_size` are the attention's (`MultiHeadAttention`).
    """

    def __init__(
        self,
        num_heads: int,
        mlp_dim: int,
        dropout: float = 0.0,
        approximate_gelu: bool = False,
        causal: bool = False,
        attention: str = "plain",
        chunk_size: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        _check_attention(attention)
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.dropout_rate = dropout
        self.approximate_gelu = approximate_gelu
        self.causal = causal
        self.attention_kind = attention
        self.chunk_size = chunk_size

    def build(self, input_shape):
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6, dtype="float32", name="norm1")
        self.norm1.build(input_shape)
        self.attention = MultiHeadAttention(
            self.num_heads,
            self.dropout_rate,
            causal=self.causal,
            attention=self.attention_kind,
            chunk_size=self.chunk_size,
            name="attention",
        )
        self.attention.build(input_shape)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6, dtype="float32", name="norm2")
        self.norm2.build(input_shape)
        self.mlp = Mlp(self.mlp_dim, self.dropout_rate, self.approximate_gelu, name="mlp")
        self.mlp.build(input_shape)
        self.dropout = Dropout(self.dropout_rate)

    def call(self, x, attention_mask=None, segment_ids=None, training=None):
        h = ops.cast(self.norm1(x), x.dtype)
        attended = self.attention(
            h, attention_mask=attention_mask, segment_ids=segment_ids, training=training
        )
        x = x + self.dropout(attended, training=training)
        h = ops.cast(self.norm2(x), x.dtype)
        return x + self.dropout(self.mlp(h, training=training), training=training)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout": self.dropout_rate,
            "approximate_gelu": self.approximate_gelu,
            "causal": self.causal,
            "attention": self.attention_kind,
            "chunk_size": self.chunk_size,
        }


def add_blocks(
    owner: keras.layers.Layer,
    depth: int,
    num_heads: int,
    mlp_dim: int,
    dropout: float,
    scan: bool = False,
    approximate_gelu: bool = False,
    **attention,
) -> None:
    """Gives `owner` `depth` TransformerBlocks: attributes `block_0`, `block_1`, ..., or with
    `scan=True` one `ScannedBlocks` attribute `scanned_blocks` holding them stacked in a loop.
    `approximate_gelu`: the blocks' MLPs use GELU's tanh approximation (see `Mlp`); `attention`:
    the blocks' `causal`, `attention` and `chunk_size`.

    One attribute per block, not a list: Keras 3 wraps a list attribute in a type that
    tf.train.Checkpoint does not track, so blocks held in a list would not be saved.
    """
    owner.depth = depth

    def make(name: str) -> TransformerBlock:
        return TransformerBlock(
            num_heads, mlp_dim, dropout, approximate_gelu, **attention, name=name
        )

    if scan:
        owner.scanned_blocks = ScannedBlocks(make, depth, name="scanned_blocks")
        return
    for i in range(depth):
        setattr(owner, f"block_{i}", make(f"block_{i}"))


def blocks_of(owner: keras.layers.Layer) -> list[TransformerBlock]:
    """The unrolled blocks `add_blocks` gave `owner`, in order (none when they are scanned)."""
    if hasattr(owner, "scanned_blocks"):
        return []
    return [getattr(owner, f"block_{i}") for i in range(owner.depth)]


def _block_layers(owner: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers holding the blocks: each unrolled block, or the one `ScannedBlocks`."""
    return blocks_of(owner) or [owner.scanned_blocks]


def build_blocks(owner: keras.layers.Layer, input_shape) -> None:
    for block in _block_layers(owner):
        block.build(input_shape)


def apply_blocks(owner: keras.layers.Layer, x, **kwargs):
    """Runs `x` through the blocks of `owner`, unrolled or scanned."""
    for block in _block_layers(owner):
        x = block(x, **kwargs)
    return x


def copy_weights(source: keras.layers.Layer, target: keras.layers.Layer) -> None:
    """Copies every weight of a transformer model into another of the same configuration, each
    with its blocks unrolled or scanned (`scan_layers`): how a checkpoint written by one layout is
    used by the other (restore it into a model of its own layout, then copy)."""
    same_layout = bool(blocks_of(source)) == bool(blocks_of(target))
    # In the models' order (the same for two models of one class and configuration): variable
    # paths are not unique (dropout seed states), so they cannot pair the variables.
    sources, targets = _weights(source, same_layout), _weights(target, same_layout)
    if [tuple(v.shape) for v in sources] != [tuple(v.shape) for v in targets]:
        raise ValueError(
            f"{source.name!r} and {target.name!r} have different weights: copy_weights needs "
            "two models of one configuration"
        )
    for a, b in zip(sources, targets):
        b.assign(a)
    if blocks_of(source) and not same_layout:
        stack_weights(blocks_of(source), target.scanned_blocks)
    elif not same_layout:
        unstack_weights(source.scanned_blocks, blocks_of(target))


def _weights(model: keras.layers.Layer, with_blocks: bool) -> list:
    """The model's variables, or only those outside its blocks."""
    if with_blocks:
        return list(model.variables)
    in_blocks = {id(v) for block in _block_layers(model) for v in block.variables}
    return [v for v in model.variables if id(v) not in in_blocks]
