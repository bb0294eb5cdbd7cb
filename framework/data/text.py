"""Text data sets for language models: the user's files, tensorflow-text WordPiece, packed rows.

`text_lm` (decoder LM: predict the next token) and `text_mlm` (BERT masked LM) share one pipeline:

    files -> documents -> held-out split by content hash -> shuffle, repeat (train)
          -> FastWordpieceTokenizer in batches -> [BOS] doc [EOS] -> pack into rows of
          `sequence_length` (packing.py) -> global batches -> this pipeline's share -> examples

Everything after reading is TensorFlow ops inside `tf.data`; only JSON lines are decoded by
Python's `json`, once per line read. `TextCorpus` holds the configuration; its vocabulary is
learned once and kept in `vocab_path` (vocab.py): set it inside the run's model directory so
resuming and `framework.sample` tokenize the same way.

Global step `s` holds rows `[s * G, (s + 1) * G)` of one stream (G is the global batch), whatever
the number of input pipelines, and a resumed run (`start_step`) continues with the next rows.
Dynamic masking draws from TensorFlow's seeded random ops, so after a resume the masks differ from
the ones an uninterrupted run would have drawn (the tokens do not).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math

import numpy as np
import tensorflow as tf
import tensorflow_text as tf_text

from framework import checks
from framework.data import packing, sharding
from framework.data import vocab as vocab_lib

DOCUMENT_UNITS = ("line", "paragraph", "file")
_HASH_BUCKETS = 10_000
_PARAGRAPH_BREAK = "\x1e"  # ASCII record separator: a paragraph break, before splitting on it


def list_files(files: str | list[str] | tuple[str, ...]) -> list[str]:
    """Expands glob patterns (local or gs://) to files; directories a pattern matches are left
    out, and a pattern matching no file (nothing, or only directories) is a ValueError."""
    patterns = [files] if isinstance(files, str) else list(files)
    if not patterns:
        raise ValueError("no text files given: set `files` to one or more paths or patterns")
    found = []
    for pattern in patterns:
        matches = sorted(tf.io.gfile.glob(pattern))
        if not matches:
            raise ValueError(f"text file {pattern!r} not found (no file matches it)")
        # A directory would only fail later, inside tf.data, as "Is a directory".
        matches = [path for path in matches if not tf.io.gfile.isdir(path)]
        if not matches:
            raise ValueError(
                f"{pattern!r} in files is a directory, not a text file: name the files in it, "
                f"e.g. '{pattern.rstrip('/')}/*.txt'"
            )
        found.extend(matches)
    return found


def read_documents(
    files: str | list[str] | tuple[str, ...],
    document_per: str = "paragraph",
    json_field: str | None = None,
) -> tf.data.Dataset:
    """Documents (scalar strings) from text files, in file order; blank documents are dropped.

    `document_per` is "line", "paragraph" (blank-line separated) or "file". With `json_field`
    the files are JSON lines and each line's `json_field` is a document.
    """
    paths = list_files(files)
    if json_field is not None:
        for path in paths:
            next(_json_documents([path], json_field, first_only=True), None)
        documents = tf.data.Dataset.from_generator(
            lambda: _json_documents(paths, json_field),
            output_signature=tf.TensorSpec([], tf.string),
        )
    elif document_per == "line":
        documents = tf.data.TextLineDataset(paths)
    elif document_per in ("paragraph", "file"):
        documents = tf.data.Dataset.from_tensor_slices(paths).map(tf.io.read_file)
        if document_per == "paragraph":
            documents = documents.flat_map(_paragraphs)
    else:
        raise ValueError(f"document_per must be one of {DOCUMENT_UNITS}, got {document_per!r}")
    return documents.filter(lambda d: tf.logical_not(tf.strings.regex_full_match(d, r"\s*")))


def _paragraphs(text: tf.Tensor) -> tf.data.Dataset:
    marked = tf.strings.regex_replace(text, r"\n[ \t\r]*\n\s*", _PARAGRAPH_BREAK)
    return tf.data.Dataset.from_tensor_slices(tf.strings.split(marked, _PARAGRAPH_BREAK))


def _json_documents(paths: list[str], field: str, first_only: bool = False):
    """The `field` of each JSON line; `first_only` checks a file's first record up front."""
    for path in paths:
        with tf.io.gfile.GFile(path, "r") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(
                        f"{path}:{number}: not a JSON object with a {field!r} field"
                    ) from None
                yield str(text)
                if first_only:
                    break


def split_documents(documents: tf.data.Dataset, split: str, eval_fraction: float):
    """The train or eval share of `documents`, chosen by a hash of each document's text.

    Hashing the content keeps duplicates on one side and needs no document count.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be between 0 and 1, got {eval_fraction}")
    cut = int(round(eval_fraction * _HASH_BUCKETS))
    held_out = split == "eval"
    return documents.filter(
        lambda d: tf.equal(tf.strings.to_hash_bucket_fast(d, _HASH_BUCKETS) < cut, held_out)
    )


def make_tokenizer(vocab: list[str]) -> tf_text.FastWordpieceTokenizer:
    """WordPiece over whitespace-separated words, with detokenization, int32 ids."""
    return tf_text.FastWordpieceTokenizer(
        vocab,
        suffix_indicator="##",
        unknown_token=vocab_lib.UNK if vocab_lib.UNK in vocab else "[UNK]",
        no_pretokenization=True,
        support_detokenization=True,
        token_out_type=tf.int32,
    )


def tokenize(tokenizer: tf_text.FastWordpieceTokenizer, texts: tf.Tensor) -> tf.RaggedTensor:
    """Token ids [texts, (tokens)] of a batch of strings (words split on whitespace)."""
    return tokenizer.tokenize(tf.strings.split(texts)).merge_dims(-2, -1)


def detokenize(
    tokenizer: tf_text.FastWordpieceTokenizer, ids, drop_ids: tuple[int, ...] = ()
) -> tf.Tensor:
    """Text of id sequences [batch, (tokens)]; ids in `drop_ids` (padding, markers) are removed."""
    ids = tf.ragged.constant(ids) if isinstance(ids, list) else ids
    if not isinstance(ids, tf.RaggedTensor):
        ids = tf.RaggedTensor.from_tensor(ids)
    keep = tf.reduce_all(tf.not_equal(ids[..., None], list(drop_ids) or [-1]), axis=-1)
    return tokenizer.detokenize(tf.ragged.boolean_mask(ids, keep))


def _tokenized(documents, tokenizer, ids: dict[str, int], batch: int = 256):
    """Int32 token vectors [BOS] document [EOS], tokenizing `batch` documents at a time."""

    def encode(texts):
        tokens = tokenize(tokenizer, texts)
        rows = tokens.nrows()
        bos = tf.fill([rows, 1], ids[vocab_lib.BOS])
        eos = tf.fill([rows, 1], ids[vocab_lib.EOS])
        return tf.concat([bos, tokens, eos], axis=1)

    return documents.batch(batch).map(encode, num_parallel_calls=tf.data.AUTOTUNE).unbatch()


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


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """Where the text is and how it becomes rows: the configuration `text_lm`/`text_mlm` share.

    files: paths or glob patterns (local or gs://) of text files.
    vocab_path: the WordPiece vocabulary; read if it exists, else learned from the training
      documents and written there. Put it in the run's model directory (`framework.sample` finds
      it through the run's config.gin).
    vocab_size: the model's vocabulary size: the most tokens a learned vocabulary gets; a larger
      vocabulary file is a ValueError.
    sequence_length: tokens per packed row.
    document_per, json_field: how files split into documents (see `read_documents`).
    eval_fraction: share of the documents held out for "eval" (chosen by a hash of their text).
    seed: shuffles the training documents (a different order every epoch).
    vocab_documents: documents sampled to learn the vocabulary.
    log_stats: log documents, tokens, unigram entropy and padding share of each split (one pass).
    """

    files: tuple[str, ...] | str
    vocab_path: str | None = None
    vocab_size: int = 8192
    sequence_length: int = 128
    document_per: str = "paragraph"
    json_field: str | None = None
    eval_fraction: float = 0.1
    seed: int = 0
    shuffle_buffer: int = 10_000
    vocab_documents: int | None = 100_000
    log_stats: bool = True

    def __post_init__(self):
        files = [self.files] if isinstance(self.files, str) else self.files
        if not isinstance(files, (list, tuple)) or not all(isinstance(f, str) for f in files):
            raise TypeError(
                "TextCorpus.files must be a path or glob pattern, or a list of them, "
                f"got {self.files!r}"
            )
        if not isinstance(self.files, str):
            object.__setattr__(self, "files", tuple(self.files))
        if not isinstance(self.vocab_path, str):
            raise ValueError(
                "set TextCorpus.vocab_path to a file path, e.g. vocab.txt in the run's model "
                f"directory, got {self.vocab_path!r}"
            )
        checks.integer("TextCorpus.vocab_size", self.vocab_size)
        checks.integer("TextCorpus.sequence_length", self.sequence_length, minimum=2)
        checks.number("TextCorpus.eval_fraction", self.eval_fraction, maximum=1.0)
        checks.integer("TextCorpus.seed", self.seed, minimum=0)
        checks.integer("TextCorpus.shuffle_buffer", self.shuffle_buffer)
        checks.integer("TextCorpus.vocab_documents", self.vocab_documents, optional=True)
        checks.boolean("TextCorpus.log_stats", self.log_stats)

    def documents(self, split: str) -> tf.data.Dataset:
        """The split's documents, as strings."""
        documents = read_documents(self.files, self.document_per, self.json_field)
        return split_documents(documents, split, self.eval_fraction)

    def vocab(self) -> list[str]:
        """The vocabulary at `vocab_path`, learned from the training documents if missing."""
        return vocab_lib.build_or_load_vocab(
            self.vocab_path, self.documents("train"), self.vocab_size, self.vocab_documents
        )

    def tokens(self, split: str, vocab: list[str]) -> tf.data.Dataset:
        """The split's documents as int32 vectors [BOS] ... [EOS], in file order."""
        ids = vocab_lib.special_ids(vocab)
        return _tokenized(self.documents(split), make_tokenizer(vocab), ids)


def packed_rows(
    corpus: TextCorpus, split: str, global_batch: int, start_step: int = 0
) -> tuple[tf.data.Dataset, list[str]]:
    """Global batches of packed rows ({"tokens", "segment_ids", "positions"} [G, T]) and the vocab.

    "train" repeats forever, reshuffled each epoch from the corpus' seed, starting at global step
    `start_step`. "eval" holds the held-out documents once, its last batch filled up with empty
    rows (all padding, so they weigh nothing).
    """
    vocab = corpus.vocab()
    ids = vocab_lib.special_ids(vocab)
    pad, length = ids[vocab_lib.PAD], corpus.sequence_length
    chosen = corpus.documents(split)
    if not any(True for _ in chosen.take(1)):
        raise ValueError(
            f"the {split} split is empty: the corpus has too few documents for eval_fraction="
            f"{corpus.eval_fraction} (give more text or split it into more documents)"
        )
    if corpus.log_stats:
        _log_stats(corpus, split, tf.io.gfile.stat(corpus.vocab_path).mtime_nsec)
    if split == "train":
        chosen = chosen.shuffle(corpus.shuffle_buffer, seed=corpus.seed).repeat()
    rows = packing.pack_dataset(_tokenized(chosen, make_tokenizer(vocab), ids), length, pad)
    if split == "eval":
        empty = {
            "tokens": tf.fill([length], pad),
            "segment_ids": tf.zeros([length], tf.int32),
            "positions": tf.zeros([length], tf.int32),
        }
        rows = rows.concatenate(tf.data.Dataset.from_tensors(empty).repeat(global_batch - 1))
    batches = rows.batch(global_batch, drop_remainder=True)
    if split == "train":
        batches = batches.skip(start_step)
    return batches, vocab


@functools.lru_cache(maxsize=16)
def split_stats(corpus: TextCorpus, split: str, vocab_version: int = 0) -> dict[str, float]:
    """Documents, tokens, unigram entropy and padding share of a split (cached per vocab file)."""
    vocab = corpus.vocab()
    tokens = corpus.tokens(split, vocab)
    stats = corpus_stats(tokens, len(vocab))
    pad = vocab_lib.special_ids(vocab)[vocab_lib.PAD]
    rows = packing.pack_dataset(tokens, corpus.sequence_length, pad)
    stats["padding_share"] = packing.padding_share(rows)
    return stats


def _log_stats(corpus: TextCorpus, split: str, vocab_version: int) -> None:
    if (corpus, split, vocab_version) in _LOGGED:
        return
    _LOGGED.add((corpus, split, vocab_version))
    stats = split_stats(corpus, split, vocab_version)
    logging.info(
        "%s text: %d documents, %d tokens, unigram entropy %.3f nats/token, padding %.1f%%",
        split,
        stats["documents"],
        stats["tokens"],
        stats["unigram_entropy"],
        100 * stats["padding_share"],
    )


_LOGGED: set = set()


def _pipeline_share(batches: tf.data.Dataset, part: sharding.Share) -> tf.data.Dataset:
    """This pipeline's rows of each global batch, re-batched per replica."""
    if part.rows < part.global_batch:
        batches = batches.map(
            lambda rows: tf.nest.map_structure(
                lambda x: x[part.first : part.first + part.rows], rows
            )
        )
    return batches.unbatch().batch(part.per_replica, drop_remainder=True)


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
    """Masked positions per row: ceil(rate * length), the most `RandomItemSelector` picks."""
    return max(1, math.ceil(sequence_length * mask_rate))


def mlm_example(
    rows: dict[str, tf.Tensor],
    ids: dict[str, int],
    vocab_size: int,
    mask_rate: float = 0.15,
):
    """(inputs, labels, weights) for BERT's masked LM on packed rows [B, T].

    tensorflow-text picks ceil(mask_rate * tokens) positions of each row ([PAD], [BOS], [EOS]
    excluded) and replaces 80% of them by [MASK], 10% by a random token, and keeps 10%. Labels
    and weights are [B, P] over the picked positions (`inputs["masked_positions"]`), P =
    `max_predictions`; unused slots weigh 0.
    """
    tokens, segments = rows["tokens"], rows["segment_ids"]
    batch, length = tokens.shape
    limit = max_predictions(length, mask_rate)
    lengths = tf.reduce_sum(tf.cast(segments > 0, tf.int64), axis=1)
    selector = tf_text.RandomItemSelector(
        max_selections_per_batch=limit,
        selection_rate=mask_rate,
        unselectable_ids=[ids[vocab_lib.PAD], ids[vocab_lib.BOS], ids[vocab_lib.EOS]],
    )
    chooser = tf_text.MaskValuesChooser(vocab_size, ids[vocab_lib.MASK], 0.8, 0.1)
    masked, positions, labels = tf_text.mask_language_model(
        tf.RaggedTensor.from_tensor(tokens, lengths=lengths), selector, chooser
    )
    inputs = dict(rows)
    inputs["tokens"] = masked.to_tensor(ids[vocab_lib.PAD], shape=[batch, length])
    inputs["masked_positions"] = tf.cast(positions, tf.int32).to_tensor(0, shape=[batch, limit])
    weights = tf.ones_like(labels, tf.float32).to_tensor(0.0, shape=[batch, limit])
    return inputs, labels.to_tensor(0, shape=[batch, limit]), weights


def text_lm(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    corpus: TextCorpus,
) -> tf.data.Dataset:
    """Next-token batches ({"tokens", "segment_ids", "positions"}, targets, weights), each [B, T].

    A data set function (`sharding.DatasetFn`): each input pipeline serves its replicas' rows of
    every global batch.
    """
    part = sharding.share(global_batch_size, input_context)
    batches, _ = packed_rows(corpus, split, part.global_batch, start_step)
    dataset = _pipeline_share(batches, part)
    return dataset.map(lm_example, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def text_mlm(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    corpus: TextCorpus,
    mask_rate: float = 0.15,
) -> tf.data.Dataset:
    """Masked-LM batches ({"tokens", "segment_ids", "positions", "masked_positions"}, labels,
    weights): tokens [B, T], the rest [B, P] (see `mlm_example`). Arguments as in `text_lm`.
    """
    checks.number("text_mlm.mask_rate", mask_rate, maximum=1.0)
    part = sharding.share(global_batch_size, input_context)
    batches, vocab = packed_rows(corpus, split, part.global_batch, start_step)
    ids = vocab_lib.special_ids(vocab)
    dataset = _pipeline_share(batches, part)
    return dataset.map(
        lambda rows: mlm_example(rows, ids, len(vocab), mask_rate),
        num_parallel_calls=tf.data.AUTOTUNE,
    ).prefetch(tf.data.AUTOTUNE)
