"""Training examples from packed rows: next-token prediction (`text_lm`) and BERT's masked LM with
masks drawn afresh for every batch, keyed by position (`text_mlm`): the data set functions the
language-model configs bind."""

from __future__ import annotations

import math

import tensorflow as tf

from framework.core import checks
from framework.data import positions, sharding, streams
from framework.data.text import vocab as vocab_lib
from framework.data.text.rows import packed_rows
from framework.data.text.sources import TokenSource


def lm_example(rows: dict[str, tf.Tensor]):
    """(inputs, targets, weights) for next-token prediction on packed rows [B, T].

    The target of position i is the token at i + 1 when both are in the same document; other
    positions (a document's last token, padding, the row's end) weigh 0.
    """
    tokens, segments = rows["tokens"], rows["segment_ids"]
    targets = tf.concat([tokens[:, 1:], tf.zeros_like(tokens[:, :1])], axis=1)
    next_segment = tf.concat([segments[:, 1:], tf.zeros_like(segments[:, :1])], axis=1)
    weights = tf.cast((segments > 0) & tf.equal(segments, next_segment), tf.float32)
    return dict(rows), targets, weights


def max_predictions(sequence_length: int, mask_rate: float) -> int:
    """Masked positions per row: ceil(rate * length), the most `mlm_example` picks."""
    return max(1, math.ceil(sequence_length * mask_rate))


def mlm_example(
    rows: dict[str, tf.Tensor],
    ids: dict[str, int],
    vocab_size: int,
    mask_rate: float,
    key: tf.Tensor,
):
    """(inputs, labels, weights) for BERT's masked LM on packed rows [B, T].

    Picks ceil(mask_rate * tokens) positions of each row ([PAD], [BOS], [EOS] excluded; `ids`
    may lack [BOS] and [EOS]), at most `max_predictions`, and replaces 80% of them by [MASK],
    10% by a random token, and keeps 10%, as BERT does. Every draw is stateless, keyed by `key`
    (int64[2]: the seed and the batch's first global row), so the masks of a batch are the
    same whenever it is read - in a resumed run too. Labels and weights are [B, P] over the
    picked positions (`inputs["masked_positions"]`, ascending), P = `max_predictions`; unused
    slots weigh 0.
    """
    tokens, segments = rows["tokens"], rows["segment_ids"]
    batch, length = tokens.shape
    limit = max_predictions(length, mask_rate)
    special = [ids[name] for name in (vocab_lib.PAD, vocab_lib.BOS, vocab_lib.EOS) if name in ids]
    selectable = (segments > 0) & ~tf.reduce_any(
        tokens[..., None] == tf.constant(special, tokens.dtype), axis=-1
    )
    count = tf.reduce_sum(tf.cast(selectable, tf.float64), axis=1)
    wanted = tf.minimum(tf.cast(tf.math.ceil(count * mask_rate), tf.int32), limit)
    pick_key, choice_key, token_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
    scores = tf.where(selectable, tf.random.stateless_uniform([batch, length], pick_key), -1.0)
    best = tf.argsort(scores, axis=1, direction="DESCENDING")[:, :limit]
    chosen = tf.range(limit)[None, :] < wanted[:, None]
    positions = tf.sort(tf.where(chosen, best, length), axis=1)  # unused slots last
    chosen = positions < length
    positions = tf.where(chosen, positions, 0)
    originals = tf.gather(tokens, positions, batch_dims=1)
    choice = tf.random.stateless_uniform([batch, limit], choice_key)
    random_tokens = tf.random.stateless_uniform(
        [batch, limit], token_key, maxval=vocab_size, dtype=tokens.dtype
    )
    mask = tf.fill([batch, limit], tf.constant(ids[vocab_lib.MASK], tokens.dtype))
    values = tf.where(choice < 0.8, mask, tf.where(choice < 0.9, random_tokens, originals))
    where = tf.stack([tf.broadcast_to(tf.range(batch)[:, None], [batch, limit]), positions], -1)
    inputs = dict(rows)
    inputs["tokens"] = tf.tensor_scatter_nd_update(
        tokens, tf.boolean_mask(where, chosen), tf.boolean_mask(values, chosen)
    )
    inputs["masked_positions"] = positions
    weights = tf.cast(chosen, tf.float32)
    return inputs, tf.where(chosen, originals, tf.zeros_like(originals)), weights


def _check_split(split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def text_lm(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    corpus: TokenSource,
    stream_positions: positions.StreamPositions | None = None,
) -> tf.data.Dataset:
    """Next-token batches ({"tokens", "segment_ids", "positions"}, targets, weights), each [B, T].

    A data set function (`sharding.DatasetFn`) over any `TokenSource`: each input pipeline
    serves its replicas' rows of every global batch. With `stream_positions` (the trainer's),
    a resumed run starts reading where it stopped (`packed_rows`).
    """
    _check_split(split)
    part = sharding.share(global_batch_size, input_context)
    rows, _ = packed_rows(corpus, split, part, start_step, stream_positions)
    dataset = rows.batch(part.per_replica, drop_remainder=True)
    return dataset.map(lm_example, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def text_mlm(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    corpus: TokenSource,
    mask_rate: float = 0.15,
    stream_positions: positions.StreamPositions | None = None,
) -> tf.data.Dataset:
    """Masked-LM batches ({"tokens", "segment_ids", "positions", "masked_positions"}, labels,
    weights): tokens [B, T], the rest [B, P] (see `mlm_example`). Arguments as in `text_lm`.
    """
    _check_split(split)
    checks.number("text_mlm.mask_rate", mask_rate, maximum=1.0)
    part = sharding.share(global_batch_size, input_context)
    rows, vocabulary = packed_rows(corpus, split, part, start_step, stream_positions)
    if vocabulary.mask is None:
        raise ValueError(
            "masked LM needs a [MASK] token: set TokenRecords.mask_id to its id in the vocabulary"
        )
    ids = vocabulary.special_ids()
    dataset = rows.batch(part.per_replica, drop_remainder=True)
    # Batch n of this pipeline: global step n // per_step, its replica batch n % per_step.
    per_step = part.rows // part.per_replica
    numbers = tf.data.Dataset.range(start_step * per_step, streams.ENDLESS)
    sign = 1 if split == "train" else -1  # eval's keys never meet train's

    def example(number, rows):
        step, slot = number // per_step, number % per_step
        first_row = step * part.global_batch + part.first + slot * part.per_replica
        key = tf.stack([tf.constant(corpus.seed, tf.int64), sign * (first_row + 1)])
        return mlm_example(rows, ids, vocabulary.size, mask_rate, key)

    dataset = tf.data.Dataset.zip((numbers, dataset))
    return dataset.map(example, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
