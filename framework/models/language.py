"""Language models from `framework.models.transformer`: a decoder-only LM and a BERT-style encoder.

Both read packed rows, a dict {"tokens", "segment_ids", "positions"} of int32 [batch, length]
(framework.data.text): `positions` restart at 0 in every document and attention never crosses
`segment_ids`, so documents packed into one row do not see each other. Segment 0 is padding.

`DecoderLM` attends causally and reuses its token embedding as the output projection (tied).
`BertEncoder` attends both ways and ends in BERT's masked-LM head (dense, GELU, norm, tied
embedding, bias); given `masked_positions` [batch, P] it scores only those positions.
Logits are float32 under mixed precision. `*_parameter_count` give sizes without building.
`attention="blockwise"` computes attention in chunks of `attention_chunk` tokens, never holding
[batch, heads, S, S] (`framework.models.attention`); `loss_chunk` lets the trainer compute its
loss `loss_chunk` tokens at a time, never holding the logits (`framework.models.chunked_loss`):
the settings for long sequences and large vocabularies.
"""

from __future__ import annotations

import keras
from keras import ops

from framework.models.chunked_loss import chunked_losses, sparse_cross_entropy
from framework.models.dropout import Dropout
from framework.models.transformer import (
    TransformerBlock,
    add_blocks,
    apply_blocks,
    blocks_of,
    build_blocks,
)


def _init() -> keras.initializers.Initializer:
    """BERT's and GPT-2's initializer, a new one per weight: Keras gives each its seed when it
    is made, from the global seed set by then (one made at import would draw its seed before
    the run's `set_random_seed`, differently in each process, and give two weights the same
    values)."""
    return keras.initializers.RandomNormal(stddev=0.02)


class _TextTransformer(keras.Model):
    """Token and position embeddings, pre-LN blocks with a document mask, a final norm."""

    causal = False

    def __init__(
        self,
        *,
        vocab_size: int,
        max_length: int,
        dim: int,
        depth: int,
        num_heads: int,
        mlp_dim: int,
        dropout: float = 0.0,
        scan_layers: bool = False,
        attention: str = "plain",
        attention_chunk: int | None = None,
        loss_chunk: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if loss_chunk is not None and loss_chunk < 1:
            raise ValueError(f"loss_chunk must be a positive number of tokens, got {loss_chunk}")
        self.vocab_size = vocab_size
        self.loss_chunk = loss_chunk
        self.max_length = max_length
        self.dim = dim
        self.token_embedding = keras.layers.Embedding(
            vocab_size, dim, embeddings_initializer=_init(), name="token_embedding"
        )
        self.position_embedding = keras.layers.Embedding(
            max_length, dim, embeddings_initializer=_init(), name="position_embedding"
        )
        self.embed_dropout = Dropout(dropout)
        add_blocks(
            self,
            depth,
            num_heads,
            mlp_dim,
            dropout,
            scan=scan_layers,
            causal=self.causal,
            attention=attention,
            chunk_size=attention_chunk,
        )
        self.norm = keras.layers.LayerNormalization(epsilon=1e-6, dtype="float32", name="norm")

    @property
    def blocks(self) -> list[TransformerBlock]:
        return blocks_of(self)

    def build(self, input_shape=None):
        rows = (None, self.max_length)
        self.token_embedding.build(rows)
        self.position_embedding.build(rows)
        hidden = (None, self.max_length, self.dim)
        build_blocks(self, hidden)
        self.norm.build(hidden)
        self.built = True

    def embed(self, inputs):
        """Token plus position embeddings [batch, length, dim]."""
        tokens = inputs["tokens"]
        if tokens.shape[1] is not None and tokens.shape[1] > self.max_length:
            raise ValueError(
                f"rows of {tokens.shape[1]} tokens are longer than the model's max_length="
                f"{self.max_length}: raise max_length or lower the data's sequence_length"
            )
        return self.token_embedding(tokens) + self.position_embedding(inputs["positions"])

    def encode(self, inputs, training=None):
        """Final-norm hidden states [batch, length, dim] in the compute dtype."""
        x = self.embed_dropout(self.embed(inputs), training=training)
        x = apply_blocks(self, x, segment_ids=inputs["segment_ids"], training=training)
        return ops.cast(self.norm(x), x.dtype)

    def tied_logits(self, hidden):
        """float32 logits against the token embedding."""
        table = ops.cast(self.token_embedding.embeddings, "float32")
        return ops.matmul(ops.cast(hidden, "float32"), ops.transpose(table))

    def token_losses(self, hidden, labels, loss_fn=None, bias=None):
        """(float32 `loss_fn(logits, labels)`, predicted token) per label, from the tied logits
        (plus `bias`) in chunks of `loss_chunk` tokens: the logits are never whole. The loss is
        softmax cross-entropy when `loss_fn` is None."""
        if self.loss_chunk is None:
            raise ValueError(
                f"{self.name} computes its loss from labels only in chunks: give it loss_chunk"
            )
        return chunked_losses(
            hidden,
            self.token_embedding.embeddings,
            labels,
            chunk_size=self.loss_chunk,
            loss_fn=loss_fn or sparse_cross_entropy,
            bias=bias,
        )


class DecoderLM(_TextTransformer):
    """Causal LM: packed rows -> next-token logits [batch, length, vocab_size] (float32); given
    `labels` [batch, length] (and a `loss_fn`), (losses, predictions) instead
    (`token_losses`)."""

    causal = True

    def __init__(self, **config):
        super().__init__(**config)
        self.build()

    def call(self, inputs, training=None, labels=None, loss_fn=None):
        hidden = self.encode(inputs, training=training)
        if labels is not None:
            return self.token_losses(hidden, labels, loss_fn)
        return self.tied_logits(hidden)


class BertEncoder(_TextTransformer):
    """Bidirectional encoder with BERT's masked-LM head.

    Logits are [batch, P, vocab_size] at `inputs["masked_positions"]` ([batch, P]) when given,
    else [batch, length, vocab_size]; given `labels` of that shape, (losses, predictions)
    instead (`token_losses`).
    """

    def __init__(self, **config):
        super().__init__(**config)
        self.embed_norm = keras.layers.LayerNormalization(
            epsilon=1e-6, dtype="float32", name="embed_norm"
        )
        self.head_dense = keras.layers.Dense(
            self.dim, activation="gelu", kernel_initializer=_init(), name="head_dense"
        )
        self.head_norm = keras.layers.LayerNormalization(
            epsilon=1e-6, dtype="float32", name="head_norm"
        )
        self.build()

    def build(self, input_shape=None):
        super().build(input_shape)
        hidden = (None, self.max_length, self.dim)
        self.embed_norm.build(hidden)
        self.head_dense.build(hidden)
        self.head_norm.build(hidden)
        self.output_bias = self.add_weight(
            shape=(self.vocab_size,), initializer="zeros", name="output_bias"
        )

    def embed(self, inputs):
        x = super().embed(inputs)
        return ops.cast(self.embed_norm(x), x.dtype)

    def call(self, inputs, training=None, labels=None, loss_fn=None):
        hidden = self.encode(inputs, training=training)
        if "masked_positions" in inputs:
            hidden = ops.take_along_axis(
                hidden, ops.expand_dims(inputs["masked_positions"], -1), axis=1
            )
        hidden = ops.cast(self.head_norm(self.head_dense(hidden)), "float32")
        bias = ops.cast(self.output_bias, "float32")
        if labels is not None:
            return self.token_losses(hidden, labels, loss_fn, bias)
        return self.tied_logits(hidden) + bias


def block_parameter_count(dim: int, mlp_dim: int) -> int:
    """Weights of one TransformerBlock: fused qkv, output projection, MLP, two layer norms."""
    return 4 * dim * dim + 2 * dim * mlp_dim + 9 * dim + mlp_dim


def decoder_parameter_count(
    *, vocab_size: int, max_length: int, dim: int, depth: int, mlp_dim: int, **_
) -> int:
    """`DecoderLM(**config).count_params()` without building it (no memory needed)."""
    embeddings = (vocab_size + max_length) * dim
    return embeddings + depth * block_parameter_count(dim, mlp_dim) + 2 * dim


def bert_parameter_count(
    *, vocab_size: int, max_length: int, dim: int, depth: int, mlp_dim: int, **_
) -> int:
    """`BertEncoder(**config).count_params()` without building it."""
    head = dim * dim + dim + 2 * dim + vocab_size
    return (
        decoder_parameter_count(
            vocab_size=vocab_size, max_length=max_length, dim=dim, depth=depth, mlp_dim=mlp_dim
        )
        + 2 * dim
        + head
    )


DECODER_TINY = dict(vocab_size=1024, max_length=128, dim=128, depth=4, num_heads=4, mlp_dim=512)
DECODER_1B = dict(
    vocab_size=32_000, max_length=2048, dim=2048, depth=18, num_heads=16, mlp_dim=8192
)
BERT_TINY = dict(vocab_size=1024, max_length=128, dim=128, depth=2, num_heads=2, mlp_dim=512)
BERT_BASE = dict(vocab_size=30_522, max_length=512, dim=768, depth=12, num_heads=12, mlp_dim=3072)
BERT_LARGE = dict(vocab_size=30_522, max_length=512, dim=1024, depth=24, num_heads=16, mlp_dim=4096)


def decoder_tiny(**overrides) -> DecoderLM:
    """A CPU-sized decoder: width 128, 4 blocks, 4 heads, 1024 tokens (0.9 M parameters)."""
    return DecoderLM(**{**DECODER_TINY, **overrides})


def decoder_1b(**overrides) -> DecoderLM:
    """A pod-sized decoder: width 2048, 18 blocks, 16 heads, 32 k tokens, 2048 positions (976 M)."""
    return DecoderLM(**{**DECODER_1B, **overrides})


def bert_tiny(**overrides) -> BertEncoder:
    """A CPU-sized BERT: width 128, 2 blocks, 2 heads, 1024 tokens."""
    return BertEncoder(**{**BERT_TINY, **overrides})


def bert_base(**overrides) -> BertEncoder:
    """BERT-base: width 768, 12 blocks, 12 heads, BERT's 30522 tokens, 512 positions (110 M)."""
    return BertEncoder(**{**BERT_BASE, **overrides})


def bert_large(**overrides) -> BertEncoder:
    """BERT-large: width 1024, 24 blocks, 16 heads (335 M parameters)."""
    return BertEncoder(**{**BERT_LARGE, **overrides})
