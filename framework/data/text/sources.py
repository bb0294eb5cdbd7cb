"""What every language-model source gives the pipeline (`TokenSource`): a vocabulary, its
training stream in a form a resumed run can seek in (`TrainStream`), the eval split's tokens and
a training sample; and the checks of the settings every source has."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import tensorflow as tf

from framework.core import checks
from framework.data import sharding, streams
from framework.data.text.tokens import Vocabulary


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
            f"set {source}.vocab_path to the vocabulary file, got {corpus.vocab_path!r} (a "
            "new run learns it into vocab.txt in its model directory; a run resumed from "
            "checkpoints without one there names it in its config.gin)"
        )
    checks.integer(f"{source}.vocab_size", corpus.vocab_size)
    checks.integer(f"{source}.vocab_documents", corpus.vocab_documents, optional=True)
    checks.integer(f"{source}.vocab_sample_bytes", corpus.vocab_sample_bytes, optional=True)
    checks.integer(f"{source}.vocab_words", corpus.vocab_words, optional=True)
