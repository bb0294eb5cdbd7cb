"""Softmax cross-entropy over a vocabulary, chunk by chunk: the logits are never whole.

A language model's output projection gives [batch, S, vocab] float32 logits, and the loss's
gradient another tensor of that size: 2 GiB each for 8 x 2048 tokens and a 32 k vocabulary, 16 GiB
for a 256 k one. Remat cannot shrink them, since the loss computes them. `chunked_cross_entropy`
projects `chunk_size` tokens at a time, keeps each token's loss, its predicted token and the
log-sum-exp of its logits, and computes the gradient with a function of its own that projects
each chunk again: memory is chunk_size x vocab, whatever the number of tokens (the schedule of
MaxText's vocabulary tiling and Liger's fused linear cross-entropy, in plain TensorFlow ops).
"""

from __future__ import annotations

import math

import tensorflow as tf


def chunked_cross_entropy(
    hidden: tf.Tensor,
    table: tf.Tensor,
    labels: tf.Tensor,
    *,
    bias: tf.Tensor | None = None,
    chunk_size: int,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-token softmax cross-entropy of `labels` under the logits `hidden . table^T + bias`,
    and the most probable token, computed `chunk_size` tokens at a time.

    The same values as `tf.nn.sparse_softmax_cross_entropy_with_logits` over the whole float32
    logits (and their `argmax`), and the same gradients, without the logits.

    Args:
      hidden: [..., dim] hidden states (any float dtype; projected in float32).
      table: [vocab, dim] output projection (a tied embedding).
      labels: [...] integer token ids.
      bias: optional [vocab] output bias.
      chunk_size: tokens per chunk; the chunk's logits are chunk_size x vocab float32 values.

    Returns:
      (losses [...] float32, predictions [...] int32).
    """
    if chunk_size < 1:
        raise ValueError(f"chunked_cross_entropy's chunk_size must be positive, got {chunk_size}")
    dim = hidden.shape[-1]
    outer = tf.shape(labels)
    tokens = tf.reshape(tf.cast(hidden, tf.float32), [-1, dim])
    flat_labels = tf.reshape(tf.cast(labels, tf.int32), [-1])
    count = tf.shape(flat_labels)[0]
    chunks = (count + chunk_size - 1) // chunk_size
    padding = chunks * chunk_size - count
    tokens = tf.reshape(tf.pad(tokens, [[0, padding], [0, 0]]), [chunks, chunk_size, dim])
    flat_labels = tf.reshape(tf.pad(flat_labels, [[0, padding]]), [chunks, chunk_size])
    table = tf.cast(table, tf.float32)
    bias = tf.zeros([table.shape[0]], tf.float32) if bias is None else tf.cast(bias, tf.float32)
    losses, predictions = _losses(tokens, table, bias, flat_labels)
    unpad = lambda x: tf.reshape(tf.reshape(x, [-1])[:count], outer)  # noqa: E731
    return unpad(losses), unpad(predictions)


def default_chunk(vocab_size: int, logits_bytes: int = 64 * 2**20) -> int:
    """Tokens per chunk whose float32 logits take about `logits_bytes` (64 MiB by default):
    512 tokens for a 32 k vocabulary, 64 for 256 k."""
    return max(8, 2 ** int(math.log2(max(1, logits_bytes // (4 * vocab_size)))))


def _losses(tokens, table, bias, labels):
    """(losses, predictions) [chunks, chunk_size] with the gradient that re-projects chunks."""

    def logits_of(chunk_tokens):
        return tf.matmul(chunk_tokens, table, transpose_b=True) + bias

    @tf.custom_gradient
    def losses_of(tokens, table, bias):
        def forward(i, losses, predictions, log_sum_exps):
            logits = logits_of(tokens[i])
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels[i], logits=logits)
            return (
                i + 1,
                losses.write(i, loss),
                predictions.write(i, tf.argmax(logits, -1, output_type=tf.int32)),
                log_sum_exps.write(i, tf.reduce_logsumexp(logits, -1)),
            )

        chunks, chunk_size = tf.shape(tokens)[0], tokens.shape[1]

        def array(dtype):
            return tf.TensorArray(dtype, chunks, element_shape=[chunk_size])

        _, losses, predictions, log_sum_exps = tf.while_loop(
            lambda i, *_: i < chunks,
            forward,
            (tf.constant(0), array(tf.float32), array(tf.int32), array(tf.float32)),
        )
        log_sum_exps = log_sum_exps.stack()

        def gradient(d_losses, d_predictions=None):
            def backward(i, d_tokens, d_table, d_bias):
                logits = logits_of(tokens[i])
                d_logits = tf.exp(logits - log_sum_exps[i][:, None]) - tf.one_hot(
                    labels[i], table.shape[0]
                )
                d_logits *= d_losses[i][:, None]
                return (
                    i + 1,
                    d_tokens.write(i, tf.matmul(d_logits, table)),
                    d_table + tf.matmul(d_logits, tokens[i], transpose_a=True),
                    d_bias + tf.reduce_sum(d_logits, 0),
                )

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
