"""A loss over a vocabulary, chunk by chunk: the logits are never whole.

A language model's output projection gives [batch, S, vocab] float32 logits, and the loss's
gradient another tensor of that size: 2 GiB each for 8 x 2048 tokens and a 32 k vocabulary, 16 GiB
for a 256 k one. Remat cannot shrink them, since the loss computes them. `chunked_losses` projects
`chunk_size` tokens at a time and keeps each token's loss and predicted token; its gradient is a
function of its own that projects each chunk again and differentiates the loss of that chunk
alone: memory is chunk_size x vocab, whatever the number of tokens (the schedule of MaxText's
vocabulary tiling and Liger's fused linear cross-entropy, in plain TensorFlow ops).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def sparse_cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Softmax cross-entropy of integer labels, per label: the default loss."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def chunked_losses(
    hidden: tf.Tensor,
    table: tf.Tensor,
    labels: tf.Tensor,
    *,
    chunk_size: int,
    loss_fn: LossFn = sparse_cross_entropy,
    bias: tf.Tensor | None = None,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-token `loss_fn(logits, labels)` under the float32 logits `hidden . table^T + bias`,
    and the most probable token, computed `chunk_size` tokens at a time.

    The same values as `loss_fn` over the whole logits (and their `argmax`), and the same
    gradients, without the logits: `loss_fn` is called on one chunk's logits [chunk_size, vocab]
    and labels at a time, so any per-label loss works (label smoothing, soft labels).

    Args:
      hidden: [..., dim] hidden states (any float dtype; projected in float32).
      table: [vocab, dim] output projection (a tied embedding).
      labels: [...] integer token ids, or [..., vocab] class probabilities.
      chunk_size: tokens per chunk; the chunk's logits are chunk_size x vocab float32 values.
      loss_fn: per-label loss of (logits, labels); softmax cross-entropy by default.
      bias: optional [vocab] output bias.

    Returns:
      (losses [...] float32, predictions [...] int32).
    """
    if chunk_size < 1:
        raise ValueError(f"chunked_losses' chunk_size must be positive, got {chunk_size}")
    outer = tf.shape(hidden)[:-1]
    tokens = tf.reshape(tf.cast(hidden, tf.float32), [-1, hidden.shape[-1]])
    per_token = labels.shape[hidden.shape.rank - 1 :]  # [] or [vocab]
    labels = tf.reshape(labels, [-1, *per_token])
    count = tf.shape(tokens)[0]
    chunks = (count + chunk_size - 1) // chunk_size

    def to_chunks(x):
        padding = [[0, chunks * chunk_size - count]] + [[0, 0]] * (x.shape.rank - 1)
        return tf.reshape(tf.pad(x, padding), [chunks, chunk_size, *x.shape[1:]])

    table = tf.cast(table, tf.float32)
    bias = tf.zeros([table.shape[0]], tf.float32) if bias is None else tf.cast(bias, tf.float32)
    losses, predictions = _losses(to_chunks(tokens), table, bias, to_chunks(labels), loss_fn)
    return tuple(tf.reshape(tf.reshape(x, [-1])[:count], outer) for x in (losses, predictions))


def _losses(tokens, table, bias, labels, loss_fn):
    """(losses, predictions) [chunks, chunk_size] with the gradient that re-projects chunks."""
    chunks, chunk_size = tf.shape(tokens)[0], tokens.shape[1]

    def loss_of(i, chunk, table, bias):
        logits = tf.matmul(chunk, table, transpose_b=True) + bias
        return tf.cast(loss_fn(logits, labels[i]), tf.float32), logits

    @tf.custom_gradient
    def losses_of(tokens, table, bias):
        def forward(i, losses, predictions):
            loss, logits = loss_of(i, tokens[i], table, bias)
            predicted = tf.argmax(logits, -1, output_type=tf.int32)
            return i + 1, losses.write(i, loss), predictions.write(i, predicted)

        def array(dtype):
            return tf.TensorArray(dtype, chunks, element_shape=[chunk_size])

        _, losses, predictions = tf.while_loop(
            lambda i, *_: i < chunks,
            forward,
            (tf.constant(0), array(tf.float32), array(tf.int32)),
        )

        def gradient(d_losses, d_predictions=None):
            def backward(i, d_tokens, d_table, d_bias):
                chunk = tokens[i]
                with tf.GradientTape() as tape:
                    tape.watch([chunk, table, bias])
                    loss = tf.reduce_sum(loss_of(i, chunk, table, bias)[0] * d_losses[i])
                d_chunk, d_table_i, d_bias_i = tape.gradient(loss, [chunk, table, bias])
                return i + 1, d_tokens.write(i, d_chunk), d_table + d_table_i, d_bias + d_bias_i

            _, d_tokens, d_table, d_bias = tf.while_loop(
                lambda i, *_: i < chunks,
                backward,
                (
                    tf.constant(0),
                    tf.TensorArray(tf.float32, chunks, element_shape=tokens.shape[1:]),
                    tf.zeros_like(table),
                    tf.zeros_like(bias),
                ),
            )
            return d_tokens.stack(), d_table, d_bias

        return (losses.stack(), predictions.stack()), gradient

    return losses_of(tokens, table, bias)
