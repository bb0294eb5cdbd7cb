"""Language-model data: text or token ids from files or TFDS, packed into rows of tokens.

`text_lm` (decoder LM: predict the next token) and `text_mlm` (BERT masked LM) read any of three
sources (`TokenSource`), each a frozen dataclass bound in gin as `data.text_lm.corpus`:

- `TextCorpus`: the user's text files (plain text, or JSON lines with a text field decoded in the
  graph, json_lines.py), split into train and eval by a hash of each document.
- `tfds_text.TfdsText`: a text feature of a TensorFlow Datasets data set (lm1b, c4, ...), its
  own splits.
- `token_records.TokenRecords`: TFRecord files of token ids tokenized elsewhere (seqio caches).

The two text sources tokenize with tensorflow-text's WordPiece; the vocabulary is learned once,
from a bounded sample spread over the corpus, and kept in `vocab_path` (vocab.py): set it inside
the run's model directory so resuming and `framework.sample` tokenize the same way. From there on
one pipeline, TensorFlow ops inside `tf.data` (no Python per document):

    documents -> [BOS] tokens [EOS] -> pack into rows of `sequence_length` (packing.py)
      train: epochs, each in an order drawn from (seed, epoch) -> rows of each global step ->
             this pipeline's rows
      eval:  the split once, in order -> global batches, the last one padded with empty rows

Global step `s` holds rows `[s * G, (s + 1) * G)` of a stream (G is the global batch), and a
resumed run (`start_step`) continues with the next rows. Which document step `s` begins in
depends on the length of every document before it, so the pipeline records where each step's
batch begins (`positions.StreamPositions`: the epoch, the shuffle block, the raw unit the block
begins at, the packing window's first document, the row in the window), the trainer saves it
with each checkpoint, and a resumed pipeline seeks there: it reads past the raw lines (or
records) before the block undecoded, and decodes, tokenizes and packs from the block's start.
Without a saved position (a checkpoint from before positions, another number of pipelines, a TPU
pod whose pipelines run on other hosts, a direct call), the rows before `s` are read, tokenized,
packed and dropped. `sharding` chooses how pipelines (one per host) share the data: 'read_all'
builds one global stream in every pipeline and keeps its rows of each batch (the same stream for
any number of hosts); 'read_own' gives pipeline i of P every P-th file (or the i-th TFDS
sub-split), so each host reads 1/P of the data, and its stream depends on P; 'auto' reads own
files when there are at least as many as pipelines. Eval is read whole by every pipeline, so
each example counts once and every replica runs the same steps.

Masked-LM masks are drawn afresh for every batch (dynamic masking), by stateless ops keyed by the
seed and the batch's first global row: a resumed run draws the masks the uninterrupted one would
have, and each evaluation masks the same positions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import tensorflow as tf
import tensorflow_text as tf_text

from framework.core import checks
from framework.data import json_lines, packing, positions, sharding, streams, tfrecord
from framework.data import vocab as vocab_lib

DOCUMENT_UNITS = ("line", "paragraph", "file")

# A corpus shipped with the package, so that the example language-model configs run anywhere
# without a download: a frozen copy of three of this project's documentation pages (about 75 KB),
# its own file, so that editing the documentation does not change their data.
# Gin names it %data.SAMPLE_CORPUS.
SAMPLE_CORPUS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "corpus", "framework_docs.txt"
)
_HASH_BUCKETS = 10_000
_PARAGRAPH_BREAK = "\x1e"  # ASCII record separator: a paragraph break, before splitting on it


def _file_reader(document_per: str, json_field: str | None):
    """path -> the documents of one text file (strings, blank ones dropped), in graph ops."""
    if json_field is not None:
        read = functools.partial(json_lines.read_field, field=json_field)
    elif document_per == "line":
        read = tf.data.TextLineDataset
    elif document_per in ("paragraph", "file"):

        def read(path):
            whole = tf.data.Dataset.from_tensors(tf.io.read_file(path))
            return whole.flat_map(_paragraphs) if document_per == "paragraph" else whole

    else:
        raise ValueError(f"document_per must be one of {DOCUMENT_UNITS}, got {document_per!r}")

    def documents(path):
        return read(path).filter(not_blank)

    return documents


def not_blank(document: tf.Tensor) -> tf.Tensor:
    """Whether a document holds more than whitespace: blank ones would be [BOS] [EOS] only."""
    return tf.logical_not(tf.strings.regex_full_match(document, r"\s*"))


def read_documents(
    files: str | Sequence[str],
    document_per: str = "paragraph",
    json_field: str | None = None,
) -> tf.data.Dataset:
    """Documents (scalar strings) from text files, in file order; blank documents are dropped.

    `document_per` is "line", "paragraph" (blank-line separated) or "file". With `json_field`
    the files are JSON lines and each line's `json_field` is a document: decoded in the graph
    (json_lines.py), the first lines of the first files checked against Python's `json` here,
    and a bad line further on stops the pipeline with an error naming file:line.
    """
    paths = _text_files(files, json_field)
    return tf.data.Dataset.from_tensor_slices(paths).flat_map(
        _file_reader(document_per, json_field)
    )


def _text_files(files: str | Sequence[str], json_field: str | None) -> list[str]:
    """The files of `TextCorpus.files`; JSON lines files checked (`check_against_json`)."""
    paths = tfrecord.list_files(files, "TextCorpus.files")
    if json_field is not None:
        json_lines.check_against_json(paths, json_field)
    return paths


def _paragraphs(text: tf.Tensor) -> tf.data.Dataset:
    marked = tf.strings.regex_replace(text, r"\n[ \t\r]*\n\s*", _PARAGRAPH_BREAK)
    return tf.data.Dataset.from_tensor_slices(tf.strings.split(marked, _PARAGRAPH_BREAK))


def split_documents(documents: tf.data.Dataset, split: str, eval_fraction: float):
    """The train or eval share of `documents`, chosen by a hash of each document's text.

    Hashing the content keeps duplicates on one side and needs no document count.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be between 0 and 1, got {eval_fraction}")
    return documents.filter(_in_split(split, eval_fraction))


def _in_split(split: str, eval_fraction: float) -> Callable[[tf.Tensor], tf.Tensor]:
    """document -> whether it belongs to `split` (a hash of its text)."""
    cut = int(round(eval_fraction * _HASH_BUCKETS))
    held_out = split == "eval"
    return lambda d: tf.equal(tf.strings.to_hash_bucket_fast(d, _HASH_BUCKETS) < cut, held_out)


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


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """What packing and masking need of a vocabulary: its size and the special tokens' ids.

    `bos`/`eos` None: nothing is added around documents (token records that carry their own
    markers); `mask` None: the source cannot serve masked LM. `tokens`: the WordPiece tokens of
    the text sources (empty for token records).
    """

    size: int
    pad: int
    bos: int | None
    eos: int | None
    mask: int | None
    tokens: tuple[str, ...] = ()

    @classmethod
    def of(cls, tokens: list[str]) -> Vocabulary:
        """The vocabulary of a token list with the reserved tokens (vocab.RESERVED_TOKENS)."""
        ids = vocab_lib.special_ids(tokens)
        return cls(
            len(tokens),
            ids[vocab_lib.PAD],
            ids[vocab_lib.BOS],
            ids[vocab_lib.EOS],
            ids[vocab_lib.MASK],
            tuple(tokens),
        )

    def special_ids(self) -> dict[str, int]:
        """The ids of the special tokens the vocabulary has, by name (vocab.PAD, ...)."""
        names = (vocab_lib.PAD, vocab_lib.BOS, vocab_lib.EOS, vocab_lib.MASK)
        ids = (self.pad, self.bos, self.eos, self.mask)
        return {name: i for name, i in zip(names, ids) if i is not None}


def with_markers(tokens: tf.RaggedTensor, vocabulary: Vocabulary) -> tf.RaggedTensor:
    """[BOS] tokens [EOS] of each row, the markers the vocabulary has."""
    rows = tokens.nrows()
    parts = [tf.fill([rows, 1], marker) for marker in (vocabulary.bos,) if marker is not None]
    parts.append(tokens)
    parts += [tf.fill([rows, 1], marker) for marker in (vocabulary.eos,) if marker is not None]
    return tf.concat(parts, axis=1) if len(parts) > 1 else tokens


def tokenized(
    documents: tf.data.Dataset,
    tokenizer: tf_text.FastWordpieceTokenizer,
    vocabulary: Vocabulary,
    batch: int = 256,
) -> tf.data.Dataset:
    """Int32 token vectors [BOS] document [EOS], tokenizing `batch` documents at a time."""
    encode = encoder(tokenizer, vocabulary)
    return documents.batch(batch).map(encode, num_parallel_calls=tf.data.AUTOTUNE).unbatch()


def encoder(
    tokenizer: tf_text.FastWordpieceTokenizer, vocabulary: Vocabulary
) -> Callable[[tf.Tensor], tf.RaggedTensor]:
    """texts [n] -> their token vectors [BOS] ... [EOS] (ragged int32 [n, (tokens)])."""
    return lambda texts: with_markers(tokenize(tokenizer, texts), vocabulary)


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
class TrainStream:
    """A source's training data, in the form a resumed run can seek in: raw units that are
    cheap to read past (lines, records), and what turns them into token vectors.

    raw(epoch): the epoch's raw units in an order drawn from (seed, epoch), the same every time.
    encode(documents): token vectors (ragged int32 [n, (tokens)]) of a batch of documents.
    decode(*units): a batch of raw units (batched as `raw` yields them) -> their documents, one
      each (None: the units are the documents).
    keep(document): whether a document is trained on (None: all).
    """

    raw: Callable[[tf.Tensor], tf.data.Dataset]
    encode: Callable[[tf.Tensor], tf.RaggedTensor]
    decode: Callable[..., tf.Tensor] | None = None
    keep: Callable[[tf.Tensor], tf.Tensor] | None = None


class TokenSource(Protocol):
    """What `text_lm` and `text_mlm` read: `TextCorpus`, `tfds_text.TfdsText` or
    `token_records.TokenRecords`.

    Each is a frozen (hashable) dataclass with `sequence_length`, `seed`, `shuffle_buffer` and
    `log_stats` settings, and:
      vocabulary(): learned or loaded once; every call gives the same.
      reads_own(part): whether the pipeline `part` reads its own part of the training data.
      train_stream(vocabulary, part, read_own): the training data, this pipeline's own or all
        (`TrainStream`): raw units per epoch, in an order drawn from (seed, epoch), and how they
        become token vectors (int32, [BOS] ... [EOS] where the vocabulary has them).
      eval_tokens(vocabulary): the eval split's token vectors, once, in a fixed order.
      sample_tokens(vocabulary): a bounded sample of the training split, for `split_stats`.
    """

    sequence_length: int
    seed: int
    shuffle_buffer: int
    log_stats: bool

    def vocabulary(self) -> Vocabulary: ...

    def reads_own(self, part: sharding.Share) -> bool: ...

    def train_stream(
        self, vocabulary: Vocabulary, part: sharding.Share, read_own: bool
    ) -> TrainStream: ...

    def eval_tokens(self, vocabulary: Vocabulary) -> tf.data.Dataset: ...

    def sample_tokens(self, vocabulary: Vocabulary) -> tf.data.Dataset: ...


def check_common(source: str, corpus: TokenSource) -> None:
    """The settings every source has, named `{source}.setting` in errors."""
    checks.integer(f"{source}.sequence_length", corpus.sequence_length, minimum=2)
    checks.integer(f"{source}.seed", corpus.seed, minimum=0)
    checks.integer(f"{source}.shuffle_buffer", corpus.shuffle_buffer)
    checks.boolean(f"{source}.log_stats", corpus.log_stats)
    streams.check_sharding(f"{source}.sharding", corpus.sharding)


def check_vocab_settings(source: str, corpus: TokenSource) -> None:
    """The settings of a source that learns a WordPiece vocabulary."""
    if not isinstance(corpus.vocab_path, str):
        raise ValueError(
            f"set {source}.vocab_path to a file path, e.g. vocab.txt in the run's model "
            f"directory, got {corpus.vocab_path!r}"
        )
    checks.integer(f"{source}.vocab_size", corpus.vocab_size)
    checks.integer(f"{source}.vocab_documents", corpus.vocab_documents, optional=True)
    checks.integer(f"{source}.vocab_sample_bytes", corpus.vocab_sample_bytes, optional=True)
    checks.integer(f"{source}.vocab_words", corpus.vocab_words, optional=True)


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """The user's text files: where the text is and how it becomes rows.

    files: paths or glob patterns (local or gs://) of text files.
    vocab_path: the WordPiece vocabulary; read if it exists, else learned from a sample of the
      training documents and written there. Put it in the run's model directory
      (`framework.sample` finds it through the run's config.gin).
    vocab_size: the model's vocabulary size: the most tokens a learned vocabulary gets; a larger
      vocabulary file is a ValueError.
    sequence_length: tokens per packed row.
    document_per, json_field: how files split into documents (see `read_documents`).
    eval_fraction: share of the documents held out for "eval" (chosen by a hash of their text).
    seed: the order of the training documents (a different one every epoch).
    shuffle_buffer: documents shuffled together: each epoch reads the files in a permutation,
      `cycle_length` at a time interleaved, and permutes each block of this many documents.
    vocab_documents, vocab_sample_bytes: the bounds of the sample the vocabulary is learned from:
      at most this many documents and bytes of text, an equal share from each file (its first
      documents), so that the time and memory of learning do not grow with the corpus.
    vocab_words: the sample's most frequent distinct words the learner is given (None: all):
      the learner's time grows faster than linearly with them (vocab.MAX_WORDS).
    log_stats: log documents, tokens, unigram entropy and padding share of the eval split and of
      the training sample (one pass over each).
    sharding: 'auto', 'read_own' or 'read_all' (the module docstring).
    cycle_length: files read at a time, interleaved document by document, when training.
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
    vocab_sample_bytes: int | None = vocab_lib.SAMPLE_BYTES
    sharding: str = "auto"
    cycle_length: int = 16
    vocab_words: int | None = vocab_lib.MAX_WORDS

    def __post_init__(self):
        files = [self.files] if isinstance(self.files, str) else self.files
        if not isinstance(files, (list, tuple)) or not all(isinstance(f, str) for f in files):
            raise TypeError(
                "TextCorpus.files must be a path or glob pattern, or a list of them, "
                f"got {self.files!r}"
            )
        if not isinstance(self.files, str):
            object.__setattr__(self, "files", tuple(self.files))
        check_vocab_settings("TextCorpus", self)
        check_common("TextCorpus", self)
        checks.number("TextCorpus.eval_fraction", self.eval_fraction, maximum=1.0)
        checks.integer("TextCorpus.cycle_length", self.cycle_length)
        if self.document_per not in DOCUMENT_UNITS:
            raise ValueError(
                f"TextCorpus.document_per must be one of {DOCUMENT_UNITS}, "
                f"got {self.document_per!r}"
            )

    def documents(self, split: str) -> tf.data.Dataset:
        """The split's documents, as strings, in file order."""
        documents = read_documents(self.files, self.document_per, self.json_field)
        return split_documents(documents, split, self.eval_fraction)

    def sample(self) -> tf.data.Dataset:
        """The training documents the vocabulary is learned from (`vocab_documents`,
        `vocab_sample_bytes`; see `vocab.spread_sample`)."""
        paths = tf.constant(_text_files(self.files, self.json_field))
        read = _file_reader(self.document_per, self.json_field)

        def part(index):
            documents = read(tf.gather(paths, index))
            return split_documents(documents, "train", self.eval_fraction)

        return vocab_lib.spread_sample(
            int(paths.shape[0]), part, self.vocab_documents, self.vocab_sample_bytes
        )

    def vocab(self) -> list[str]:
        """The vocabulary at `vocab_path`, learned from `sample()` if missing."""
        return vocab_lib.build_or_load_vocab(
            self.vocab_path, self.sample, self.vocab_size, self.vocab_words
        )

    def vocabulary(self) -> Vocabulary:
        return Vocabulary.of(self.vocab())

    def tokens(self, split: str, vocab: list[str]) -> tf.data.Dataset:
        """The split's documents as int32 vectors [BOS] ... [EOS], in file order."""
        vocabulary = Vocabulary.of(vocab)
        return tokenized(self.documents(split), make_tokenizer(vocab), vocabulary)

    def reads_own(self, part: sharding.Share) -> bool:
        return streams.reads_own_files(
            "TextCorpus.sharding",
            self.sharding,
            len(_text_files(self.files, self.json_field)),
            part,
        )

    def train_stream(
        self, vocabulary: Vocabulary, part: sharding.Share, read_own: bool
    ) -> TrainStream:
        paths = _text_files(self.files, self.json_field)
        own = paths[part.pipeline :: part.pipelines] if read_own else paths
        if self.json_field is None:  # lines, paragraphs or files: the raw units are documents
            read, decode = _file_reader(self.document_per, None), None
        else:  # JSON lines: read past undecoded
            read = json_lines.raw_lines
            decode = functools.partial(json_lines.decode_field, field=self.json_field)
        in_train = _in_split("train", self.eval_fraction)
        return TrainStream(
            raw=lambda number: streams.interleaved_files(
                own, read, self.seed, number, self.cycle_length
            ),
            encode=encoder(tokenizer_for(vocabulary), vocabulary),
            decode=decode,
            keep=lambda document: not_blank(document) & in_train(document),
        )

    def eval_tokens(self, vocabulary: Vocabulary) -> tf.data.Dataset:
        return tokenized(self.documents("eval"), tokenizer_for(vocabulary), vocabulary)

    def sample_tokens(self, vocabulary: Vocabulary) -> tf.data.Dataset:
        return tokenized(self.sample(), tokenizer_for(vocabulary), vocabulary)


def tokenizer_for(vocabulary: Vocabulary) -> tf_text.FastWordpieceTokenizer:
    """The WordPiece tokenizer of a text source's vocabulary."""
    return make_tokenizer(list(vocabulary.tokens))


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
