"""Dot-product attention, plain or blockwise: the same result, with or without [batch, heads, S, S].

Both functions take query, key and value [batch, length, heads, head_dim] and return the context
[batch, length, heads, head_dim]. Which keys a query sees is the conjunction of `mask` (boolean,
broadcasting to [batch, heads, query, key]), `segment_ids` ([batch, length]: a query sees the keys
of its own segment, so documents packed into one row do not see each other) and `causal` (no later
key). Attention dropout draws its mask with `framework.models.dropout`, whose value for each
element depends only on the seed and the element's position.

`plain_attention` computes the scores of every query and key at once: the scores, the softmax and
(in training) its gradient are [batch, heads, S, S] float32 tensors, the largest values of a
transformer step at long sequences, which remat cannot shrink because a block computes them.

`blockwise_attention` computes the same function in chunks of queries and keys with an online
softmax (Rabe and Staats, 2021; the schedule of FlashAttention-2, Dao 2023), in plain TensorFlow
ops that XLA compiles for any device. Its gradient is its own: the forward pass keeps only the
output and each query's log-sum-exp, and the backward pass recomputes each chunk's scores, so
memory grows with S x chunk, not S x S. With `causal`, key chunks that lie wholly after a query
chunk are skipped (about half the work). Dropout drops, element for element, what the plain
path's would with the same seed, computed chunk by chunk and never stored. Matrix products run in
the inputs' dtype (bfloat16 under mixed precision) and are accumulated over chunks in float32.

A query with no key to see: plain attention spreads its weight evenly over every key; blockwise,
over the keys of the chunks it visits. Such queries are padding, whose loss weight is 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import keras
import tensorflow as tf
from keras import ops

from framework.core import tf_internals
from framework.models.dropout import dropped, keep_mask, keep_window, mask_key

_MASKED = -1e9  # the score of a key a query does not see
DEFAULT_CHUNK = 512


def document_mask(segment_ids: tf.Tensor, causal: bool) -> tf.Tensor:
    """Boolean [batch, 1, query, key]: same segment (and, if causal, not a later token)."""
    return _visible(segment_ids, segment_ids, tf.range(tf.shape(segment_ids)[1]), None, causal)


def _visible(query_segments, key_segments, query_positions, key_positions, causal):
    """Which keys each query sees by segment and position, [batch, 1, query, key]."""
    visible = tf.equal(query_segments[:, :, None], key_segments[:, None, :])
    if causal:
        key_positions = query_positions if key_positions is None else key_positions
        visible &= query_positions[:, None] >= key_positions[None, :]
    return visible[:, None]


def plain_attention(
    query: tf.Tensor,
    key: tf.Tensor,
    value: tf.Tensor,
    *,
    mask: tf.Tensor | None = None,
    segment_ids: tf.Tensor | None = None,
    causal: bool = False,
    dropout_rate: float = 0.0,
    dropout_seed: tf.Tensor | None = None,
) -> tf.Tensor:
    """Softmax(query . key / sqrt(head_dim)) . value over whole [batch, heads, S, S] scores.

    Scores and softmax in float32; dropout (when `dropout_seed` is given) on the probabilities.
    """
    _check_arguments(dropout_rate, segment_ids, causal)
    # Keras' ops, as the models' attention has always been written: XLA's schedule of the step
    # (and so its memory, under some schedulers) depends on the exact ops.
    logits = ops.einsum("bqhd,bkhd->bhqk", query, key) * (query.shape[-1] ** -0.5)
    logits = ops.cast(logits, "float32")
    visible = _dense_visible(mask, segment_ids, causal)
    if visible is not None:
        logits = ops.where(visible, logits, _MASKED)
    weights = ops.cast(ops.softmax(logits, axis=-1), query.dtype)
    if dropout_seed is not None and dropout_rate > 0:
        keep = keep_mask(_static_or_dynamic(weights), dropout_rate, dropout_seed)
        weights = dropped(weights, keep, dropout_rate)
    return ops.einsum("bhqk,bkhd->bqhd", weights, value)


def _check_arguments(dropout_rate: float, segment_ids, causal: bool) -> None:
    if not 0 <= dropout_rate < 1:
        raise ValueError(f"attention's dropout_rate must be in [0, 1), got {dropout_rate}")
    if causal and segment_ids is None:
        raise ValueError("causal attention here needs segment_ids (all zeros for one segment)")


def _dense_visible(mask, segment_ids, causal):
    visible = mask
    if segment_ids is not None:
        documents = document_mask(segment_ids, causal)
        visible = documents if visible is None else tf.logical_and(visible, documents)
    return visible


def _static_or_dynamic(x: tf.Tensor) -> tf.TensorShape | tf.Tensor:
    return x.shape if x.shape.is_fully_defined() else tf.shape(x)


def default_chunk(length: int, target: int = DEFAULT_CHUNK) -> int:
    """The chunk for `length` positions: as close to `target` as splits them into equal chunks
    with the least padding (197 -> 197, 1000 -> 500, 8192 -> 512)."""
    return math.ceil(length / math.ceil(length / target))


def blockwise_attention(
    query: tf.Tensor,
    key: tf.Tensor,
    value: tf.Tensor,
    *,
    mask: tf.Tensor | None = None,
    segment_ids: tf.Tensor | None = None,
    causal: bool = False,
    dropout_rate: float = 0.0,
    dropout_seed: tf.Tensor | None = None,
    chunk_size: int | None = None,
) -> tf.Tensor:
    """`plain_attention`'s result in chunks of `chunk_size` queries and keys (by default
    `default_chunk` of the length; at most the length), never holding [batch, heads, S, S]
    (see the module).

    The length must be static. A `mask` is sliced per chunk, so it may broadcast over any axis;
    give `segment_ids` and `causal` rather than a dense mask where they say the same: the dense
    mask is itself S x S (booleans).
    """
    _check_arguments(dropout_rate, segment_ids, causal)
    length = query.shape[1]
    if length is None:
        raise ValueError("blockwise_attention needs a static sequence length (query.shape[1])")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"blockwise_attention's chunk_size must be positive, got {chunk_size}")
    chunk = min(chunk_size or default_chunk(length), length)
    dropout = None
    if dropout_seed is not None and dropout_rate > 0:
        dropout = (dropout_rate, mask_key(dropout_seed))
    plan = _Chunks(query, value, chunk, causal, mask, segment_ids, dropout)
    context = _attend(plan, *(plan.to_chunks(t) for t in (query, key, value)))
    return plan.from_chunks(context)


class _Chunks:
    """One call's chunking: the shapes, which keys each chunk pair sees, and its dropout."""

    def __init__(self, query, value, chunk, causal, mask, segment_ids, dropout):
        self.length, self.chunk, self.causal = query.shape[1], chunk, causal
        self.chunks = math.ceil(self.length / chunk)
        self.padded = self.chunks * chunk
        self.dtype = query.dtype
        self.scale = query.shape[-1] ** -0.5
        batch = query.shape[0] if query.shape[0] is not None else tf.shape(query)[0]
        heads = query.shape[2]
        # One chunk's static shapes, None for a batch known only when the step runs.
        self.query_chunk = tf.TensorShape([query.shape[0], chunk, heads, query.shape[3]])
        self.value_chunk = tf.TensorShape([query.shape[0], chunk, heads, value.shape[3]])
        self.rows = tf.TensorShape([query.shape[0], heads, chunk])
        self.probability_shape = [batch, heads, chunk, chunk]
        whole = [batch, heads, self.length, self.length]
        self.full_shape = tf.TensorShape(whole) if isinstance(batch, int) else tf.stack(whole)
        self.dropout = dropout  # (rate, mask key) or None
        self.mask = None if mask is None else _pad_mask(tf.convert_to_tensor(mask), self)
        self.segments = None
        if segment_ids is not None:
            self.segments = self.to_chunks(tf.convert_to_tensor(segment_ids))

    def to_chunks(self, x: tf.Tensor) -> tf.Tensor:
        """[batch, length, ...] -> [chunks, batch, chunk, ...], zero-padded."""
        x = tf.pad(x, [[0, 0], [0, self.padded - self.length]] + [[0, 0]] * (x.shape.rank - 2))
        shape = tf.concat([tf.shape(x)[:1], [self.chunks, self.chunk], tf.shape(x)[2:]], 0)
        x = tf.reshape(x, shape)
        return tf.transpose(x, [1, 0, *range(2, x.shape.rank)])

    def from_chunks(self, x: tf.Tensor) -> tf.Tensor:
        x = tf.transpose(x, [1, 0, *range(2, x.shape.rank)])
        shape = tf.concat([tf.shape(x)[:1], [self.padded], tf.shape(x)[3:]], 0)
        return tf.reshape(x, shape)[:, : self.length]

    def key_chunks(self, query_chunk: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The key chunks [first, last) a query chunk visits."""
        return tf.constant(0), (query_chunk + 1 if self.causal else tf.constant(self.chunks))

    def query_chunks(self, key_chunk: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The query chunks [first, last) that visit a key chunk."""
        return (key_chunk if self.causal else tf.constant(0)), tf.constant(self.chunks)

    def scores(self, query, key, i, j) -> tf.Tensor:
        """float32 scores [batch, heads, chunk, chunk] of query chunk i and key chunk j, a key
        the query does not see at `_MASKED`."""
        scores = tf.cast(tf.einsum("bqhd,bkhd->bhqk", query, key) * self.scale, tf.float32)
        visible = self._visible(i, j)
        return scores if visible is None else tf.where(visible, scores, _MASKED)

    def _visible(self, i, j):
        query_positions = i * self.chunk + tf.range(self.chunk)
        key_positions = j * self.chunk + tf.range(self.chunk)
        visible = None
        if self.segments is not None:
            visible = _visible(
                self.segments[i], self.segments[j], query_positions, key_positions, self.causal
            )
        if self.mask is not None:
            part = self._mask_chunk(i, j)
            visible = part if visible is None else visible & part
        if self.padded > self.length:
            real = (key_positions < self.length)[None, None, None, :]
            visible = real if visible is None else visible & real
        return visible

    def _mask_chunk(self, i, j):
        begin = [0, 0, 0, 0]
        size = [-1, -1, -1, -1]
        for axis, index in ((2, i), (3, j)):
            if self.mask.shape[axis] != 1:
                begin[axis], size[axis] = index * self.chunk, self.chunk
        return tf.slice(self.mask, tf.stack(begin), size)

    def drop(self, x: tf.Tensor, i, j) -> tf.Tensor:
        """`x` [batch, heads, chunk, chunk] of chunk pair (i, j) under the dropout of the whole
        [batch, heads, length, length] probabilities (scaled by 1 / (1 - rate))."""
        if self.dropout is None:
            return x
        rate, key = self.dropout
        window = (
            [0, 0, i * self.chunk, j * self.chunk],
            self.probability_shape,
        )
        return dropped(x, keep_window(self.full_shape, window, rate, key), rate)


def _pad_mask(mask: tf.Tensor, plan: _Chunks) -> tf.Tensor:
    """The mask as rank 4, its query and key axes padded (with False) to the chunked length."""
    while mask.shape.rank < 4:
        mask = mask[None]
    extra = plan.padded - plan.length
    paddings = [[0, 0], [0, 0]] + [
        [0, extra if mask.shape[axis] == plan.length else 0] for axis in (2, 3)
    ]
    return tf.pad(mask, paddings)


def _attend(plan: _Chunks, query: tf.Tensor, key: tf.Tensor, value: tf.Tensor) -> tf.Tensor:
    """Attention over chunk-major [chunks, batch, chunk, heads, head_dim] tensors, with the
    gradient that recomputes each chunk pair's scores."""

    @tf.custom_gradient
    def attend(query, key, value):
        context, log_sum_exp = _forward(plan, query, key, value)

        def gradient(d_context):
            return _backward(plan, query, key, value, context, log_sum_exp, d_context)

        return context, gradient

    return attend(query, key, value)


def _forward(plan: _Chunks, query, key, value):
    """The context and each query's float32 log-sum-exp of its scores [chunks, batch, heads,
    chunk], one query chunk at a time with an online softmax over its key chunks."""

    def query_chunk(i, contexts, log_sum_exps):
        def key_chunk(j, top, total, accumulated):
            scores = plan.scores(query[i], key[j], i, j)
            new_top = tf.maximum(top, tf.reduce_max(scores, -1))
            probabilities = tf.exp(scores - new_top[..., None])
            rescale = tf.exp(top - new_top)
            total = total * rescale + tf.reduce_sum(probabilities, -1)
            weighted = tf.einsum(
                "bhqk,bkhd->bqhd", plan.drop(tf.cast(probabilities, plan.dtype), i, j), value[j]
            )
            accumulated = accumulated * _per_query(rescale) + tf.cast(weighted, tf.float32)
            return j + 1, new_top, total, accumulated

        first, last = plan.key_chunks(i)
        _, top, total, accumulated = tf.while_loop(
            lambda j, *_: j < last,
            key_chunk,
            (
                first,
                _zeros(plan.rows, query) - math.inf,
                _zeros(plan.rows, query),
                _zeros(plan.value_chunk, query),
            ),
        )
        context = tf.cast(accumulated / _per_query(total), plan.dtype)
        return (
            i + 1,
            contexts.write(i, context),
            log_sum_exps.write(i, top + tf.math.log(total)),
        )

    _, contexts, log_sum_exps = tf.while_loop(
        lambda i, *_: i < plan.chunks,
        query_chunk,
        (
            tf.constant(0),
            tf.TensorArray(plan.dtype, plan.chunks, element_shape=plan.value_chunk),
            tf.TensorArray(tf.float32, plan.chunks, element_shape=plan.rows),
        ),
    )
    return contexts.stack(), log_sum_exps.stack()


def _zeros(shape: tf.TensorShape, like: tf.Tensor) -> tf.Tensor:
    """float32 zeros of a chunk's `shape`, its batch from `like` ([chunks, batch, ...]) when
    the batch is not static."""
    dims = [tf.shape(like)[1] if d is None else d for d in shape]
    return tf.zeros(dims, tf.float32)


def _per_query(rows: tf.Tensor) -> tf.Tensor:
    """[batch, heads, chunk] -> [batch, chunk, heads, 1], to scale a context chunk."""
    return tf.transpose(rows, [0, 2, 1])[..., None]


def _backward(plan: _Chunks, query, key, value, context, log_sum_exp, d_context):
    """Gradients of query, key and value: one key chunk at a time, over the query chunks that
    visit it, recomputing each pair's probabilities from the saved log-sum-exp."""
    d_context = tf.cast(d_context, plan.dtype)
    # Each query's sum over keys of probability x gradient of the probability, which the
    # softmax's gradient subtracts: the context's inner product with its own gradient.
    deltas = tf.reduce_sum(tf.cast(d_context, tf.float32) * tf.cast(context, tf.float32), -1)
    deltas = tf.transpose(deltas, [0, 1, 3, 2])

    def key_chunk(j, d_query, d_keys, d_values):
        def query_chunk(i, d_key, d_value, d_query):
            probabilities = tf.exp(plan.scores(query[i], key[j], i, j) - log_sum_exp[i][..., None])
            dropped = plan.drop(tf.cast(probabilities, plan.dtype), i, j)
            d_value += tf.cast(tf.einsum("bhqk,bqhd->bkhd", dropped, d_context[i]), tf.float32)
            d_dropped = tf.einsum("bqhd,bkhd->bhqk", d_context[i], value[j])
            d_probabilities = tf.cast(plan.drop(d_dropped, i, j), tf.float32)
            d_scores = probabilities * (d_probabilities - deltas[i][..., None])
            d_scores = tf.cast(d_scores, plan.dtype) * tf.cast(plan.scale, plan.dtype)
            d_key += tf.cast(tf.einsum("bhqk,bqhd->bkhd", d_scores, query[i]), tf.float32)
            d_query_i = tf.einsum("bhqk,bkhd->bqhd", d_scores, key[j])
            d_query = tf.tensor_scatter_nd_add(d_query, [[i]], tf.cast(d_query_i, tf.float32)[None])
            return i + 1, d_key, d_value, d_query

        first, last = plan.query_chunks(j)
        _, d_key, d_value, d_query = tf.while_loop(
            lambda i, *_: i < last,
            query_chunk,
            (first, _zeros(plan.query_chunk, query), _zeros(plan.value_chunk, query), d_query),
        )
        return j + 1, d_query, d_keys.write(j, d_key), d_values.write(j, d_value)

    _, d_query, d_keys, d_values = tf.while_loop(
        lambda j, *_: j < plan.chunks,
        key_chunk,
        (
            tf.constant(0),
            tf.zeros_like(query, tf.float32),
            tf.TensorArray(tf.float32, plan.chunks, element_shape=plan.query_chunk),
            tf.TensorArray(tf.float32, plan.chunks, element_shape=plan.value_chunk),
        ),
    )
    return tuple(tf.cast(d, plan.dtype) for d in (d_query, d_keys.stack(), d_values.stack()))


def use_blockwise_attention(
    model: keras.layers.Layer, chunk_size: int | None = None
) -> list[keras.layers.MultiHeadAttention]:
    """Computes the attention of every `keras.layers.MultiHeadAttention` in `model` with
    `blockwise_attention`, in place; returns those layers. keras-hub's models (GPT-2, BERT, ViT,
    ...) attend through subclasses of that layer, so this is one line on them too.

    The layers keep their weights, projections and masks; only the softmax attention between
    them changes. A call the blockwise path does not cover runs the layer's own computation:
    query and key of different lengths (generation with a key/value cache), attention scores
    asked for, attention over other axes. Attention dropout draws its masks from the layer's own
    seed state, by `framework.models.dropout`'s hash: the same rate, other masks than Keras'
    dropout would have drawn.

    Raises:
      ValueError: `model` holds no `keras.layers.MultiHeadAttention`, or one that computes its
        attention in its own `call`.
    """
    layers = [
        layer
        for layer in tf_internals.flatten_layers(model, recursive=True)
        if isinstance(layer, keras.layers.MultiHeadAttention)
    ]
    if not layers:
        raise ValueError(
            f"{model.name} holds no keras.layers.MultiHeadAttention: nothing to make blockwise "
            "(give your own attention layer blockwise_attention instead)"
        )
    own = sorted(
        {type(x).__name__ for x in layers if not tf_internals.calls_attention_computation(x)}
    )
    if own:
        raise ValueError(
            f"{', '.join(own)} in {model.name} derive from keras.layers.MultiHeadAttention but "
            "compute their attention in their own call, which this would not change: give "
            "that computation blockwise_attention instead"
        )
    for layer in layers:
        tf_internals.set_attention_computation(
            layer,
            _blockwise_computation(layer, tf_internals.attention_computation(layer), chunk_size),
        )
    return layers


def _blockwise_computation(layer, own: Callable, chunk_size: int | None) -> Callable:
    def compute(
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
    ):
        covered = (
            not return_attention_scores
            and query.shape.rank == 4
            and tuple(layer.attention_axes or (1,)) == (1,)
            and query.shape[1] is not None
            and query.shape[1] == key.shape[1]
        )
        if not covered:
            return own(
                query,
                key,
                value,
                attention_mask=attention_mask,
                training=training,
                return_attention_scores=return_attention_scores,
                use_causal_mask=use_causal_mask,
            )
        options = {}
        if training and layer.dropout > 0:
            options = {
                "dropout_rate": layer.dropout,
                "dropout_seed": tf_internals.attention_dropout_seed(layer),
            }
        mask = None if attention_mask is None else tf.cast(attention_mask, tf.bool)
        if mask is not None and mask.shape.rank == 3:  # [batch, query, key]: one for all heads
            mask = mask[:, None]
        segments = tf.zeros(tf.shape(query)[:2], tf.int32) if use_causal_mask else None
        context = blockwise_attention(
            query,
            key,
            value,
            mask=mask,
            segment_ids=segments,
            causal=use_causal_mask,
            chunk_size=chunk_size,
            **options,
        )
        return context, None

    return compute
