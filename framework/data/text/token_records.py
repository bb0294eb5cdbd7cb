"""Token ids tokenized elsewhere, from TFRecord files (`TokenRecords`), for `text.text_lm` and
`text.text_mlm`.

Each record is a `tf.train.Example` with one document's ids as an int64 list; the ids are checked
against the vocabulary size on the first records at set-up and on every record in the graph (an
error, never a clipped id). Files are shared among hosts as `text.TextCorpus` shares its files, and
the rest is the text package's pipeline: packing, batches, eval padding (`rows`).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from google.protobuf.message import DecodeError

from framework.core import checks
from framework.core.errors import BAD_DATA
from framework.core.files import list_files
from framework.data import sharding, streams, text
from framework.data.text import vocab as vocab_lib

_STATS_RECORDS = 10_000  # token records in the training sample `log_stats` describes
_CHECKED_RECORDS = 64  # token records checked at set-up


@dataclasses.dataclass(frozen=True)
class TokenRecords:
    """TFRecord files of `tf.train.Example`s holding token ids, tokenized elsewhere.

    Each example holds one document's ids as an int64 list under `key`. The default, 'targets',
    is what seqio's cached tasks (t5x) write for a decoder LM (`seqio_cache_tasks`; their EOS is
    appended after the cache, so set `eos_id = 1` for T5's vocabulary); Hugging Face exports
    usually say 'input_ids'. (Megatron-LM writes its own .bin/.idx format, not TFRecords.)

    train_files, eval_files: file names or globs (local or gs://).
    vocab_size: the number of token ids; every id must be in [0, vocab_size): the first records
      of the first file are checked at set-up, and every id in the graph (an error naming the
      key and the files, not a clipped id).
    vocab_path: instead of or beside vocab_size, the vocabulary file (one token a line): its
      length is the vocabulary size (at most vocab_size when both are set).
    pad_id: the id padding rows hold (its value never counts: padding has weight 0).
    bos_id, eos_id: added before / after each document when set; None when the records hold
      their own markers (or need none).
    mask_id: [MASK]'s id, which `text_mlm` needs.
    sharding, cycle_length, seed, shuffle_buffer, sequence_length, log_stats: as `TextCorpus`.
    """

    train_files: str | tuple[str, ...]
    eval_files: str | tuple[str, ...] | None = None
    vocab_size: int | None = None
    vocab_path: str | None = None
    key: str = "targets"
    sequence_length: int = 128
    pad_id: int = 0
    bos_id: int | None = None
    eos_id: int | None = None
    mask_id: int | None = None
    seed: int = 0
    shuffle_buffer: int = 10_000
    log_stats: bool = True
    sharding: str = "auto"
    cycle_length: int = 16

    def __post_init__(self):
        for name in ("train_files", "eval_files"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        checks.integer("TokenRecords.vocab_size", self.vocab_size, optional=True)
        if self.vocab_size is None and self.vocab_path is None:
            raise ValueError(
                "set TokenRecords.vocab_size (the tokenizer's number of ids) or "
                "TokenRecords.vocab_path (its vocabulary file)"
            )
        for name in ("pad_id", "bos_id", "eos_id", "mask_id"):
            checks.integer(
                f"TokenRecords.{name}", getattr(self, name), minimum=0, optional=name != "pad_id"
            )
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"TokenRecords.key must name a feature, got {self.key!r}")
        text.check_common("TokenRecords", self)
        checks.integer("TokenRecords.cycle_length", self.cycle_length)

    def vocabulary(self) -> text.Vocabulary:
        size = self.vocab_size
        if self.vocab_path is not None:
            tokens = vocab_lib.load_vocab(self.vocab_path)
            if size is not None:
                vocab_lib.check_fits(tokens, size, self.vocab_path)
            size = len(tokens)
        for name in ("pad_id", "bos_id", "eos_id", "mask_id"):
            value = getattr(self, name)
            if value is not None and value >= size:
                raise ValueError(f"TokenRecords.{name} = {value} is not below the {size} ids")
        return text.Vocabulary(size, self.pad_id, self.bos_id, self.eos_id, self.mask_id)

    def _files(self, split: str) -> list[str]:
        if split == "eval" and self.eval_files is None:
            raise ValueError("set TokenRecords.eval_files to evaluate (file names or globs)")
        setting = "train_files" if split == "train" else "eval_files"
        return list_files(getattr(self, setting), f"TokenRecords.{setting}")

    def _check_records(self, files: list[str], size: int) -> None:
        """The first records of the first file hold int64 ids under `key`, each below `size`."""
        records = tf.data.TFRecordDataset(files[:1]).take(_CHECKED_RECORDS)
        try:
            first = list(records.as_numpy_iterator())
        except tf.errors.DataLossError as error:
            raise ValueError(
                f"{files[0]} is not a TFRecord file ({str(error).splitlines()[0][:200]}): "
                "TokenRecords reads files written by tf.io.TFRecordWriter"
            ) from None
        for number, record in enumerate(first, 1):
            where = f"{files[0]}, record {number}"
            try:
                features = tf.train.Example.FromString(record).features.feature
            except DecodeError:
                raise ValueError(f"{where} is not a tf.train.Example") from None
            if self.key not in features or features[self.key].WhichOneof("kind") != "int64_list":
                raise ValueError(
                    f"{where} has no int64 feature {self.key!r} (TokenRecords.key); its "
                    f"features: {sorted(features)}"
                )
            ids = features[self.key].int64_list.value
            if ids and not 0 <= min(ids) <= max(ids) < size:
                raise ValueError(
                    f"{where}: token id {max(ids) if max(ids) >= size else min(ids)} is outside "
                    f"[0, {size}): set TokenRecords.vocab_size to the tokenizer's size"
                )

    def _parse(self, files: list[str], vocabulary: text.Vocabulary):
        """serialized records [n] -> ragged int32 ids [n, (tokens)], ids checked in the graph."""
        key, size = self.key, vocabulary.size
        message = (
            f"{BAD_DATA}a token id of {key!r} in {files[0]}... is outside [0, {size}): set "
            "TokenRecords.vocab_size to the tokenizer's size (the id: "
        )

        def parse(records):
            parsed = tf.io.parse_example(records, {key: tf.io.VarLenFeature(tf.int64)})[key]
            ids = tf.RaggedTensor.from_sparse(parsed)
            values = ids.flat_values
            valid = tf.reduce_all((values >= 0) & (values < size))
            worst = tf.reduce_max(tf.concat([values, [0]], 0))
            line = tf.strings.join([message, tf.strings.as_string(worst), ")"])
            with tf.control_dependencies([tf.debugging.Assert(valid, [line])]):
                return text.with_markers(tf.cast(ids, tf.int32), vocabulary)

        return parse

    def _tokens(self, records: tf.data.Dataset, files, vocabulary, batch: int = 256):
        parse = self._parse(files, vocabulary)
        return records.batch(batch).map(parse, num_parallel_calls=tf.data.AUTOTUNE).unbatch()

    def reads_own(self, part: sharding.Share) -> bool:
        return streams.reads_own_files(
            "TokenRecords.sharding", self.sharding, len(self._files("train")), part
        )

    def train_stream(
        self, vocabulary: text.Vocabulary, part: sharding.Share, read_own: bool
    ) -> text.TrainStream:
        files = self._files("train")
        self._check_records(files, vocabulary.size)
        own = files[part.pipeline :: part.pipelines] if read_own else files
        return text.TrainStream(
            raw=lambda number: streams.interleaved_files(
                own, tf.data.TFRecordDataset, self.seed, number, self.cycle_length
            ),
            encode=self._parse(files, vocabulary),
        )

    def eval_tokens(self, vocabulary: text.Vocabulary) -> tf.data.Dataset:
        files = self._files("eval")
        self._check_records(files, vocabulary.size)
        return self._tokens(tf.data.TFRecordDataset(files), files, vocabulary)

    def sample_tokens(self, vocabulary: text.Vocabulary) -> tf.data.Dataset:
        files = tf.constant(self._files("train"))
        records = vocab_lib.spread_sample(
            int(files.shape[0]),
            lambda index: tf.data.TFRecordDataset(tf.gather(files, index)),
            _STATS_RECORDS,
            None,
        )
        return self._tokens(records, self._files("train"), vocabulary)
