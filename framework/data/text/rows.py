"""Packed rows of a `TokenSource`, each pipeline's share of every global batch, and the position
each step's batch begins at, so that a resumed run seeks there (see the package docstring); the
corpus statistics logged at set-up."""

from __future__ import annotations

import functools
import logging

import numpy as np
import tensorflow as tf

from framework.data import positions, sharding, streams
from framework.data.text import packing
from framework.data.text.corpus import TextCorpus
from framework.data.text.sources import TokenSource, TrainStream
from framework.data.text.tokens import Vocabulary


def corpus_stats(tokens: tf.data.Dataset, vocab_size: int) -> dict[str, float]:
    """Documents, predicted tokens and their unigram entropy in nats (what a bigram-blind model
    would score); the first token of each document ([BOS]) is never predicted, so it is left out.
    """

    def add(counts, doc):
        return counts + tf.math.bincount(
            doc[1:], minlength=vocab_size, maxlength=vocab_size, dtype=tf.int64
        )

    def count(n, _):
        return n + 1

    counts = tokens.reduce(tf.zeros([vocab_size], tf.int64), add).numpy()
    total = counts.sum()
    p = counts[counts > 0] / max(total, 1)
    return {
        "documents": int(tokens.reduce(tf.constant(0, tf.int64), count).numpy()),
        "tokens": int(total),
        "unigram_entropy": float(-(p * np.log(p)).sum()),
    }


def _check_not_empty(documents: tf.data.Dataset, split: str, corpus) -> None:
    if not any(True for _ in documents.take(1)):
        hint = (
            f"the corpus has too few documents for eval_fraction={corpus.eval_fraction} (give "
            "more text or split it into more documents)"
            if isinstance(corpus, TextCorpus)
            else "check the files or split it reads"
        )
        raise ValueError(f"the {split} split is empty: {hint}")


def packed_rows(
    corpus: TokenSource,
    split: str,
    part: sharding.Share,
    start_step: int = 0,
    stream_positions: positions.StreamPositions | None = None,
) -> tuple[tf.data.Dataset, Vocabulary]:
    """This pipeline's packed rows ({"tokens", "segment_ids", "positions"}, each [T]) in the
    order of its replicas' batches, and the vocabulary.

    "train" is endless, from global step `start_step`: the documents of epoch after epoch
    (`_train_documents`), packed, cut into the rows of each global step (this pipeline's own
    rows when it reads its own data, else its share of the global rows). With
    `stream_positions` the pipeline records where each step's batch begins, and starts at the
    saved position of `start_step` when the run was restored with one; else it reads its stream
    up to `start_step`. "eval" holds the split once, in order, packed into global batches, the
    last one filled up with empty rows (all padding, so they weigh nothing), and this
    pipeline's share of each.
    """
    vocabulary = corpus.vocabulary()
    pad, length = vocabulary.pad, corpus.sequence_length
    if split == "eval":
        documents = corpus.eval_tokens(vocabulary)
        _check_not_empty(documents, split, corpus)
        if corpus.log_stats:
            _log_stats(corpus, split, vocabulary)
        empty = {
            "tokens": tf.fill([length], pad),
            "segment_ids": tf.zeros([length], tf.int32),
            "positions": tf.zeros([length], tf.int32),
        }
        rows = packing.pack_dataset(documents, length, pad)
        rows = rows.concatenate(tf.data.Dataset.from_tensors(empty).repeat(part.global_batch - 1))
        batches = rows.batch(part.global_batch, drop_remainder=True)
        return _rows_of(batches, part), vocabulary
    if split != "train":
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    read_own = corpus.reads_own(part)
    stream = corpus.train_stream(vocabulary, part, read_own)
    _check_not_empty(_kept_units(stream, tf.constant(0, tf.int64)), split, corpus)
    if corpus.log_stats:
        _log_stats(corpus, split, vocabulary)
    saved = _saved_position(stream_positions, part, start_step)
    start = tuple(int(x) for x in saved[:_ROW]) if saved is not None else (0, 0, 0, 0)
    rows = _positioned_rows(_train_documents(stream, corpus, *start), length, pad)
    batches = rows.skip(int(saved[_ROW]) if saved is not None else 0)
    batches = batches.batch(part.rows if read_own else part.global_batch, drop_remainder=True)
    if saved is None:
        batches = batches.skip(start_step)

    def noted(step, batch):
        rows = {key: value for key, value in batch.items() if key != "position"}
        if stream_positions is None:
            return rows
        with tf.control_dependencies([stream_positions.record(step, batch["position"][0])]):
            return tf.nest.map_structure(tf.identity, rows)

    batches = batches.enumerate(start_step).map(noted)
    return (batches.unbatch() if read_own else _rows_of(batches, part)), vocabulary


# A training row's position (`positions.StreamPositions`): where its packing window begins - the
# epoch, the shuffle block, the block's first raw unit, the window's first document in the
# permuted block - and the row's index among the window's rows.
_EPOCH, _BLOCK, _RAW, _DOCUMENT, _ROW = range(5)
_DECODE_BATCH = 64


def _saved_position(
    stream_positions: positions.StreamPositions | None, part: sharding.Share, start_step: int
) -> np.ndarray | None:
    """Where this pipeline's stream resumes, if it can seek; logs how it resumes."""
    if start_step == 0:
        return None
    saved = None
    if stream_positions is not None:
        saved = stream_positions.saved_position(part.pipeline, part.pipelines, start_step)
    if saved is None:
        why = (
            "no stream positions: a TPU pod's pipelines, which run on its hosts, or a direct call"
            if stream_positions is None
            else "the checkpoint holds none for this step and number of input pipelines"
        )
        logging.info(
            "reading the training stream up to step %d (%s): the rows before it are read, "
            "tokenized, packed and dropped",
            start_step,
            why,
        )
        return None
    logging.info(
        "pipeline %d resumes its training stream at step %d where it stopped (epoch %d, "
        "shuffle block %d, raw unit %d)",
        *(part.pipeline, start_step, saved[_EPOCH], saved[_BLOCK], saved[_RAW]),
    )
    return saved


def _kept_units(stream: TrainStream, epoch: tf.Tensor, raw_start: int = 0) -> tf.data.Dataset:
    """(raw index, document) of the epoch's documents that are trained on, from raw unit
    `raw_start`: the units before it are read past, not decoded."""
    units = stream.raw(epoch).skip(raw_start).enumerate(raw_start)
    if stream.decode is not None:
        units = units.batch(_DECODE_BATCH).map(
            lambda index, batch: (index, stream.decode(*tf.nest.flatten(batch))),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        units = units.unbatch()
    if stream.keep is not None:
        units = units.filter(lambda index, document: stream.keep(document))
    return units


def _epoch_documents(
    stream: TrainStream, corpus: TokenSource, epoch: tf.Tensor, block: int = 0, raw_start: int = 0
) -> tf.data.Dataset:
    """(position [epoch, block, its first raw unit, index in the block], document) of an epoch
    from shuffle block `block` (which begins at raw unit `raw_start`): blocks of
    `shuffle_buffer` documents, each in the permutation of `streams.block_order`."""
    epoch = tf.cast(epoch, tf.int64)

    def permute(index, batch):
        raw, documents = batch
        size = tf.shape(raw, out_type=tf.int64)[0]
        order = streams.block_order(size, corpus.seed, epoch, index)
        where = tf.stack(
            [tf.fill([size], epoch), tf.fill([size], index), tf.fill([size], raw[0])], 1
        )
        where = tf.concat([where, tf.range(size)[:, None]], 1)
        return where, tf.gather(documents, order)

    units = _kept_units(stream, epoch, raw_start).batch(corpus.shuffle_buffer)
    return units.enumerate(block).map(permute).unbatch()


def _train_documents(
    stream: TrainStream, corpus: TokenSource, epoch: int, block: int, raw: int, document: int
) -> tf.data.Dataset:
    """(position, token vector) of the endless training documents, epoch after epoch, from
    document `document` of shuffle block `block` (beginning at raw unit `raw`) of `epoch`."""
    first = _epoch_documents(stream, corpus, tf.constant(epoch, tf.int64), block, raw)
    later = tf.data.Dataset.range(epoch + 1, streams.ENDLESS).flat_map(
        lambda number: _epoch_documents(stream, corpus, number)
    )
    documents = first.skip(document).concatenate(later).batch(packing.WINDOW)
    encoded = documents.map(
        lambda where, texts: (where, stream.encode(texts)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return encoded.unbatch()


def _positioned_rows(documents: tf.data.Dataset, length: int, pad: int) -> tf.data.Dataset:
    """Packed rows of `packing.WINDOW` documents at a time (`packing.pack`), each with its position:
    its window's first document's and its index among the window's rows."""

    def pack(where, tokens):
        rows = packing.pack(tokens, length, pad)
        count = tf.shape(rows["tokens"], out_type=tf.int64)[0]
        first = tf.tile(where[:1], [count, 1])
        rows["position"] = tf.concat([first, tf.range(count)[:, None]], 1)
        return rows

    windows = documents.ragged_batch(packing.WINDOW)
    return windows.map(pack, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()


def _rows_of(batches: tf.data.Dataset, part: sharding.Share) -> tf.data.Dataset:
    """This pipeline's rows of each global batch, one by one."""
    if part.rows < part.global_batch:
        batches = batches.map(
            lambda rows: tf.nest.map_structure(
                lambda x: x[part.first : part.first + part.rows], rows
            )
        )
    return batches.unbatch()


def split_stats(corpus: TokenSource, split: str) -> dict[str, float]:
    """Documents, tokens, unigram entropy and padding share of the eval split or of the
    training sample (`sample_tokens`), computed once per corpus, split and vocabulary."""
    return _split_stats(corpus, split, corpus.vocabulary())


@functools.lru_cache(maxsize=16)
def _split_stats(corpus: TokenSource, split: str, vocabulary: Vocabulary) -> dict[str, float]:
    if split == "eval":
        tokens = corpus.eval_tokens(vocabulary)
    else:
        tokens = corpus.sample_tokens(vocabulary)
    stats = corpus_stats(tokens, vocabulary.size)
    rows = packing.pack_dataset(tokens, corpus.sequence_length, vocabulary.pad)
    stats["padding_share"] = packing.padding_share(rows)
    return stats


def _log_stats(corpus: TokenSource, split: str, vocabulary: Vocabulary) -> None:
    if (corpus, split, vocabulary) in _LOGGED:
        return
    _LOGGED.add((corpus, split, vocabulary))
    stats = _split_stats(corpus, split, vocabulary)
    logging.info(
        "%s text%s: %d documents, %d tokens, unigram entropy %.3f nats/token, padding %.1f%%",
        split,
        " (the vocabulary's sample)" if split == "train" else "",
        stats["documents"],
        stats["tokens"],
        stats["unigram_entropy"],
        100 * stats["padding_share"],
    )


_LOGGED: set = set()
