"""Text at scale: JSON lines decoded in the graph, TFDS text, token records, the vocabulary's
bounded sample, and each source training through `python -m framework.train`.

The JSON decoding is checked against Python's `json` on generated lines (every escape, non-BMP
characters, the field anywhere among fields of every type, nested look-alikes, repeated keys);
token records carry known ids, so rows, shards and eval counts are checked exactly.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from framework import sample, train
from framework.data import text
from framework.data.text import json_lines, tfds_text, token_records, vocab
from tests.binaries.in_process import TWO_STEPS, train_binary

# Characters that stress the decoding: escapes, quotes, brackets, non-BMP, lone surrogates.
PIECES = [
    *"ab ,:{}[]/",
    '"',
    "\\",
    "\n\t\b\f\r\x01\x7f",
    "é",
    "中",
    "😀",
    "𝄞",
    "\u2028",
    "\ud800",
    "\udc00",
    "text",
    '"text":',
    '{"text": "x"}',
]


def _string(rng: random.Random, most: int = 12) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, most)))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 5 if depth < 3 else 2)
    if kind == 0:
        return _string(rng)
    if kind == 1:
        return rng.choice([None, True, False, -7, 1.5e-3, 10**12])
    if kind == 2:
        return rng.choice(["text", "", "\\"])
    if kind == 3:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["text", "meta", "id", "Text", '"text"', "te\\xt"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _dumps(rng: random.Random, value) -> str:
    """JSON text, escaped to ASCII or written raw (a raw lone surrogate is not UTF-8: escaped)."""
    if rng.random() < 0.5:
        return json.dumps(value)
    raw = json.dumps(value, ensure_ascii=False)
    return re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", raw)


def json_line(rng: random.Random) -> str:
    """An object with 'text' (a string) among other fields of every type, in any order, maybe
    twice (json.loads keeps the last), with JSON's optional whitespace."""
    names = ["meta", "id", "url", "tex", "texts", "Text", _string(rng, 4)]
    fields = [(rng.choice(names), _value(rng)) for _ in range(rng.randint(0, 4))]
    fields = [(name if name != "text" else "other", value) for name, value in fields]
    for _ in range(1 + (rng.random() < 0.1)):
        fields.insert(rng.randint(0, len(fields)), ("text", _string(rng, 40)))
    separator = rng.choice([":", " : ", ":\t"])
    body = ", ".join(_dumps(rng, k) + separator + _dumps(rng, v) for k, v in fields)
    return rng.choice(["", " "]) + "{" + body + "}" + rng.choice(["", " ", "\r"])


@pytest.mark.tf_compat
def test_json_field_decoded_in_the_graph_equals_pythons_json():
    rng = random.Random(0)
    lines = [json_line(rng) for _ in range(3000)]
    texts, problems = json_lines.extract_field(
        tf.constant([line.encode() for line in lines]), "text"
    )
    for line, got, problem in zip(lines, texts.numpy(), problems.numpy()):
        assert problem == 0, (line, json_lines.problem_text(problem, "text"))
        assert got == json_lines.expected_text(json.loads(line)["text"]), line
    cut = [line[: rng.randint(0, len(line.rstrip()) - 1)] for line in lines[:500]]
    _, problems = json_lines.extract_field(tf.constant([line.encode() for line in cut]), "text")
    assert problems.numpy().all()  # a line cut short is never taken for text


def test_surrogates_and_nested_look_alikes():
    lines = {
        '{"text":"\\ud83d\\ude00 \\uD834\\uDD1E"}': "😀 𝄞".encode(),  # pairs, both cases
        '{"text": "lone \\ud800 and \\udc00"}': "lone \ufffd and \ufffd".encode(),
        '{"meta": {"text": "nested"}, "text": "top"}': b"top",
        '{"a": "\\"text\\": \\"fake\\"", "text": "real"}': b"real",
        '{"a": [{"text": "deep"}], "text": "top", "b": {"c": ["text"]}}': b"top",
        '{"text": "first", "text": "last"}': b"last",
    }
    texts, problems = json_lines.extract_field(tf.constant(list(lines)), "text")
    assert not problems.numpy().any()
    assert list(texts.numpy()) == list(lines.values())


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"meta": {"text": "only nested"}}', json_lines.NO_FIELD),
        ('{"a": "\\"text\\": \\"in a string\\""}', json_lines.NO_FIELD),
        ('{"text": 3}', json_lines.NOT_STRING),
        ('{"text": null}', json_lines.NOT_STRING),
        ('{"text": {"a": "b"}}', json_lines.NOT_STRING),
        ('{"text": "unterminated}', json_lines.NOT_OBJECT),
        ('{"text": "a"', json_lines.NOT_OBJECT),
        ('["text", "a"]', json_lines.NOT_OBJECT),
        ('{"text": "x"} {"text": "y"}', json_lines.NOT_OBJECT),
        ("not json", json_lines.NOT_OBJECT),
        ('{"text": "bad \\x escape"}', json_lines.BAD_ESCAPE),
        ('{"text": "short \\u12"}', json_lines.BAD_ESCAPE),
        (b'{"text": "latin-1 \xe9"}', json_lines.NOT_UTF8),
    ],
)
def test_a_bad_line_is_a_problem_not_text(line, problem):
    texts, problems = json_lines.extract_field(tf.constant([line]), "text")
    assert problems.numpy()[0] == problem and texts.numpy()[0] == b""


def test_a_bad_json_line_names_its_file_and_line(tmp_path):
    """Lines past the set-up check are checked in the graph: the error names file:line."""
    path = tmp_path / "part-0.jsonl"
    lines = [json.dumps({"id": i, "text": f"document {i}"}) for i in range(40)]
    lines[30] = json.dumps({"id": 30, "meta": {"text": "nested only"}})
    path.write_text("\n".join(lines) + "\n")
    documents = text.read_documents(str(path), json_field="text")
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        list(documents)
    # `python -m framework.train` reports it as this one line.
    assert train.bad_data(error.value) == f"bad data: {path}:31: no top-level field 'text'"
    path.write_text('{"text": "fine"}\n{"text": 7}\n')
    with pytest.raises(ValueError, match=r"part-0.jsonl:2: not a JSON object with a string field"):
        text.read_documents(str(path), json_field="text")
    with pytest.raises(ValueError, match=r"TextCorpus.files: '.*\*.json' not found"):
        text.read_documents(str(tmp_path / "*.json"), json_field="text")


# The vocabulary's bounded sample.


def write_jsonl(directory, files: int, per_file: int, words: int = 8) -> str:
    """`files` JSON lines files; document j of file i is 'f{i} d{j} w w w ...'."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    vocabulary = [f"w{k}" for k in range(50)]
    for i in range(files):
        rows = [
            json.dumps(
                {
                    "meta": {"n": j},
                    "text": " ".join([f"f{i}", f"d{j}", *rng.choice(vocabulary, words)]),
                }
            )
            for j in range(per_file)
        ]
        (directory / f"part-{i:02d}.jsonl").write_text("\n".join(rows) + "\n")
    return str(directory / "part-*.jsonl")


def test_the_vocabulary_sample_is_bounded_and_spread_over_every_file(tmp_path):
    files = write_jsonl(tmp_path / "corpus", files=4, per_file=50)
    corpus = text.TextCorpus(
        files=files,
        vocab_path=str(tmp_path / "vocab.txt"),
        json_field="text",
        eval_fraction=0.01,
        vocab_documents=20,
        vocab_sample_bytes=None,
    )
    sample = [d.decode().split() for d in corpus.sample().as_numpy_iterator()]
    assert len(sample) == 20
    assert {words[0] for words in sample} == {"f0", "f1", "f2", "f3"}  # 5 from each file
    bounded = dataclasses.replace(corpus, vocab_documents=None, vocab_sample_bytes=400)
    lengths = [len(d) for d in bounded.sample().as_numpy_iterator()]
    assert sum(lengths[:-1]) < 400 <= sum(lengths) + 4 * max(lengths) and len(lengths) < 40


# TensorFlow Datasets text, by name through TFDS's mock (no download).


def test_tfds_text_errors_say_what_to_do(tmp_path):
    corpus = tfds_text.TfdsText(
        name="lm1b", vocab_path=str(tmp_path / "v.txt"), data_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match="'lm1b' is not prepared in data_dir"):
        corpus.vocab()
    with tfds.testing.mock_data(num_examples=4):
        wrong = dataclasses.replace(corpus, text_key="body")
        with pytest.raises(ValueError, match=r"TfdsText.text_key 'body' is not a feature.*'text'"):
            wrong.vocab()
    with pytest.raises(ValueError, match="TfdsText.name 'no_such_text' is not a TensorFlow"):
        dataclasses.replace(corpus, name="no_such_text").vocab()


# Token records.

VOCAB = 50


def write_token_records(directory, documents: list[list[int]], files: int, key="targets") -> str:
    directory.mkdir(parents=True)
    writers = [tf.io.TFRecordWriter(str(directory / f"part-{i:02d}")) for i in range(files)]
    for i, ids in enumerate(documents):
        feature = {key: tf.train.Feature(int64_list=tf.train.Int64List(value=ids))}
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        writers[i % files].write(example.SerializeToString())
    for writer in writers:
        writer.close()
    return str(directory / "part-*")


def _documents(count: int, start: int) -> list[list[int]]:
    """Document i: its number (start + i, a unique first id) then 2 to 20 ids of 5..VOCAB-1."""
    rng = np.random.default_rng(start)
    return [
        [start + i, *rng.integers(5, VOCAB, rng.integers(2, 20)).tolist()] for i in range(count)
    ]


def _chunks(document, length):
    return [document[i : i + length] for i in range(0, len(document), length)]


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    train = _documents(40, 100)  # first ids 100..139: above VOCAB, so they need vocab_size=200
    return (
        write_token_records(root / "train", train, files=4),
        write_token_records(root / "eval", _documents(9, 150), files=2),
        train,
    )


def records(token_files, **settings) -> token_records.TokenRecords:
    return token_records.TokenRecords(
        **{
            "train_files": token_files[0],
            "eval_files": token_files[1],
            "vocab_size": 200,
            "sequence_length": 16,
            "eos_id": 1,
            "shuffle_buffer": 8,
            "cycle_length": 2,
            "log_stats": False,
            **settings,
        }
    )


def _first_ids(rows) -> set[int]:
    """The documents in rows: their first ids (>= 100) at segment starts."""
    tokens, positions = rows[0]["tokens"].numpy(), rows[0]["positions"].numpy()
    return {int(t) for t in tokens[(positions == 0) & (tokens >= 100)]}


def test_token_records_pack_every_document_once_per_epoch(token_files):
    corpus = records(token_files, sharding="read_all")
    batches = list(text.text_lm("train", global_batch_size=2, corpus=corpus).take(40))
    seen = [i for b in batches for i in sorted(_first_ids(b))]
    expected = {tuple(d + [1]) for d in token_files[2]}  # eos_id added
    rows = {
        tuple(b[0]["tokens"].numpy()[r][b[0]["segment_ids"].numpy()[r] == s])
        for b in batches
        for r in range(2)
        for s in range(1, 17)
    }
    assert set(range(100, 140)) <= set(seen)
    assert {d for d in expected if len(d) <= 16} <= rows  # whole documents, eos at the end
    resumed = next(iter(text.text_lm("train", global_batch_size=2, corpus=corpus, start_step=7)))
    np.testing.assert_array_equal(resumed[0]["tokens"], batches[7][0]["tokens"])
    reseeded = text.text_lm(
        "train", global_batch_size=2, corpus=dataclasses.replace(corpus, seed=1)
    )
    other = [i for b in reseeded.take(8) for i in sorted(_first_ids(b))]
    assert other != seen[: len(other)]  # the order is the seed's


def test_token_records_hosts_read_their_own_files(token_files):
    """Two pipelines, 'read_own': disjoint documents, together all of them in their first epoch."""
    seen = []
    for pipeline in range(2):
        context = tf.distribute.InputContext(2, pipeline, 2)
        data = text.text_lm("train", context, global_batch_size=2, corpus=records(token_files))
        rows = list(data.take(30))  # 60 rows: over 3 epochs of its 20 documents
        seen.append(set().union(*(_first_ids(b) for b in rows)))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(100, 140))


@pytest.mark.tf_compat
def test_token_records_eval_counts_every_target_once(token_files):
    documents = [[*d, 1] for d in _documents(9, 150)]
    targets = sum(len(c) - 1 for d in documents for c in _chunks(d, 16))
    corpus = records(token_files)
    parts = [
        list(
            text.text_lm(
                "eval", tf.distribute.InputContext(2, p, 2), global_batch_size=4, corpus=corpus
            )
        )
        for p in range(2)
    ]
    assert len(parts[0]) == len(parts[1])  # every replica runs the same steps
    assert sum(float(b[2].numpy().sum()) for part in parts for b in part) == targets


def test_token_ids_out_of_range_are_errors(token_files, tmp_path):
    with pytest.raises(ValueError, match=r"part-00, record 1: token id 10\d is outside \[0, 50\)"):
        next(
            iter(
                text.text_lm(
                    "train", global_batch_size=2, corpus=records(token_files, vocab_size=50)
                )
            )
        )
    # Past the records checked at set-up: the check in the graph stops the pipeline.
    late = write_token_records(tmp_path / "late", [[3, 4]] * 70 + [[3, 999]], files=1)
    corpus = records((late, late, None), vocab_size=VOCAB)
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        list(corpus.eval_tokens(corpus.vocabulary()))
    assert train.bad_data(error.value) == (
        f"bad data: a token id of 'targets' in {tmp_path}/late/part-00... is outside [0, 50): "
        "set TokenRecords.vocab_size to the tokenizer's size (the id: 999)"
    )


@pytest.mark.parametrize(
    "settings, error, message",
    [
        ({"key": "input_ids"}, ValueError, "no int64 feature 'input_ids' (TokenRecords.key)"),
        ({"vocab_size": None}, ValueError, "set TokenRecords.vocab_size"),
        ({"train_files": "/no/such/part-*"}, ValueError, "TokenRecords.train_files: '/no/such"),
        ({"eos_id": 200}, ValueError, "TokenRecords.eos_id = 200 is not below the 200 ids"),
        ({"sharding": "hosts"}, ValueError, "TokenRecords.sharding must be one of"),
        ({"pad_id": -1}, ValueError, "TokenRecords.pad_id must be a non-negative integer"),
    ],
)
def test_token_record_settings_are_checked(token_files, settings, error, message):
    with pytest.raises(error, match=re.escape(message)):
        next(
            iter(
                text.text_lm("train", global_batch_size=2, corpus=records(token_files, **settings))
            )
        )


def test_token_records_that_are_not_token_records(token_files, tmp_path):
    (tmp_path / "notes.txt").write_text("not a TFRecord file\n" * 20)
    with pytest.raises(ValueError, match=r"notes.txt is not a TFRecord file \(.*\): TokenRecords"):
        text.text_lm("eval", global_batch_size=2, corpus=records((None, str(tmp_path / "*.txt"))))
    with tf.io.TFRecordWriter(str(tmp_path / "bytes.tfrecord")) as writer:
        writer.write(b"\xff\xfe not a protocol buffer")
    with pytest.raises(ValueError, match=r"bytes.tfrecord, record 1 is not a tf.train.Example"):
        text.text_lm(
            "eval", global_batch_size=2, corpus=records((None, str(tmp_path / "bytes.tfrecord")))
        )


def test_token_records_take_their_size_from_a_vocabulary_file(token_files, tmp_path):
    vocab.save_vocab([f"t{i}" for i in range(200)], str(tmp_path / "vocab.txt"))
    corpus = records(token_files, vocab_size=None, vocab_path=str(tmp_path / "vocab.txt"))
    assert corpus.vocabulary().size == 200
    with pytest.raises(ValueError, match="has 200 tokens, more than vocab_size=150"):
        dataclasses.replace(corpus, vocab_size=150).vocabulary()


def test_masked_lm_on_token_records_needs_a_mask_id(token_files):
    with pytest.raises(ValueError, match="set TokenRecords.mask_id"):
        text.text_mlm("train", global_batch_size=2, corpus=records(token_files))
    inputs, labels, weights = next(
        iter(text.text_mlm("train", global_batch_size=2, corpus=records(token_files, mask_id=4)))
    )
    assert inputs["masked_positions"].shape == labels.shape == weights.shape == (2, 3)


# Each source through `python -m framework.train`, in this process: a tiny decoder, two steps,
# and the eval split counted exactly (the log's "on N targets").

TINY_DECODER = [
    f"--gin.models.decoder_tiny.{name}={value}"
    for name, value in dict(
        vocab_size=200, max_length=16, depth=1, dim=16, num_heads=2, mlp_dim=16
    ).items()
]
TINY_LM_RUN = ["--gin_file=lm_quickstart.gin", *TWO_STEPS, *TINY_DECODER]


@pytest.mark.slow
def test_each_text_source_trains_through_the_binary(token_files, tmp_path, caplog):
    """JSON lines (TextCorpus, with its statistics logged), token records, and lm1b by name on
    TFDS's mock (6 examples a split: eval reads TFDS's test split, not a hash share)."""
    corpus = write_jsonl(tmp_path / "jsonl", files=2, per_file=30)
    eval_documents = [[*d, 1] for d in _documents(9, 150)]
    runs = {
        "json_lines": [
            f"--gin.data.TextCorpus.files=['{corpus}']",
            "--gin.data.TextCorpus.json_field='text'",
            f"--gin.data.TextCorpus.vocab_path='{tmp_path}/json_lines/vocab.txt'",
            "--gin.data.TextCorpus.vocab_size=200",
            "--gin.data.TextCorpus.sequence_length=16",
            "--gin.data.TextCorpus.eval_fraction=0.2",
        ],
        "token_records": [
            "--gin.data.text_lm.corpus=@data.TokenRecords()",
            f"--gin.data.TokenRecords.train_files='{token_files[0]}'",
            f"--gin.data.TokenRecords.eval_files='{token_files[1]}'",
            "--gin.data.TokenRecords.vocab_size=200",
            "--gin.data.TokenRecords.eos_id=1",
            "--gin.data.TokenRecords.sequence_length=16",
            "--gin.data.TokenRecords.log_stats=False",
        ],
        "lm1b": [
            "--gin.data.text_lm.corpus=@data.TfdsText()",
            "--gin.data.TfdsText.name='lm1b'",
            "--gin.data.TfdsText.eval_split='test'",
            f"--gin.data.TfdsText.vocab_path='{tmp_path}/lm1b/vocab.txt'",
            "--gin.data.TfdsText.vocab_size=200",
            "--gin.data.TfdsText.sequence_length=16",
            "--gin.data.TfdsText.log_stats=False",
        ],
    }
    for name, flags in runs.items():
        caplog.clear()
        with tfds.testing.mock_data(num_examples=6):
            log = train_binary([*TINY_LM_RUN, *flags], tmp_path / name, caplog)
        if name == "token_records":
            targets = sum(len(c) - 1 for d in eval_documents for c in _chunks(d, 16))
        else:
            source = text.TextCorpus(
                files=corpus,
                json_field="text",
                vocab_path=f"{tmp_path}/json_lines/vocab.txt",
                vocab_size=200,
                sequence_length=16,
                eval_fraction=0.2,
            )
            if name == "lm1b":
                source = tfds_text.TfdsText(
                    name="lm1b",
                    eval_split="test",
                    vocab_path=f"{tmp_path}/lm1b/vocab.txt",
                    vocab_size=200,
                    sequence_length=16,
                )
            with tfds.testing.mock_data(num_examples=6):
                documents = list(source.eval_tokens(source.vocabulary()).as_numpy_iterator())
            if name == "lm1b":
                assert len(documents) == 6 and len(vocab.load_vocab(source.vocab_path)) <= 200
                # framework.sample finds the vocabulary through the run's config.gin.
                assert sample.load_run(str(tmp_path / name))[1] == list(source.vocab())
            targets = sum(len(c) - 1 for d in documents for c in _chunks(list(d), 16))
        assert "step 2/2" in log and f"on {targets} targets" in log, (name, log[-2000:])


def test_the_shipped_sample_corpus_carries_no_figure():
    """The corpus is prose of the docs, frozen: a measured figure in it would go stale."""
    corpus = open(text.SAMPLE_CORPUS, encoding="utf-8").read()
    assert len(corpus) > 50_000 and corpus.count("\n\n") > 100
    assert not re.search(r"\d", corpus)
