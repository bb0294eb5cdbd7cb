"""WordPiece vocabularies: learned from a corpus with tensorflow-text's learner, saved, loaded.

A run must tokenize the same way when it resumes and when it samples, so the vocabulary is learned
once and written to a file (one token a line, the format of BERT's `vocab.txt`); every later call
with the same path loads that file instead of learning again.

Words are split on whitespace only, both when learning and when tokenizing, so wordpieces keep
punctuation and case and `detokenize` gives back the text up to its whitespace.
"""

from __future__ import annotations

import functools
import logging
import os

import tensorflow as tf
from tensorflow_text.tools.wordpiece_vocab import wordpiece_tokenizer_learner_lib as learner

from framework import files

PAD, UNK, BOS, EOS, MASK = "[PAD]", "[UNK]", "[BOS]", "[EOS]", "[MASK]"
RESERVED_TOKENS = (PAD, UNK, BOS, EOS, MASK)
# Token names a loaded vocabulary may use instead (BERT's vocab.txt has [CLS] and [SEP]).
ALIASES = {BOS: "[CLS]", EOS: "[SEP]"}


def learn_vocab(
    documents: tf.data.Dataset, vocab_size: int, max_documents: int | None = None
) -> list[str]:
    """Learns at most `vocab_size` wordpieces from a dataset of document strings.

    Counting runs in tf.data over batches of documents; `max_documents` bounds the sample.
    Every character of the corpus gets a token, so nothing becomes [UNK] on this corpus.
    """
    if max_documents:
        documents = documents.take(max_documents)
    words = documents.batch(256).map(tf.strings.split)
    try:
        counts = learner.count_words(words)
    except StopIteration:  # count_words peeks at the first word: there is none
        counts = {}
    if not counts:
        raise ValueError("the corpus is empty: no words to learn a vocabulary from")
    vocab = learner.learn(counts, vocab_size, list(RESERVED_TOKENS), lower_thresh=1)
    # The bare suffix marker "##" is in the learner's output but never produced by WordPiece.
    return _fit([token for token in vocab if token != "##"], vocab_size)


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
    with tf.io.gfile.GFile(path, "r") as f:
        vocab = [line.rstrip("\n") for line in f]
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
    return tuple(load_vocab(path))


def build_or_load_vocab(
    vocab_path: str,
    documents: tf.data.Dataset,
    vocab_size: int,
    max_documents: int | None = None,
) -> list[str]:
    """The vocabulary at `vocab_path`; learned from `documents` and saved there if it is missing.

    Called once per input pipeline: the first call learns and writes, the others read the file.
    """
    if not tf.io.gfile.exists(vocab_path):
        vocab = learn_vocab(documents, vocab_size, max_documents)
        save_vocab(vocab, vocab_path)
        logging.info("learned a %d-token vocabulary, saved to %s", len(vocab), vocab_path)
    vocab = list(_cached(vocab_path, tf.io.gfile.stat(vocab_path).mtime_nsec / 1e9))
    check_fits(vocab, vocab_size, vocab_path)
    special_ids(vocab)
    return vocab
