"""WordPiece vocabularies: learned from a corpus with tensorflow-text's learner, saved, loaded.

A run must tokenize the same way when it resumes and when it samples, so the vocabulary is learned
once and written to a file (one token a line, the format of BERT's `vocab.txt`); every later call
with the same path loads that file instead of learning again.

Words are split on whitespace only, both when learning and when tokenizing, so wordpieces keep
punctuation and case and `detokenize` gives back the text up to its whitespace.

A corpus can be far larger than what learning may read: the vocabulary is learned from a sample
(`spread_sample`) bounded in documents and in bytes and spread over the corpus' files, so that
learning takes the same time and memory on 1 GB as on 1 TB (benchmarks/vocab_sample.py).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable

import tensorflow as tf
from tensorflow_text.tools.wordpiece_vocab import wordpiece_tokenizer_learner_lib as learner

from framework.core import files
from framework.core.errors import UserError

PAD, UNK, BOS, EOS, MASK = "[PAD]", "[UNK]", "[BOS]", "[EOS]", "[MASK]"
RESERVED_TOKENS = (PAD, UNK, BOS, EOS, MASK)
# The default bound on the bytes of text a vocabulary is learned from (with a bound on
# documents): benchmarks/vocab_sample.py measures the time and memory it takes.
SAMPLE_BYTES = 64 * 2**20
# The most frequent distinct words the learner is given: its time grows faster than linearly with
# them (64 MiB of generated text: 197 000 distinct words, about 280 s; 100 000, 150 s; 50 000,
# 60 s), while counting the sample takes about 13 s.
MAX_WORDS = 50_000
# Token names a loaded vocabulary may use instead (BERT's vocab.txt has [CLS] and [SEP]).
ALIASES = {BOS: "[CLS]", EOS: "[SEP]"}


class NotUtf8Error(UserError, ValueError):
    """The sample holds words that are not UTF-8, which the learner cannot count (tokenizing
    them would give [UNK]): the corpus is in another encoding."""


def learn_vocab(
    documents: tf.data.Dataset, vocab_size: int, max_words: int | None = MAX_WORDS
) -> list[str]:
    """Learns at most `vocab_size` wordpieces from a dataset of document strings (a bounded
    sample: `spread_sample`), from its `max_words` most frequent distinct words (None: all).

    Words are split in tf.data over batches of documents and counted in Python, so memory grows
    with the distinct words of the sample. Every character of the words learned from gets a
    token (up to the learner's 1000 most frequent characters).
    """
    words = documents.batch(256).map(tf.strings.split)
    try:
        counts = learner.count_words(words)
    except StopIteration:  # count_words peeks at the first word: there is none
        counts = {}
    except UnicodeDecodeError as error:
        raise NotUtf8Error(f"the corpus is not UTF-8 text ({error.reason})") from None
    if not counts:
        raise ValueError("the corpus is empty: no words to learn a vocabulary from")
    vocab = learner.learn(
        counts, vocab_size, list(RESERVED_TOKENS), lower_thresh=1, max_input_tokens=max_words
    )
    # The bare suffix marker "##" is in the learner's output but never produced by WordPiece.
    return _fit([token for token in vocab if token != "##"], vocab_size)


def within_budget(
    documents: tf.data.Dataset, max_documents: int | None, max_bytes: int | None
) -> tf.data.Dataset:
    """The first of `documents` (strings): at most `max_documents` of them, and up to the one
    that brings their text to `max_bytes` bytes (None: no bound)."""
    if max_documents:
        documents = documents.take(max_documents)
    if not max_bytes:
        return documents

    def count(total, document):
        before = total
        return total + tf.cast(tf.strings.length(document), tf.int64), (before, document)

    def within(before, _):
        return before < max_bytes

    def document(_, text):
        return text

    return documents.scan(tf.constant(0, tf.int64), count).take_while(within).map(document)


def part_share(total: int | None, parts: int) -> int | None:
    """One part's share of a bound (None: no bound), at least 1."""
    return None if not total else max(1, math.ceil(total / parts))


def spread_sample(
    parts: int,
    read: Callable[[tf.Tensor], tf.data.Dataset],
    max_documents: int | None,
    max_bytes: int | None,
    cycle_length: int = 16,
) -> tf.data.Dataset:
    """A bounded sample spread over a corpus of `parts` parts (files, sub-splits): the first
    documents of each part `read(index)`, each part's share of the bounds (1/parts of the
    documents and of the bytes), `cycle_length` parts read at a time. A large corpus is then
    learnt from in bounded time and memory, from all of its files rather than the head of the
    first."""

    def head(index):
        return within_budget(
            read(index), part_share(max_documents, parts), part_share(max_bytes, parts)
        )

    sample = tf.data.Dataset.range(parts).interleave(
        head,
        cycle_length=min(cycle_length, parts),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return within_budget(sample, max_documents, max_bytes)


def _fit(vocab: list[str], vocab_size: int) -> list[str]:
    """Cuts a learned vocabulary to `vocab_size`, keeping what every word needs.

    The learner's threshold search can end above the target on a small corpus. Its order is
    reserved tokens, characters, then wordpieces by falling count, with the `##` form of each
    character at the end: those are kept, and the rarest longer wordpieces go.
    """
    if len(vocab) <= vocab_size:
        return vocab
    reserved = len(RESERVED_TOKENS)
    required = [t for t in vocab[reserved:] if len(t.removeprefix("##")) == 1]
    if reserved + len(required) > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for this corpus: its {len(required)} "
            f"characters (with and without ##) and {reserved} reserved tokens need more"
        )
    keep = set(required)
    pieces = [t for t in vocab[reserved:] if t not in keep]
    return [*vocab[:reserved], *required, *pieces[: vocab_size - reserved - len(required)]]


def save_vocab(vocab: list[str], path: str) -> None:
    """Writes one token a line, atomically: a concurrent reader sees the whole file or none."""
    tf.io.gfile.makedirs(os.path.dirname(path) or ".")
    files.write_bytes(path, "\n".join(vocab) + "\n")


def load_vocab(path: str) -> list[str]:
    """Reads a vocabulary file, one token a line."""
    vocab = files.read_text(path).split("\n")
    while vocab and not vocab[-1]:
        vocab.pop()
    if not vocab:
        raise ValueError(f"vocab file {path} is empty")
    return vocab


def special_ids(vocab: list[str]) -> dict[str, int]:
    """Ids of the reserved tokens, by name ([BOS]/[EOS] may be spelt [CLS]/[SEP])."""
    index = {token: i for i, token in enumerate(vocab)}
    ids = {}
    for token in RESERVED_TOKENS:
        found = index.get(token, index.get(ALIASES.get(token, token)))
        if found is None:
            raise ValueError(f"the vocabulary has no {token} token")
        ids[token] = found
    return ids


def check_fits(vocab: list[str], vocab_size: int, path: str) -> None:
    """Raises ValueError when the vocabulary has more tokens than the model's `vocab_size`."""
    if len(vocab) > vocab_size:
        raise ValueError(
            f"the vocabulary {path} has {len(vocab)} tokens, more than vocab_size={vocab_size} "
            "(the model's embedding rows): raise vocab_size in the model and data config, or use "
            "a smaller vocabulary"
        )


@functools.lru_cache(maxsize=8)
def _cached(path: str, mtime: float) -> tuple[str, ...]:
    vocab = tuple(load_vocab(path))
    # Once per file: a vocab_path learned earlier from another corpus is used as it is.
    logging.info("vocabulary: the %d tokens in %s", len(vocab), path)
    return vocab


def build_or_load_vocab(
    vocab_path: str,
    documents: Callable[[], tf.data.Dataset],
    vocab_size: int,
    max_words: int | None = MAX_WORDS,
) -> list[str]:
    """The vocabulary at `vocab_path`; learned from `documents()` (a bounded sample) and saved
    there if it is missing.

    Called once per input pipeline: the first call learns and writes, the others read the file.
    """
    if not tf.io.gfile.exists(vocab_path):
        vocab = learn_vocab(documents(), vocab_size, max_words)
        save_vocab(vocab, vocab_path)
        logging.info("learned a %d-token vocabulary, saved to %s", len(vocab), vocab_path)
    vocab = list(_cached(vocab_path, tf.io.gfile.stat(vocab_path).mtime_nsec / 1e9))
    check_fits(vocab, vocab_size, vocab_path)
    special_ids(vocab)
    return vocab
