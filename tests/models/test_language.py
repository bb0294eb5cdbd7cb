"""Decoder LM and BERT encoder: sizes, document-local attention, checkpoints, remat, training."""

import functools
import os
import subprocess
import sys

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import remat, sample
from framework.data import text
from framework.data.text import vocab
from framework.models import language
from framework.trainer import trainer
from tests.subprocesses import REPO_DIR, child_env

TINY = dict(vocab_size=64, max_length=16, dim=32, depth=2, num_heads=4, mlp_dim=48)
BUILDERS = {"decoder": language.DecoderLM, "bert": language.BertEncoder}
COUNTS = {"decoder": language.decoder_parameter_count, "bert": language.bert_parameter_count}


def _rows(tokens, segments):
    tokens = tf.constant(tokens, tf.int32)
    segments = np.asarray(segments)
    positions = np.zeros_like(segments)
    for row, segs in enumerate(segments):
        for seg in set(segs.tolist()):
            where = segs == seg
            positions[row, where] = np.arange(where.sum())
    return {
        "tokens": tokens,
        "segment_ids": tf.constant(segments, tf.int32),
        "positions": tf.constant(positions, tf.int32),
    }


@pytest.mark.parametrize("kind", BUILDERS)
def test_parameter_count_formula_matches_the_built_model(kind):
    for config in (TINY, {**TINY, "depth": 3, "mlp_dim": 80, "vocab_size": 100}):
        assert BUILDERS[kind](**config).count_params() == COUNTS[kind](**config)


@pytest.mark.parametrize("kind", BUILDERS)
def test_each_weight_draws_its_own_initial_values_from_the_runs_seed(kind):
    """Each initializer takes its seed when the model is built, after the run sets its seed: the
    same seed gives the same model in every process, and no two weights start alike (the token
    table's first rows once equalled the position table)."""
    keras.utils.set_random_seed(7)
    model = BUILDERS[kind](**TINY)
    tokens, positions = model.token_embedding.embeddings, model.position_embedding.embeddings
    assert not np.allclose(tokens[: TINY["max_length"]], positions)
    keras.utils.set_random_seed(7)
    again = BUILDERS[kind](**TINY)
    for a, b in zip(model.weights, again.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_bert_base_has_110m_parameters():
    model = language.bert_base()
    assert model.count_params() == language.bert_parameter_count(**language.BERT_BASE)
    assert 108e6 < model.count_params() < 111e6  # BERT-base: 110 M
    del model
    keras.backend.clear_session()


def test_large_sizes_without_building_them():
    assert 0.95e9 < language.decoder_parameter_count(**language.DECODER_1B) < 1.05e9
    assert 330e6 < language.bert_parameter_count(**language.BERT_LARGE) < 340e6  # BERT: 335 M


@pytest.mark.parametrize("kind", BUILDERS)
def test_attention_never_crosses_documents(kind):
    model = BUILDERS[kind](**TINY)
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 64, size=(2, 16))
    segments = [[1] * 6 + [2] * 7 + [0] * 3, [1] * 16]
    before = model(_rows(tokens, segments)).numpy()
    changed = tokens.copy()
    changed[0, 6:] = rng.integers(5, 64, size=10)  # the second document and the padding
    after = model(_rows(changed, segments)).numpy()
    np.testing.assert_allclose(after[0, :6], before[0, :6], atol=1e-5)
    np.testing.assert_allclose(after[1], before[1], atol=1e-5)
    assert np.abs(after[0, 6:13] - before[0, 6:13]).max() > 1e-3
    later = tokens.copy()
    later[1, 10:] = rng.integers(5, 64, size=6)
    moved = np.abs(model(_rows(later, segments)).numpy()[1, :10] - before[1, :10]).max()
    assert (moved < 1e-5) == (kind == "decoder"), "causal for the decoder, both ways for BERT"


def test_bert_scores_only_the_masked_positions():
    model = language.BertEncoder(**TINY)
    inputs = _rows(np.arange(32).reshape(2, 16) % 60 + 4, [[1] * 16, [1] * 10 + [0] * 6])
    full = model(inputs).numpy()
    picked = model({**inputs, "masked_positions": tf.constant([[3, 0], [9, 2]])}).numpy()
    np.testing.assert_allclose(picked, full[[[0, 0], [1, 1]], [[3, 0], [9, 2]]], atol=1e-5)


@pytest.mark.parametrize("kind", BUILDERS)
def test_checkpoint_restores_every_weight(kind, tmp_path):
    model = BUILDERS[kind](**TINY)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = BUILDERS[kind](**TINY)
    tf.train.Checkpoint(model=fresh).restore(path).assert_consumed()
    for a, b in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_rows_longer_than_max_length_are_a_clear_error():
    model = language.DecoderLM(**TINY)
    with pytest.raises(ValueError, match="max_length=16"):
        model(_rows(np.ones((1, 32)), np.ones((1, 32))))


@pytest.mark.slow
@pytest.mark.parametrize("kind", BUILDERS)
def test_remat_gradients_match_for_every_policy(kind):
    model = BUILDERS[kind](**{**TINY, "dropout": 0.1})
    inputs = _rows(np.arange(32).reshape(2, 16) % 60 + 4, [[1] * 8 + [2] * 8, [1] * 16])
    seeds = [v.numpy() for v in model.non_trainable_variables]  # dropout seed generators

    def gradients(inputs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(inputs, training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        return [tf.convert_to_tensor(g) for g in grads]

    def run():  # a fresh trace, from the same dropout seeds
        for variable, value in zip(model.non_trainable_variables, seeds):
            variable.assign(value)
        return [g.numpy() for g in tf.function(gradients, jit_compile=True)(inputs)]

    want = run()
    # Every policy is checked on a generic block in test_remat.py; here, full remat and one
    # selective policy by the names these models tag.
    policies = ("nothing_saveable", remat.policies.save_only_these_names("qkv_proj", "attn_out"))
    for policy in policies:
        blocks = remat.set_grad_checkpointing(model, policy=policy)
        assert {b.name for b in blocks} >= {"block_0", "block_1"}
        for g, w in zip(run(), want):
            assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w) + 1e-12, policy
    remat.set_grad_checkpointing(model, enable=False)


@pytest.mark.slow
def test_tiny_decoder_learns_text_traces_once_and_samples(tmp_path):
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text(
        "\n".join(f"the quick brown fox jumps over the lazy dog {i % 7}" for i in range(60))
    )
    corpus = text.TextCorpus(
        files=str(corpus_file),
        vocab_path=str(tmp_path / "run" / "vocab.txt"),
        vocab_size=128,
        sequence_length=16,
        document_per="line",
        eval_fraction=0.3,
        log_stats=False,
    )
    run = trainer.Trainer(
        str(tmp_path / "run"),
        model_fn=functools.partial(language.DecoderLM, **{**TINY, "vocab_size": 128}),
        dataset_fn=functools.partial(text.text_lm, corpus=corpus),
        global_batch_size=8,
        train_steps=100,
        steps_per_loop=50,
        learning_rate=1e-2,
        warmup_steps=10,
    )
    stats = text.split_stats(corpus, "train")
    metrics = run.train()
    assert metrics["loss"] < 0.5 * stats["unigram_entropy"]
    assert run.traces["train_step"] <= 2
    vocab_list = corpus.vocab()
    greedy = sample.generate(run.model, vocab_list, "the quick", max_tokens=6, temperature=0)
    assert greedy.startswith("the quick brown fox")
    assert greedy == sample.generate(
        run.model, vocab_list, "the quick", max_tokens=6, temperature=0
    )
    sample.generate(run.model, vocab_list, "", max_tokens=4, temperature=1.0, seed=3)


@pytest.fixture
def run_dir(tmp_path):
    """What `framework.sample` reads of a training run: config.gin, vocab.txt, a checkpoint."""
    run = tmp_path / "run"
    model = language.DecoderLM(**TINY)
    model(_rows(np.ones((1, 16)), np.ones((1, 16))))
    tf.train.Checkpoint(model=model).save(str(run / "checkpoints" / "ckpt"))
    vocab.save_vocab([*vocab.RESERVED_TOKENS, *"abcdefgh"], str(run / "vocab.txt"))
    bindings = "\n".join(f"models.DecoderLM.{name} = {value}" for name, value in TINY.items())
    (run / "config.gin").write_text(f"Trainer.model_fn = @models.DecoderLM\n{bindings}\n")
    return run


def sample_binary(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env["PYTHONPATH"], pythonpath]))
    return subprocess.run(
        [sys.executable, "-m", "framework.sample", *args],
        cwd=REPO_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a sample run that ended with status 2."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.slow
def test_sample_loads_the_run_it_is_given(run_dir):
    try:
        model, vocab_list = sample.load_run(str(run_dir))
    finally:
        gin.clear_config()
    assert model.max_length == TINY["max_length"] and vocab_list[-1] == "h"


@pytest.mark.slow
def test_sample_draws_only_tokens_of_the_vocabulary(run_dir):
    """The model's 64 ids against a vocabulary of 13 (lm_quickstart's 1024 against what its
    corpus gives): an id past the vocabulary crashed tensorflow-text's detokenizer (a
    segmentation fault). Nearly uniform draws, as a barely trained model makes."""
    try:
        model, vocab_list = sample.load_run(str(run_dir))
    finally:
        gin.clear_config()
    words = sample.generate(model, vocab_list, "", max_tokens=12, temperature=1e3, seed=1)
    assert words and set(words.replace("[UNK]", "").replace(" ", "")) <= set("abcdefgh"), words


def test_sample_shows_the_words_the_vocabulary_lacks_as_unk():
    """A prompt word outside the vocabulary is [UNK] in the printout (it was dropped silently)."""
    vocab_list = [*vocab.RESERVED_TOKENS, *"abcdefgh"]
    model = language.DecoderLM(**TINY)
    assert sample.generate(model, vocab_list, "a zebra b", max_tokens=0) == "a [UNK] b"


@pytest.mark.slow
def test_sample_refuses_runs_it_cannot_continue_text_with(run_dir, tmp_path):
    prompt = sample_binary(f"--model_dir={run_dir}", "--prompt=\udcff bad")
    assert "--prompt is not valid UTF-8" in error_line(prompt)
    words = [*vocab.RESERVED_TOKENS, *(f"w{i}" for i in range(60))]
    vocab.save_vocab(words, str(run_dir / "vocab.txt"))
    too_large = f"has {len(words)} tokens, more than the model's 64"
    assert too_large in error_line(sample_binary(f"--model_dir={run_dir}"))
    bert = language.BertEncoder(**TINY)
    bert(_rows(np.ones((1, 16)), np.ones((1, 16))))
    tf.train.Checkpoint(model=bert).save(str(tmp_path / "bert" / "checkpoints" / "ckpt"))
    config = (run_dir / "config.gin").read_text().replace("DecoderLM", "BertEncoder")
    (tmp_path / "bert" / "config.gin").write_text(config)
    not_a_decoder = error_line(sample_binary(f"--model_dir={tmp_path / 'bert'}"))
    assert "trained a BertEncoder, not a decoder" in not_a_decoder


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, message",
    [
        ("--max_tokens=-3", "-3 is not a positive integer"),
        ("--temperature=-1", "non-negative"),
        ("--gin.Trainer.train_steps=3", "--gin.Trainer.train_steps=3: this command takes no gin"),
    ],
)
def test_sample_flags_out_of_range_are_one_line(flag, message, tmp_path):
    assert message in error_line(sample_binary(f"--model_dir={tmp_path}", flag))


@pytest.mark.slow
def test_sample_on_a_truncated_checkpoint_is_one_line(run_dir):
    data = next((run_dir / "checkpoints").glob("ckpt-1.data-*"))
    data.write_bytes(data.read_bytes()[:100])
    assert "cannot be restored" in error_line(sample_binary(f"--model_dir={run_dir}"))


@pytest.mark.slow
def test_sample_does_not_run_the_imports_of_a_run_config(run_dir, tmp_path):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "marker_module.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('IMPORTED').touch()\n"
    )
    config = run_dir / "config.gin"
    config.write_text("import marker_module\n" + config.read_text())
    result = sample_binary(f"--model_dir={run_dir}", pythonpath=str(modules))
    assert "line 1: 'import marker_module'" in error_line(result)
    assert not (modules / "IMPORTED").exists()
    imported = subprocess.run(
        [sys.executable, "-c", "import marker_module"], cwd=modules, check=True
    )
    assert imported.returncode == 0 and (modules / "IMPORTED").exists()  # the marker works
