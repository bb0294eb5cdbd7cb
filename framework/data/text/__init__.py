"""Language-model data: text or token ids from files or TFDS, packed into rows of tokens.

Modules: `documents` (text files into documents), `tokens` (WordPiece), `sources` (what a
source gives), `corpus` (the user's text files), `tfds_text` and `token_records` (the other
sources), `rows` (packing, sharding, resuming), `examples` (`text_lm`, `text_mlm`), with `vocab`,
`packing` and `json_lines`. The names below are the package's public surface.

`text_lm` (decoder LM: predict the next token) and `text_mlm` (BERT masked LM) read any of three
sources (`TokenSource`), each a frozen dataclass bound in gin as `data.text_lm.corpus`:

- `TextCorpus`: the user's text files (plain text, or JSON lines with a text field decoded in the
  graph, `json_lines`), split into train and eval by a hash of each document.
- `tfds_text.TfdsText`: a text feature of a TensorFlow Datasets data set (lm1b, c4, ...), its
  own splits.
- `token_records.TokenRecords`: TFRecord files of token ids tokenized elsewhere (seqio caches).

The two text sources tokenize with tensorflow-text's WordPiece; the vocabulary is learned once,
from a bounded sample spread over the corpus, and kept in `vocab_path` (`vocab`): the binaries
put it in the run's model directory, so resuming and `framework.sample` tokenize the same way.
From there on one pipeline, TensorFlow ops inside `tf.data` (no Python per document):

    documents -> [BOS] tokens [EOS] -> pack into rows of `sequence_length` (`packing`)
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

from framework.data.text.corpus import TextCorpus
from framework.data.text.documents import (
    DOCUMENT_UNITS,
    SAMPLE_CORPUS,
    not_blank,
    read_documents,
    split_documents,
)
from framework.data.text.examples import (
    lm_example,
    max_predictions,
    mlm_example,
    text_lm,
    text_mlm,
)
from framework.data.text.rows import corpus_stats, packed_rows, split_stats
from framework.data.text.sources import (
    TokenSource,
    TrainStream,
    check_common,
    check_vocab_settings,
)
from framework.data.text.tokens import (
    Vocabulary,
    detokenize,
    encoder,
    make_tokenizer,
    tokenize,
    tokenized,
    tokenizer_for,
    with_markers,
)

__all__ = [
    "DOCUMENT_UNITS",
    "SAMPLE_CORPUS",
    "TextCorpus",
    "TokenSource",
    "TrainStream",
    "Vocabulary",
    "check_common",
    "check_vocab_settings",
    "corpus_stats",
    "detokenize",
    "encoder",
    "lm_example",
    "make_tokenizer",
    "max_predictions",
    "mlm_example",
    "not_blank",
    "packed_rows",
    "read_documents",
    "split_documents",
    "split_stats",
    "text_lm",
    "text_mlm",
    "tokenize",
    "tokenized",
    "tokenizer_for",
    "with_markers",
]
