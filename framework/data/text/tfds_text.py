"""Language-model text from a TensorFlow Datasets data set (`TfdsText`), for `text.text_lm` and
`text.text_mlm`.

A text feature of any TFDS data set (lm1b, c4, wikipedia, ...), prepared beforehand: nothing is
downloaded at run time (`pip install 'framework[tfds]'`). TFDS's own splits are the train and eval
splits (no hash split), 'read_own' gives each host an even sub-split, and the WordPiece
vocabulary is learned from the first documents of 16 even sub-splits of the training split, within
the sample's bounds. The rest is the text package's pipeline (`rows`, `examples`).
"""

from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf

from framework.data import sharding, streams, text, tfds_builder
from framework.data.text import vocab as vocab_lib

_SAMPLE_PARTS = 16  # TFDS sub-splits a vocabulary sample is spread over


@dataclasses.dataclass(frozen=True)
class TfdsText:
    """A text feature of a TensorFlow Datasets data set (lm1b, c4, wikipedia, ...), prepared
    beforehand in `data_dir`: nothing is downloaded (`pip install 'framework[tfds]'`).

    name: the TFDS name, with config and version if wanted ('c4/en:3.1.0').
    text_key: the feature holding the text ('text' in lm1b and c4).
    train_split, eval_split: TFDS's own splits (slices too: 'train[:1%]'); no hash split.
    data_dir: where the data set was prepared (default: ~/tensorflow_datasets; gs:// works).
    sharding: 'read_own' gives pipeline i of P the i-th of P even sub-splits of `train_split`
      (`tfds.even_splits`); 'auto' does so with more than one pipeline.
    The other settings are `TextCorpus`'s; the vocabulary sample takes an equal share from each
    of 16 even sub-splits of `train_split`. Training reads the split in TFDS's order (shuffled
    when TFDS prepared it) epoch after epoch, each block of `shuffle_buffer` documents permuted
    by (seed, epoch, block).
    """

    name: str
    vocab_path: str | None = None
    vocab_size: int = 8192
    sequence_length: int = 128
    text_key: str = "text"
    train_split: str = "train"
    eval_split: str = "validation"
    data_dir: str | None = None
    seed: int = 0
    shuffle_buffer: int = 10_000
    vocab_documents: int | None = 100_000
    vocab_sample_bytes: int | None = vocab_lib.SAMPLE_BYTES
    log_stats: bool = True
    sharding: str = "auto"
    vocab_words: int | None = vocab_lib.MAX_WORDS

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TfdsText.name must name a TFDS data set, got {self.name!r}")
        text.check_vocab_settings("TfdsText", self)
        text.check_common("TfdsText", self)

    def _builder(self):
        builder = tfds_builder.builder(self.name, self.data_dir, "TfdsText.name")
        tfds_builder.check_features(builder, {"text_key": self.text_key}, "TfdsText")
        return builder

    def _texts(self, split: str, builder=None) -> tf.data.Dataset:
        """The split's texts in TFDS's order, blank ones dropped."""
        examples = tfds_builder.as_dataset(builder or self._builder(), split, self.data_dir)
        texts = examples.map(lambda example: example[self.text_key])
        return texts.filter(text.not_blank)

    def sample(self) -> tf.data.Dataset:
        """The documents the vocabulary is learned from: the first of each of 16 even
        sub-splits of `train_split`, within `vocab_documents` and `vocab_sample_bytes`."""
        tfds = tfds_builder.import_tfds()
        parts, builder = tfds.even_splits(self.train_split, n=_SAMPLE_PARTS), self._builder()
        heads = [
            vocab_lib.within_budget(
                self._texts(part, builder),
                vocab_lib.part_share(self.vocab_documents, _SAMPLE_PARTS),
                vocab_lib.part_share(self.vocab_sample_bytes, _SAMPLE_PARTS),
            )
            for part in parts
        ]
        return functools.reduce(lambda a, b: a.concatenate(b), heads)

    def vocab(self) -> list[str]:
        """The vocabulary at `vocab_path`, learned from `sample()` if missing."""
        return vocab_lib.build_or_load_vocab(
            self.vocab_path, self.sample, self.vocab_size, self.vocab_words
        )

    def vocabulary(self) -> text.Vocabulary:
        return text.Vocabulary.of(self.vocab())

    def reads_own(self, part: sharding.Share) -> bool:
        return streams.reads_own("TfdsText.sharding", self.sharding, auto=part.pipelines > 1)

    def train_stream(
        self, vocabulary: text.Vocabulary, part: sharding.Share, read_own: bool
    ) -> text.TrainStream:
        split = self.train_split
        if read_own and part.pipelines > 1:
            split = tfds_builder.import_tfds().even_splits(split, n=part.pipelines)[part.pipeline]
        texts = self._texts(split)
        return text.TrainStream(
            raw=lambda number: texts,  # the epoch's order: its shuffle blocks
            encode=text.encoder(text.tokenizer_for(vocabulary), vocabulary),
        )

    def eval_tokens(self, vocabulary: text.Vocabulary) -> tf.data.Dataset:
        return text.tokenized(
            self._texts(self.eval_split), text.tokenizer_for(vocabulary), vocabulary
        )

    def sample_tokens(self, vocabulary: text.Vocabulary) -> tf.data.Dataset:
        return text.tokenized(self.sample(), text.tokenizer_for(vocabulary), vocabulary)
