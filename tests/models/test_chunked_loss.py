"""A loss in chunks: the whole logits' losses, predictions and gradients, without the logits.

Tolerance: the chunks compute the same float32 products as the whole projection; only XLA's and
Eigen's order of summation differ, about 1e-7 relative; the tests allow 1e-5.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import memory, remat
from framework.models import language, transformer
from framework.models.chunked_loss import chunked_losses
from framework.trainer import train_step
from framework.trainer.losses import cross_entropy
from tests.models.test_attention import TEXT, _error, _text_rows

HIDDEN = tf.random.stateless_normal([2, 13, 16], [1, 2])
TABLE = tf.random.stateless_normal([50, 16], [3, 4])
BIAS = tf.random.stateless_normal([50], [5, 6])
LABELS = tf.random.stateless_uniform([2, 13], [7, 8], 0, 50, tf.int32)
WEIGHTS = tf.random.stateless_normal([2, 13], [9, 10])


SOFT_LABELS = tf.nn.softmax(tf.random.stateless_normal([2, 13, 50], [11, 12]))


def _smoothed(logits, labels):
    return cross_entropy(logits, labels, label_smoothing=0.1)


LOSSES = {  # name: (loss_fn, labels)
    "cross_entropy": (cross_entropy, LABELS),
    "label_smoothing": (_smoothed, LABELS),
    "soft_labels": (cross_entropy, SOFT_LABELS),
}


def _run(fn, mode: str) -> list[np.ndarray]:
    def step(hidden, table, bias):
        with tf.GradientTape() as tape:
            tape.watch([hidden, table, bias])
            losses, predictions = fn(hidden, table, bias)
            loss = tf.reduce_sum(losses * WEIGHTS)
        return [losses, predictions, *tape.gradient(loss, [hidden, table, bias])]

    compiled = step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")
    return [np.asarray(t) for t in compiled(HIDDEN, TABLE, BIAS)]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
def test_chunks_give_the_whole_logits_losses_predictions_and_gradients(mode, loss):
    loss_fn, labels = LOSSES[loss]

    def whole(hidden, table, bias):
        logits = tf.matmul(hidden, table, transpose_b=True) + bias
        return loss_fn(logits, labels), tf.argmax(logits, -1, output_type=tf.int32)

    want = _run(whole, mode)
    for chunk in (1, 5, 26, 64):  # one token, padded, all tokens in one chunk, more than all

        def chunked(hidden, table, bias, chunk=chunk):
            return chunked_losses(
                hidden, table, labels, chunk_size=chunk, loss_fn=loss_fn, bias=bias
            )

        got = _run(chunked, mode)
        np.testing.assert_array_equal(got[1], want[1])
        for g, w in zip(got[:1] + got[2:], want[:1] + want[2:], strict=True):
            assert _error([g], [w]) < 1e-5, chunk


def test_the_loss_holds_no_logits():
    """XLA:CPU's plan of the loss's gradient for 4 x 512 tokens and a 256 k vocabulary (width
    64): the whole path's temporaries are several [tokens, vocab] float32 tensors (4 GiB each);
    in chunks of 64 tokens they are a few chunks' logits and the table's gradient."""
    tokens, vocab, dim = 2048, 256_000, 64
    logits_bytes = tokens * vocab * 4

    def gradient_of(losses_fn):
        @tf.function(jit_compile=True)
        def gradient(hidden, table, labels):
            with tf.GradientTape() as tape:
                tape.watch([hidden, table])
                loss = tf.reduce_sum(losses_fn(hidden, table, labels))
            return tape.gradient(loss, [hidden, table])

        return gradient

    def whole(hidden, table, labels):
        return cross_entropy(tf.matmul(hidden, table, transpose_b=True), labels)

    def chunked(hidden, table, labels):
        return chunked_losses(hidden, table, labels, chunk_size=64)[0]

    specs = (
        tf.TensorSpec([4, 512, dim]),
        tf.TensorSpec([vocab, dim]),
        tf.TensorSpec([4, 512], tf.int32),
    )
    temps = {
        name: memory.compiled_bytes(gradient_of(fn), *specs).temp_bytes
        for name, fn in (("whole", whole), ("chunked", chunked))
    }
    table_bytes = vocab * dim * 4
    assert temps["whole"] > logits_bytes, temps
    assert temps["chunked"] < 4 * 64 * vocab * 4 + 2 * table_bytes, temps


def test_a_chunk_size_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        chunked_losses(HIDDEN, TABLE, LABELS, chunk_size=0)


def _batch(kind: str):
    rows = _text_rows()
    if kind == "bert":
        rows["masked_positions"] = tf.constant([[1, 4, 9], [0, 2, 15]])
        return rows, tf.constant([[5, 6, 7], [8, 9, 10]]), tf.constant([[1.0, 1, 0], [1, 1, 1]])
    labels = tf.roll(rows["tokens"], -1, axis=1)
    return rows, labels, tf.cast(rows["segment_ids"] > 0, tf.float32)


def _sums_and_gradients(model, batch, mode: str, loss_fn=cross_entropy):
    start = [v.numpy() for v in model.variables]

    def step(batch):
        with tf.GradientTape() as tape:
            sums = train_step.batch_sums(model, batch, loss_fn, training=True)
        grads = tape.gradient(sums[0], model.trainable_variables)
        return list(sums), [tf.convert_to_tensor(g) for g in grads]

    compiled = step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")
    sums, grads = compiled(batch)
    for variable, value in zip(model.variables, start, strict=True):
        variable.assign(value)
    return [float(s) for s in sums], [np.asarray(g, np.float64) for g in grads]


# XLA's compiles (24 and 32 s) run with the slow tests; the fast tier runs the decoder eagerly.
@pytest.mark.parametrize(
    ("kind", "mode"),
    [
        ("decoder", "eager"),
        pytest.param("decoder", "xla", marks=pytest.mark.slow),
        pytest.param("bert", "eager", marks=pytest.mark.slow),
        pytest.param("bert", "xla", marks=pytest.mark.slow),
    ],
)
def test_the_trainers_sums_and_gradients_are_those_of_the_whole_logits(kind, mode):
    """`batch_sums` of a language model with `loss_chunk`: the same loss, correct count and
    gradients as with the whole logits (dropout on, padding weighted 0, blockwise attention and
    full remat too)."""
    build = {"decoder": language.DecoderLM, "bert": language.BertEncoder}[kind]
    keras.utils.set_random_seed(0)
    whole = build(**TEXT)
    chunked = build(**TEXT, loss_chunk=5, attention="blockwise", attention_chunk=6)
    transformer.copy_weights(whole, chunked)
    batch = _batch(kind)
    want_sums, want = _sums_and_gradients(whole, batch, mode)
    for policy in (None, "nothing_saveable"):
        remat.set_grad_checkpointing(chunked, policy=policy, enable=policy is not None)
        sums, got = _sums_and_gradients(chunked, batch, mode)
        np.testing.assert_allclose(sums, want_sums, rtol=1e-5)
        assert _error(got, want) < 1e-5, policy


def test_the_trainers_own_loss_is_computed_in_chunks(monkeypatch):
    """The trainer's loss (here with label smoothing) reaches the chunks: the same sums and
    gradients as over the whole logits, and the chunked path really ran (its calls counted)."""
    calls = []
    chunked_losses_fn = language.chunked_losses
    monkeypatch.setattr(
        language,
        "chunked_losses",
        lambda *a, **k: calls.append(k["loss_fn"]) or chunked_losses_fn(*a, **k),
    )
    keras.utils.set_random_seed(0)
    whole = language.DecoderLM(**TEXT)
    chunked = language.DecoderLM(**TEXT, loss_chunk=4)
    transformer.copy_weights(whole, chunked)
    batch = _batch("decoder")
    want_sums, want = _sums_and_gradients(whole, batch, "xla", _smoothed)
    assert not calls
    sums, got = _sums_and_gradients(chunked, batch, "xla", _smoothed)
    assert calls == [_smoothed]
    np.testing.assert_allclose(sums, want_sums, rtol=1e-5)
    assert _error(got, want) < 1e-5
    with pytest.raises(ValueError, match="give it loss_chunk"):
        language.DecoderLM(**TEXT)(batch[0], labels=batch[1])
    with pytest.raises(ValueError, match="loss_chunk must be a positive"):
        language.DecoderLM(**TEXT, loss_chunk=0)


@pytest.mark.slow
def test_mixed_bfloat16_chunks_match_the_whole_logits():
    """Under mixed_bfloat16 both paths project in float32 from the same bfloat16 hidden states
    and tied table: the same sums and gradients (measured 4e-8 apart; 1e-5 allowed)."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(0)
        whole = language.DecoderLM(**TEXT)
        chunked = language.DecoderLM(**TEXT, loss_chunk=5)
        transformer.copy_weights(whole, chunked)
        batch = _batch("decoder")
        want_sums, want = _sums_and_gradients(whole, batch, "xla")
        sums, got = _sums_and_gradients(chunked, batch, "xla")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    np.testing.assert_allclose(sums, want_sums, rtol=1e-5)
    assert _error(got, want) < 1e-5
