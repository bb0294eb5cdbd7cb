"""Documents from the user's text files: plain text (a document per line, paragraph or file) or
JSON lines with a text field decoded in the graph (`json_lines`), and their train/eval split by a
hash of each document's text."""

from __future__ import annotations

import codecs
import functools
import os
from collections.abc import Callable, Sequence

import tensorflow as tf

from framework.core.files import list_files
from framework.data.text import json_lines

DOCUMENT_UNITS = ("line", "paragraph", "file")

# A corpus shipped with the package, so that the example language-model configs run anywhere
# without a download: the prose of this project's documentation pages (about 75 KB: paragraphs,
# no tables or code, and no sentence with a digit in it, so it carries no measured figure that
# could go stale), frozen in its own file so that editing the documentation does not change the
# data. Gin names it %data.SAMPLE_CORPUS.
SAMPLE_CORPUS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "corpus", "framework_docs.txt"
)
_HASH_BUCKETS = 10_000
_PARAGRAPH_BREAK = "\x1e"  # ASCII record separator: a paragraph break, before splitting on it


def file_reader(document_per: str, json_field: str | None):
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
    paths = text_files(files, json_field)
    return tf.data.Dataset.from_tensor_slices(paths).flat_map(file_reader(document_per, json_field))


def text_files(files: str | Sequence[str], json_field: str | None) -> list[str]:
    """The files of `TextCorpus.files`; JSON lines files checked (`check_against_json`)."""
    paths = list_files(files, "TextCorpus.files")
    if json_field is not None:
        json_lines.check_against_json(paths, json_field)
    return paths


def first_not_utf8(paths: Sequence[str], chunk_bytes: int = 2**20) -> tuple[str, int] | None:
    """(path, byte offset) of the first bytes of `paths` that are not UTF-8, or None; read in
    chunks and stopped at the first bad byte, for an error that names the file to convert."""
    for path in paths:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        with tf.io.gfile.GFile(path, "rb") as file:
            while True:
                chunk = file.read(chunk_bytes)
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    return path, offset + error.start
                if not chunk:
                    break
                offset += len(chunk)
    return None


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
    return documents.filter(in_split(split, eval_fraction))


def in_split(split: str, eval_fraction: float) -> Callable[[tf.Tensor], tf.Tensor]:
    """document -> whether it belongs to `split` (a hash of its text)."""
    cut = int(round(eval_fraction * _HASH_BUCKETS))
    held_out = split == "eval"
    return lambda d: tf.equal(tf.strings.to_hash_bucket_fast(d, _HASH_BUCKETS) < cut, held_out)
