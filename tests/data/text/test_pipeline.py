"""The text pipeline: tokenizer round trip, packing, LM and MLM examples, splits, bad input."""

import dataclasses
import json
import math

import numpy as np
import pytest
import tensorflow as tf

from framework.core import files
from framework.data import positions, text
from framework.data.text import packing, vocab

WORDS = (
    "the model trains on packed rows of tokens while attention stays inside each document and "
    "the vocabulary is learned once then saved beside checkpoints so sampling reads it again"
).split()
LENGTH = 32


def _paragraphs(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        words = rng.choice(WORDS, size=rng.integers(3, 40))
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> text.TextCorpus:
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.md").write_text("\n\n".join(_paragraphs(60, 0)) + "\n")
    (root / "b.md").write_text("\n\n\n".join(_paragraphs(60, 1)) + "\n")
    return text.TextCorpus(
        files=(str(root / "*.md"),),
        vocab_path=str(root / "run" / "vocab.txt"),
        vocab_size=200,
        sequence_length=LENGTH,
        eval_fraction=0.2,
        log_stats=False,
    )


def test_vocab_is_learned_once_saved_and_reloaded(corpus):
    learned = corpus.vocab()
    assert 0 < len(learned) <= corpus.vocab_size
    assert learned[: len(vocab.RESERVED_TOKENS)] == list(vocab.RESERVED_TOKENS)
    stamp = tf.io.gfile.stat(corpus.vocab_path).mtime_nsec
    assert corpus.vocab() == learned == vocab.load_vocab(corpus.vocab_path)
    assert tf.io.gfile.stat(corpus.vocab_path).mtime_nsec == stamp


@pytest.mark.tf_compat
def test_tokenize_detokenize_round_trip(corpus):
    tokenizer = text.make_tokenizer(corpus.vocab())
    sample = ["the  model trains\n while attention stays inside!", "saved beside checkpoints?"]
    ids = text.tokenize(tokenizer, sample)
    assert ids.shape[0] == 2 and vocab.special_ids(corpus.vocab())[vocab.UNK] not in ids.flat_values
    back = [s.decode() for s in text.detokenize(tokenizer, ids).numpy()]
    assert back == [" ".join(s.split()) for s in sample]


def test_packing_keeps_every_token_once_and_separates_documents():
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 100, size=n)) for n in rng.integers(0, 3 * LENGTH, size=40)]
    rows = {k: v.numpy() for k, v in packing.pack(tf.ragged.constant(docs), LENGTH).items()}
    assert rows["tokens"].shape[1] == LENGTH
    chunks = []
    for tokens, segments, places in zip(rows["tokens"], rows["segment_ids"], rows["positions"]):
        used = segments > 0
        assert not used[np.argmin(used) :].any() or used.all(), "padding only at the row's end"
        for segment in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == segment)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1)), "contiguous"
            assert np.array_equal(places[where], np.arange(len(where))), "positions restart"
            chunks.append(tokens[where])
    # Every document, cut into row-sized chunks, appears exactly once.
    expected = [tuple(d[i : i + LENGTH]) for d in docs for i in range(0, len(d), LENGTH)]
    assert sorted(map(tuple, chunks)) == sorted(expected)
    share = packing.padding_share(tf.data.Dataset.from_tensor_slices(rows))
    assert share == pytest.approx(1 - sum(map(len, docs)) / rows["tokens"].size)


@pytest.mark.tf_compat
def test_lm_batches_have_static_shapes_and_shifted_targets(corpus):
    dataset = text.text_lm("train", global_batch_size=4, corpus=corpus)
    inputs, targets, weights = dataset.element_spec
    for spec in (*inputs.values(), targets, weights):
        assert spec.shape == (4, LENGTH)
    for inputs, targets, weights in dataset.take(3):
        tokens, segments = inputs["tokens"].numpy(), inputs["segment_ids"].numpy()
        targets, weights = targets.numpy(), weights.numpy()
        same = (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] > 0)
        assert np.array_equal(weights[:, :-1] > 0, same) and not weights[:, -1].any()
        assert np.array_equal(targets[:, :-1][same], tokens[:, 1:][same])


def test_train_stream_resumes_where_it_stopped(corpus):
    first = list(text.text_lm("train", global_batch_size=2, corpus=corpus).take(5))
    resumed = next(iter(text.text_lm("train", global_batch_size=2, corpus=corpus, start_step=4)))
    assert np.array_equal(resumed[0]["tokens"], first[4][0]["tokens"])


def _pipeline(index: int, count: int) -> tf.distribute.InputContext:
    return tf.distribute.InputContext(count, index, num_replicas_in_sync=count)


def test_pipelines_reading_everything_split_each_global_batch(corpus):
    corpus = dataclasses.replace(corpus, sharding="read_all")
    whole = next(iter(text.text_lm("train", global_batch_size=4, corpus=corpus)))[0][
        "tokens"
    ].numpy()
    parts = [
        next(iter(text.text_lm("train", _pipeline(p, 2), global_batch_size=4, corpus=corpus)))
        for p in range(2)
    ]
    assert np.array_equal(np.concatenate([p[0]["tokens"] for p in parts]), whole)


def test_eval_is_finite_held_out_and_counts_every_target(corpus):
    batches = list(text.text_lm("eval", global_batch_size=4, corpus=corpus))
    assert batches
    vocab_list = corpus.vocab()
    documents = list(corpus.tokens("eval", vocab_list).as_numpy_iterator())
    # Each document predicts all its tokens but [BOS], except where a row cut it into chunks.
    weight = sum(float(b[2].numpy().sum()) for b in batches)
    tokens = sum(len(d) - 1 for d in documents)
    assert tokens - len(documents) * 2 <= weight <= tokens
    train = {bytes(d) for d in corpus.documents("train").as_numpy_iterator()}
    assert not train & {bytes(d) for d in corpus.documents("eval").as_numpy_iterator()}


def test_mlm_masks_are_those_of_the_uninterrupted_stream_after_a_resume(corpus):
    def batches(split, start_step=0, count=5):
        data = text.text_mlm(split, global_batch_size=4, start_step=start_step, corpus=corpus)
        return [tf.nest.map_structure(lambda t: t.numpy(), b) for b in data.take(count)]

    def assert_same(a, b):
        tf.nest.map_structure(np.testing.assert_array_equal, a, b)

    whole = batches("train")
    for got, want in zip(batches("train", start_step=3, count=2), whole[3:], strict=True):
        assert_same(got, want)
    assert_same(batches("eval", count=2), batches("eval", count=2))  # each eval masks alike
    positions = [b[0]["masked_positions"] for b in whole]
    assert any(not np.array_equal(positions[0], p) for p in positions[1:])  # drawn per batch


def test_mlm_masking_rates(corpus):
    ids = vocab.special_ids(corpus.vocab())
    dataset = text.text_mlm("train", global_batch_size=32, corpus=corpus)
    picked = masked = random = kept = 0
    for inputs, labels, weights in dataset.take(16):
        tokens = inputs["tokens"].numpy()
        chosen = weights.numpy() > 0
        positions = inputs["masked_positions"].numpy()
        original = labels.numpy()[chosen]
        # Masking never picks padding, [BOS] or [EOS], and picks ceil(15%) of the rest of a row.
        unpicked = np.isin(original, [ids[vocab.PAD], ids[vocab.BOS], ids[vocab.EOS]])
        assert not unpicked.any()
        restored = tokens.copy()
        restored[np.nonzero(chosen)[0], positions[chosen]] = original
        is_special = np.isin(restored, [ids[vocab.PAD], ids[vocab.BOS], ids[vocab.EOS]])
        selectable = ((inputs["segment_ids"].numpy() > 0) & ~is_special).sum(1)
        expected = np.minimum(np.ceil(0.15 * selectable), math.ceil(0.15 * LENGTH))
        assert np.array_equal(chosen.sum(1), expected)
        at = np.take_along_axis(tokens, positions, axis=1)[chosen]
        picked += chosen.sum()
        masked += (at == ids[vocab.MASK]).sum()
        kept += (at == original).sum()
        random += ((at != original) & (at != ids[vocab.MASK])).sum()
    assert picked > 1500
    for count, rate in ((masked, 0.8), (random, 0.1), (kept, 0.1)):
        sigma = math.sqrt(picked * rate * (1 - rate))
        # A random replacement equals the original with probability 1/|vocab|: inside the bound.
        assert abs(count - picked * rate) < 5 * sigma + 0.01 * picked, (count, rate, picked)


def test_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        text.read_documents([str(tmp_path / "nowhere.txt")])


def test_a_directory_in_files_is_one_clear_error(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "b.txt").write_text("a document\n")
    with pytest.raises(ValueError, match=r"TextCorpus.files: '.*docs' is a directory.*docs/\*'"):
        files.list_files([str(tmp_path / "docs")], "TextCorpus.files")
    assert files.list_files(str(tmp_path / "*"), "TextCorpus.files") == [str(tmp_path / "b.txt")]


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"files": 3}, TypeError, "TextCorpus.files must be a path or glob pattern"),
        ({"vocab_path": None}, ValueError, "set TextCorpus.vocab_path"),
        ({"vocab_size": "8k"}, TypeError, "TextCorpus.vocab_size must be a positive integer"),
        ({"sequence_length": 1}, ValueError, "TextCorpus.sequence_length must be an integer >= 2"),
        ({"eval_fraction": 1.5}, ValueError, "TextCorpus.eval_fraction must be a number > 0 and <"),
        ({"log_stats": "no"}, TypeError, "TextCorpus.log_stats must be True or False, got 'no'"),
    ],
)
def test_bad_corpus_arguments_name_the_parameter(tmp_path, overrides, error, message):
    with pytest.raises(error, match=message):
        text.TextCorpus(**{"files": "a.txt", "vocab_path": str(tmp_path / "v.txt"), **overrides})


def test_bad_mask_rate_names_the_parameter(corpus):
    with pytest.raises(ValueError, match="text_mlm.mask_rate must be a number > 0 and < 1, got 0"):
        text.text_mlm("train", global_batch_size=2, corpus=corpus, mask_rate=0)


def test_empty_corpus_is_one_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("\n   \n\n")
    corpus = text.TextCorpus(
        files=str(tmp_path / "empty.txt"), vocab_path=str(tmp_path / "vocab.txt"), vocab_size=64
    )
    with pytest.raises(ValueError, match="empty"):
        text.text_lm("train", global_batch_size=2, corpus=corpus)


def test_a_corpus_not_in_utf8_names_the_file_and_its_first_bad_byte(tmp_path):
    (tmp_path / "a.txt").write_text("plain words here\n\nmore plain words\n")
    (tmp_path / "b.txt").write_bytes("caf\u00e9 and th\u00e9\n".encode("latin-1"))
    corpus = text.TextCorpus(
        files=str(tmp_path / "*.txt"), vocab_path=str(tmp_path / "vocab.txt"), vocab_size=64
    )
    with pytest.raises(ValueError, match=r"b\.txt is not UTF-8 text \(byte 3 on\): convert"):
        text.text_lm("train", global_batch_size=2, corpus=corpus)
    assert not (tmp_path / "vocab.txt").exists()


def test_vocab_larger_than_the_model_is_one_clear_error(corpus, tmp_path):
    big = tmp_path / "vocab.txt"
    vocab.save_vocab([*vocab.RESERVED_TOKENS, *(f"w{i}" for i in range(300))], str(big))
    small = text.TextCorpus(files=corpus.files, vocab_path=str(big), vocab_size=100)
    with pytest.raises(ValueError, match="more than vocab_size=100"):
        text.text_lm("train", global_batch_size=2, corpus=small)


def test_json_lines_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "first \\"doc\\"\\nline"}\n\n{"text": "second", "id": 2}\n')
    docs = [
        d.decode() for d in text.read_documents(str(path), json_field="text").as_numpy_iterator()
    ]
    assert docs == ['first "doc"\nline', "second"]
    path.write_text('{"body": "no text field"}\n')
    with pytest.raises(
        ValueError, match="docs.jsonl:1: not a JSON object with a string field 'text'"
    ):
        text.read_documents(str(path), json_field="text")


def _json_lines_corpus(root, corpus: text.TextCorpus) -> text.TextCorpus:
    """The fixture's paragraphs as JSON lines (blank lines between some), in two files."""
    for name, seed in (("a", 0), ("b", 1)):
        lines = [
            json.dumps({"text": p}) + ("\n" if i % 5 else "\n\n")
            for i, p in enumerate(_paragraphs(60, seed))
        ]
        (root / f"{name}.jsonl").write_text("".join(lines))
    return dataclasses.replace(
        corpus, files=str(root / "*.jsonl"), json_field="text", vocab_path=str(root / "v.txt")
    )


@pytest.mark.parametrize(
    "layout",
    ["paragraphs", pytest.param("json_lines", marks=pytest.mark.slow)],  # (40 s)
)
def test_resumed_stream_seeks_to_its_saved_position(corpus, layout, tmp_path, caplog):
    """Started from the position its pipeline recorded for step s, a stream makes the batches
    the uninterrupted one makes from s on - within a shuffle block, across blocks, in the next
    epoch - and says that it seeks; without a position for s it reads up to s, to the same rows.
    JSON lines are read past undecoded, and decoded after the seek."""
    if layout == "json_lines":
        corpus = _json_lines_corpus(tmp_path, corpus)
    small = dataclasses.replace(corpus, shuffle_buffer=7)
    log = positions.StreamPositions()
    whole = [
        b[0]["tokens"].numpy()
        for b in text.text_lm(
            "train", global_batch_size=2, corpus=small, stream_positions=log
        ).take(260)
    ]
    # Packing windows of 256 documents (about 2.7 epochs here) begin at steps 0, 101 and 201.
    saved = {step: log.of_step(step) for step in (13, 101, 150, 250)}
    windows = {tuple(row[1:5]) for row in saved.values()}
    assert len(windows) == 3 and {w[0] for w in windows} == {0, 2, 5}  # epochs
    assert all(w[3] > 0 for w in windows if w[0])  # they begin inside a shuffle block
    for step, row in saved.items():
        caplog.clear()
        with caplog.at_level("INFO"):
            resumed = text.text_lm(
                "train",
                global_batch_size=2,
                corpus=small,
                start_step=step,
                stream_positions=positions.StreamPositions(row[None]),
            )
        assert f"resumes its training stream at step {step} where it stopped" in caplog.text
        got = [b[0]["tokens"].numpy() for b in resumed.take(3)]
        assert all(np.array_equal(g, w) for g, w in zip(got, whole[step : step + 3], strict=True))
    caplog.clear()
    with caplog.at_level("INFO"):
        other = positions.StreamPositions(saved[13][None])  # saved for another step
        read = text.text_lm(
            "train", global_batch_size=2, corpus=small, start_step=150, stream_positions=other
        )
    assert "reading the training stream up to step 150" in caplog.text
    assert np.array_equal(next(iter(read))[0]["tokens"], whole[150])
