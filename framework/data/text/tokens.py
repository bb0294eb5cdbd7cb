"""Tokens: tensorflow-text's WordPiece over a learned vocabulary (`vocab`), the `Vocabulary` packing
and masking read (size and special ids), and documents turned into [BOS] tokens [EOS]."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf
import tensorflow_text as tf_text

from framework.data.text import vocab as vocab_lib


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


def tokenizer_for(vocabulary: Vocabulary) -> tf_text.FastWordpieceTokenizer:
    """The WordPiece tokenizer of a text source's vocabulary."""
    return make_tokenizer(list(vocabulary.tokens))
