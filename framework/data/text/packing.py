"""Packing tokenized documents into fixed-length rows, so XLA sees one static shape.

A window of documents becomes rows of `length` tokens: documents longer than a row are cut into
row-sized chunks, and each chunk goes into the first row that still has room for it (first-fit,
which leaves less padding than filling rows in order). Every token lands exactly once. Each row
carries `segment_ids` (1, 2, ... for the chunks in it, 0 for padding), so attention can be kept
inside a document, and `positions` (restarting at 0 in every chunk). It is all tensor ops over
the window: no Python per document.
"""

from __future__ import annotations

import tensorflow as tf

WINDOW = 256  # documents packed together


def _first_fit(chunk_lengths: tf.Tensor, length: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Row, offset in the row and segment id (1, 2, ...) of each chunk, placing each chunk in the
    first row with room for it (first-fit). At most one row per chunk, so the state is a vector of
    row fills as long as the window.
    """
    slots = tf.size(chunk_lengths)
    zero = tf.constant(0, chunk_lengths.dtype)

    def place(state, chunk_length):
        fills, counts, _, _, _ = state
        row = tf.argmax(fills + chunk_length <= length, output_type=chunk_lengths.dtype)
        at = tf.reshape(row, [1, 1])
        fills = tf.tensor_scatter_nd_add(fills, at, tf.reshape(chunk_length, [1]))
        counts = tf.tensor_scatter_nd_add(counts, at, tf.ones([1], counts.dtype))
        return fills, counts, row, fills[row] - chunk_length, counts[row]

    empty = tf.zeros([slots], chunk_lengths.dtype)
    _, _, rows, offsets, segments = tf.scan(
        place, chunk_lengths, initializer=(empty, empty, zero, zero, zero)
    )
    return rows, offsets, segments


def pack(documents: tf.RaggedTensor, length: int, pad_id: int = 0) -> dict[str, tf.Tensor]:
    """Packs a ragged batch [documents, (tokens)] into rows of `length` tokens.

    Returns {"tokens", "segment_ids", "positions"}, each int32 [rows, length]; empty documents are
    skipped.
    """
    documents = tf.cast(documents, tf.int32)
    doc_lengths = tf.cast(documents.row_lengths(), tf.int32)
    chunk_index = tf.ragged.range((doc_lengths + length - 1) // length)
    chunk_lengths = tf.minimum(
        length,
        tf.gather(doc_lengths, chunk_index.value_rowids()) - chunk_index.flat_values * length,
    )
    chunks = tf.RaggedTensor.from_row_lengths(documents.flat_values, chunk_lengths)
    rows, offsets, segments = _first_fit(chunk_lengths, length)
    num_rows = tf.reduce_max(tf.concat([rows + 1, [0]], 0))

    chunk_of_token = tf.cast(chunks.value_rowids(), tf.int32)
    position = tf.range(tf.size(chunks.flat_values)) - tf.gather(
        tf.cast(chunks.row_starts(), tf.int32), chunk_of_token
    )
    row_of_token = tf.gather(rows, chunk_of_token)
    segment = tf.gather(segments, chunk_of_token)
    index = tf.stack([row_of_token, tf.gather(offsets, chunk_of_token) + position], axis=1)
    shape = tf.stack([num_rows, length])

    def scatter(values, fill):
        return tf.tensor_scatter_nd_update(tf.fill(shape, fill), index, values)

    return {
        "tokens": scatter(chunks.flat_values, pad_id),
        "segment_ids": scatter(segment, 0),
        "positions": scatter(position, 0),
    }


def pack_dataset(
    documents: tf.data.Dataset, length: int, pad_id: int = 0, window: int = WINDOW
) -> tf.data.Dataset:
    """Rows of `pack` from a dataset of token vectors, packing `window` documents at a time."""
    windows = documents.ragged_batch(window)
    rows = windows.map(lambda docs: pack(docs, length, pad_id), num_parallel_calls=tf.data.AUTOTUNE)
    return rows.unbatch()


def padding_share(rows: tf.data.Dataset) -> float:
    """Fraction of row slots holding padding, over a finite dataset of packed rows."""

    def add(totals, row):
        used = tf.reduce_sum(tf.cast(row["segment_ids"] > 0, tf.int64))
        return totals + tf.stack([used, tf.size(row["segment_ids"], out_type=tf.int64)])

    used, slots = rows.reduce(tf.zeros([2], tf.int64), add).numpy()
    return float(1.0 - used / slots) if slots else 0.0
