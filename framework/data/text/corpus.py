"""`TextCorpus`: the user's text files as a `TokenSource` - documents split into train and eval by
a hash of their text, a WordPiece vocabulary learned once from a bounded sample, and a training
stream read file by file in an order drawn from (seed, epoch)."""

from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf

from framework.core import checks
from framework.data import sharding, streams
from framework.data.text import json_lines
from framework.data.text import vocab as vocab_lib
from framework.data.text.documents import (
    DOCUMENT_UNITS,
    file_reader,
    first_not_utf8,
    in_split,
    not_blank,
    read_documents,
    split_documents,
    text_files,
)
from framework.data.text.sources import TrainStream, check_common, check_vocab_settings
from framework.data.text.tokens import (
    Vocabulary,
    encoder,
    make_tokenizer,
    tokenized,
    tokenizer_for,
)


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """The user's text files: where the text is and how it becomes rows.

    files: paths or glob patterns (local or gs://) of text files.
    vocab_path: the WordPiece vocabulary; read if it exists, else learned from a sample of the
      training documents and written there. The binaries default it to `vocab.txt` in the
      run's model directory, where resuming and `framework.sample` read it back.
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
    sharding: 'auto', 'read_own' or 'read_all' (the package docstring, `framework.data.text`).
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
        paths = tf.constant(text_files(self.files, self.json_field))
        read = file_reader(self.document_per, self.json_field)

        def part(index):
            documents = read(tf.gather(paths, index))
            return split_documents(documents, "train", self.eval_fraction)

        return vocab_lib.spread_sample(
            int(paths.shape[0]), part, self.vocab_documents, self.vocab_sample_bytes
        )

    def vocab(self) -> list[str]:
        """The vocabulary at `vocab_path`, learned from `sample()` if missing."""
        try:
            return vocab_lib.build_or_load_vocab(
                self.vocab_path, self.sample, self.vocab_size, self.vocab_words
            )
        except vocab_lib.NotUtf8Error as error:
            found = first_not_utf8(text_files(self.files, self.json_field))
            if found is None:
                raise
            raise vocab_lib.NotUtf8Error(
                f"TextCorpus.files: {found[0]} is not UTF-8 text (byte {found[1]} on): convert "
                "it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or drop it"
            ) from error

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
            len(text_files(self.files, self.json_field)),
            part,
        )

    def train_stream(
        self, vocabulary: Vocabulary, part: sharding.Share, read_own: bool
    ) -> TrainStream:
        paths = text_files(self.files, self.json_field)
        own = paths[part.pipeline :: part.pipelines] if read_own else paths
        if self.json_field is None:  # lines, paragraphs or files: the raw units are documents
            read, decode = file_reader(self.document_per, None), None
        else:  # JSON lines: read past undecoded
            read = json_lines.raw_lines
            decode = functools.partial(json_lines.decode_field, field=self.json_field)
        in_train = in_split("train", self.eval_fraction)
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
