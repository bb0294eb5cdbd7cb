"""Blockwise attention computes plain attention's function and gradients, dropout included, and
never holds [batch, heads, S, S]: as a function, inside the models, with remat and scanned blocks.

Tolerances: in float32 the two paths sum the same products in another order (chunk by chunk,
with an online softmax), about 1e-7 relative apart; the tests allow 1e-5. In bfloat16 each
path rounds differently, so each is compared with the float32 result instead: blockwise must be
about as close to it as plain is.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from framework import memory, remat
from framework.models import attention, language, transformer, vit
from framework.models.attention import blockwise_attention, plain_attention
from tests.remat.test_scan import split_unrolled, unstacked

BATCH, LENGTH, HEADS, DEPTH = 2, 37, 3, 8
SEED = tf.constant([3, 4])


def _qkv(dtype=tf.float32, length: int = LENGTH):
    return [
        tf.cast(tf.random.stateless_normal([BATCH, length, HEADS, DEPTH], [i, 9]), dtype)
        for i in range(3)
    ]


def _segments(length: int = LENGTH) -> tf.Tensor:
    """Two packed documents and padding (segment 0) in the first row, one document in the
    second."""
    first = [1] * (length // 3) + [2] * (length // 2)
    return tf.constant([first + [0] * (length - len(first)), [1] * length], tf.int32)


VISIBILITY = {
    "all": {},
    "segments": {"segment_ids": _segments()},
    "causal": {"segment_ids": _segments(), "causal": True},
    "key_padding": {"mask": tf.constant(np.arange(LENGTH) < 30)[None, None, None, :]},
    "dense": {
        "mask": tf.constant(np.random.RandomState(0).rand(BATCH, 1, LENGTH, LENGTH) < 0.7)
        | tf.eye(LENGTH, dtype=tf.bool)
    },
}


def _compiled(fn, mode: str):
    return fn if mode == "eager" else tf.function(fn, jit_compile=mode == "xla")


def _outputs_and_gradients(fn, qkv, mode: str = "eager", **kwargs) -> list[np.ndarray]:
    def run(query, key, value):
        with tf.GradientTape() as tape:
            tape.watch([query, key, value])
            context = fn(query, key, value, **kwargs)
            loss = tf.reduce_sum(
                tf.cast(context, tf.float32) * tf.random.stateless_normal(context.shape, [7, 8])
            )
        return [context, *tape.gradient(loss, [query, key, value])]

    return [np.asarray(tf.cast(t, tf.float32)) for t in _compiled(run, mode)(*qkv)]


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("rate", [0.0, 0.2])
@pytest.mark.parametrize("visibility", VISIBILITY)
def test_blockwise_equals_plain(visibility, rate):
    qkv = _qkv()
    kwargs = {**VISIBILITY[visibility], "dropout_rate": rate, "dropout_seed": SEED}
    want = _outputs_and_gradients(plain_attention, qkv, **kwargs)
    for chunk in (5, 16, LENGTH, 64):  # padded, padded, one chunk, longer than the sequence
        got = _outputs_and_gradients(blockwise_attention, qkv, chunk_size=chunk, **kwargs)
        for g, w in zip(got, want, strict=True):
            assert _relative(g, w) < 1e-5, (chunk, [_relative(g, w) for g, w in zip(got, want)])


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_blockwise_equals_plain_compiled(mode):
    kwargs = {**VISIBILITY["causal"], "dropout_rate": 0.2, "dropout_seed": SEED}
    want = _outputs_and_gradients(plain_attention, _qkv(), mode, **kwargs)
    got = _outputs_and_gradients(blockwise_attention, _qkv(), mode, chunk_size=8, **kwargs)
    for g, w in zip(got, want, strict=True):
        assert _relative(g, w) < 1e-5


def test_dropout_drops_what_plain_drops():
    """With values one-hot in their position, the context is the dropped probabilities
    themselves: the same zeros, element for element."""
    length = 24
    query, key, _ = _qkv(length=length)
    value = tf.tile(tf.eye(length)[None, :, None, :], [BATCH, 1, HEADS, 1])
    kwargs = {"dropout_rate": 0.5, "dropout_seed": SEED}
    plain = plain_attention(query, key, value, **kwargs).numpy()
    blockwise = blockwise_attention(query, key, value, chunk_size=7, **kwargs).numpy()
    np.testing.assert_array_equal(blockwise == 0, plain == 0)
    assert 0.4 < np.mean(plain == 0) < 0.6


def test_bfloat16_is_about_as_close_to_float32_as_plain():
    kwargs = {**VISIBILITY["causal"], "dropout_rate": 0.1, "dropout_seed": SEED}
    exact = _outputs_and_gradients(plain_attention, _qkv(), **kwargs)
    plain = _outputs_and_gradients(plain_attention, _qkv(tf.bfloat16), **kwargs)
    blockwise = _outputs_and_gradients(
        blockwise_attention, _qkv(tf.bfloat16), chunk_size=8, **kwargs
    )
    for e, p, b in zip(exact, plain, blockwise, strict=True):
        assert _relative(p, e) < 2e-2
        assert _relative(b, e) < 1.5 * _relative(p, e) + 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_causal_attention_skips_the_chunks_after_the_diagonal(causal, monkeypatch):
    """Each chunk pair's scores are computed once forward and once backward; causal attention
    computes only the n(n+1)/2 pairs on or before the diagonal (eager mode runs each loop step
    in Python, so each is counted)."""
    pairs = []
    scores = attention._Chunks.scores

    def counted(self, query, key, i, j):
        pairs.append((int(i), int(j)))
        return scores(self, query, key, i, j)

    monkeypatch.setattr(attention._Chunks, "scores", counted)
    _outputs_and_gradients(
        blockwise_attention, _qkv(), chunk_size=10, segment_ids=_segments(), causal=causal
    )
    n = 4  # 37 positions in chunks of 10
    expected = {(i, j) for i in range(n) for j in range(n) if j <= i or not causal}
    assert len(pairs) == 2 * len(expected) and set(pairs) == expected


def test_the_gradient_holds_no_score_matrix():
    """XLA:CPU's plan of the gradient at 1024 and 2048 positions: plain attention's temporaries
    are several S x S float32 matrices; blockwise attention's are less than one and grow about
    linearly (chunks of 128)."""

    def gradients_of(fn, **chunk):
        @tf.function(jit_compile=True)
        def gradients(query, key, value, segment_ids):
            with tf.GradientTape() as tape:
                tape.watch([query, key, value])
                context = fn(
                    query,
                    key,
                    value,
                    segment_ids=segment_ids,
                    causal=True,
                    dropout_rate=0.1,
                    dropout_seed=SEED,
                    **chunk,
                )
                loss = tf.reduce_sum(context * context)
            return tape.gradient(loss, [query, key, value])

        return gradients

    temps = {}
    for name, step in (
        ("plain", gradients_of(plain_attention)),
        ("blockwise", gradients_of(blockwise_attention, chunk_size=128)),
    ):
        for length in (1024, 2048):
            spec = tf.TensorSpec([1, length, 4, 32])
            temps[name, length] = memory.compiled_bytes(
                step, spec, spec, spec, tf.TensorSpec([1, length], tf.int32)
            ).temp_bytes
    scores = {length: 4 * length * length * 4 for length in (1024, 2048)}  # heads x S x S f32
    for length, size in scores.items():
        assert temps["plain", length] > 3 * size, temps
        assert temps["blockwise", length] < size / 2, temps
    assert temps["blockwise", 2048] < 2.2 * temps["blockwise", 1024], temps


def test_what_blockwise_attention_refuses():
    query, key, value = _qkv()
    with pytest.raises(ValueError, match="causal attention here needs segment_ids"):
        blockwise_attention(query, key, value, causal=True)
    with pytest.raises(ValueError, match="dropout_rate must be in"):
        blockwise_attention(query, key, value, dropout_rate=1.0, dropout_seed=SEED)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        blockwise_attention(query, key, value, chunk_size=0)
    with pytest.raises(ValueError, match="static sequence length"):
        tf.function(blockwise_attention).get_concrete_function(
            *[tf.TensorSpec([1, None, HEADS, DEPTH])] * 3
        )
    with pytest.raises(ValueError, match="attention must be one of"):
        transformer.MultiHeadAttention(2, attention="flash")
    assert attention.default_chunk(197) == 197
    assert attention.default_chunk(1000) == 500
    assert attention.default_chunk(8192) == 512


TEXT = dict(vocab_size=64, max_length=16, dim=32, depth=2, num_heads=4, mlp_dim=48, dropout=0.1)
IMAGES = dict(image_size=16, patch_size=4, num_classes=5, dim=16, depth=2, num_heads=2, mlp_dim=32)


def _text_rows() -> dict:
    segments = np.array([[1] * 6 + [2] * 7 + [0] * 3, [1] * 16])
    positions = np.array([list(range(6)) + list(range(7)) + [0, 1, 2], list(range(16))])
    return {
        "tokens": tf.constant(np.arange(32).reshape(2, 16) % 60 + 3),
        "segment_ids": tf.constant(segments),
        "positions": tf.constant(positions),
    }


def _pair(kind: str, **config):
    """The same model with plain and with blockwise attention: same weights, same seeds."""
    build, inputs = {
        "decoder": (lambda **c: language.DecoderLM(**TEXT, **c), _text_rows()),
        "bert": (lambda **c: language.BertEncoder(**TEXT, **c), _text_rows()),
        "vit": (
            lambda **c: vit.VisionTransformer(**IMAGES, dropout=0.1, **c),
            tf.random.stateless_normal([2, 16, 16, 3], [1, 2]),
        ),
    }[kind]
    keras.utils.set_random_seed(0)
    plain = build(**config)
    blockwise = build(attention="blockwise", attention_chunk=5, **config)
    transformer.copy_weights(plain, blockwise)
    return plain, blockwise, inputs


def _gradients(model, inputs, mode: str) -> list[np.ndarray]:
    """Gradients of a fixed projection of the outputs with dropout on; every variable (dropout
    seeds too) is put back as it was."""
    start = [v.numpy() for v in model.variables]

    def step(inputs):
        with tf.GradientTape() as tape:
            y = tf.cast(model(inputs, training=True), tf.float32)
            loss = tf.reduce_sum(y * tf.random.stateless_normal(tf.shape(y), [7, 8]))
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]

    grads = [np.asarray(g, np.float64) for g in _compiled(step, mode)(inputs)]
    for variable, value in zip(model.variables, start, strict=True):
        variable.assign(value)
    return grads


def _error(got: list, want: list) -> float:
    diff = sum(np.sum((g - w) ** 2) for g, w in zip(got, want, strict=True))
    return float(np.sqrt(diff / sum(np.sum(w**2) for w in want)))


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize(
    "kind",
    [
        "decoder",
        pytest.param("bert", marks=pytest.mark.slow),
        pytest.param("vit", marks=pytest.mark.slow),
    ],
)
def test_models_with_blockwise_attention_match_plain(kind, mode):
    plain, blockwise, inputs = _pair(kind)
    assert _error(_gradients(blockwise, inputs, mode), _gradients(plain, inputs, mode)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [
        "nothing_saveable",
        "dots_saveable",
        "dots_with_no_batch_dims_saveable",
        "random_masks_saveable",
        "dots_saveable+random_masks_saveable",
        "save_qkv_attn",
        "budget:0.3",
    ],
)
def test_every_remat_policy_recomputes_blockwise_blocks_exactly(policy):
    """Under remat each block runs twice (forward, recomputation) and the gradients stay those
    of plain attention without remat (XLA, dropout on)."""
    plain, blockwise, inputs = _pair("decoder")
    want = _gradients(plain, inputs, "xla")
    if policy == "save_qkv_attn":
        policy = remat.policies.save_only_these_names("qkv_proj", "attn_out")
    remat.set_grad_checkpointing(blockwise, policy=policy)
    runs = []
    for block in blockwise.blocks:
        region = block.call
        region.fn = lambda *a, _fn=region.fn, _name=block.name, **k: (
            runs.append(_name) or _fn(*a, **k)
        )
    got = _gradients(blockwise, inputs, "xla")
    assert sorted(runs) == ["block_0", "block_0", "block_1", "block_1"], runs
    assert _error(got, want) < 1e-5


@pytest.mark.parametrize("policy", [pytest.param(None, marks=pytest.mark.slow), "nothing_saveable"])
def test_scanned_blocks_with_blockwise_attention_match_unrolled_plain(policy):
    keras.utils.set_random_seed(0)
    unrolled = language.DecoderLM(**TEXT)
    scanned = language.DecoderLM(**TEXT, scan_layers=True, attention="blockwise", attention_chunk=5)
    transformer.copy_weights(unrolled, scanned)
    if policy is not None:
        remat.set_grad_checkpointing(scanned, policy=policy)
    inputs = _text_rows()
    got = unstacked(scanned, _gradients(scanned, inputs, "xla"))
    want = split_unrolled(unrolled, _gradients(unrolled, inputs, "xla"))
    for g, w in zip(got, want, strict=True):
        assert _error(g, w) < 1e-5


@pytest.mark.slow
def test_mixed_bfloat16_models_stay_as_close_as_plain():
    """Under mixed_bfloat16 both paths round: blockwise's gradients are about as close to the
    float32 model's as plain's are."""
    keras.utils.set_random_seed(0)
    exact = language.DecoderLM(**TEXT)
    inputs = _text_rows()
    want = _gradients(exact, inputs, "xla")
    errors = {}
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        for kind, chunked in (
            ("plain", {}),
            ("blockwise", {"attention": "blockwise", "attention_chunk": 5}),
        ):
            model = language.DecoderLM(**TEXT, **chunked)
            transformer.copy_weights(exact, model)
            errors[kind] = _error(_gradients(model, inputs, "xla"), want)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert errors["plain"] < 3e-2, errors
    assert errors["blockwise"] < 1.5 * errors["plain"] + 1e-3, errors


MIRRORED_SCRIPT = """
    import functools, json, tempfile
    import numpy as np
    from framework.runtime import Runtime, distribute
    from framework.trainer import Trainer
    from tests import tiny

    distribute.split_cpu(2)  # before TensorFlow initialises its devices
    results = {}
    for attention in ("plain", "blockwise"):
        work_dir = tempfile.mkdtemp()
        task = tiny.decoder_with_dropout(work_dir)
        if attention == "blockwise":  # and the loss in chunks
            task["model_fn"] = functools.partial(
                task["model_fn"], attention=attention, attention_chunk=5, loss_chunk=6
            )
        trainer = Trainer(
            work_dir, runtime=Runtime("mirrored", cpu_devices=2), train_steps=4,
            remat_policy="nothing_saveable", **task,
            **{**tiny.TRAINING, "global_batch_size": 8},
        )
        metrics = trainer.train()
        results[attention] = {
            "loss": float(metrics["loss"]),
            "replicas": trainer.strategy.num_replicas_in_sync,
            "weights": [np.asarray(v).tolist() for v in trainer.model.trainable_variables],
        }
    print(json.dumps(results))
"""


@pytest.mark.slow
def test_training_under_mirrored_matches_plain_attention():
    """Two replicas, dropout 0.1, full remat, four steps of AdamW (each moves a weight by about
    a third of its initial size): the run with blockwise attention and the chunked loss ends on
    the plain run's weights, 1e-5 relative (float32 sums in another order, through 4 updates)."""
    from tests.subprocesses import run_python

    runs = run_python(MIRRORED_SCRIPT, timeout=600)
    plain, blockwise = runs["plain"], runs["blockwise"]
    assert plain["replicas"] == blockwise["replicas"] == 2
    assert abs(blockwise["loss"] - plain["loss"]) <= 1e-5 * plain["loss"]
    got = [np.asarray(w) for w in blockwise["weights"]]
    want = [np.asarray(w) for w in plain["weights"]]
    assert _error(got, want) < 1e-5


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_keras_hub_models_attend_blockwise_in_one_line(name, monkeypatch):
    """keras-hub's GPT-2 (causal, padded), BERT and ViT: the same gradients with their attention
    computed blockwise, and the blockwise path really ran (its calls counted)."""
    from tests.remat.test_user_models import _hub, _run

    calls = []
    blockwise = attention.blockwise_attention
    monkeypatch.setattr(
        attention, "blockwise_attention", lambda *a, **k: calls.append(k) or blockwise(*a, **k)
    )
    model, inputs = _hub(name, dropout=0.0)
    if name != "vit":  # the second row ends in padding
        inputs["padding_mask"] = tf.constant([[1] * 8, [1] * 5 + [0] * 3], tf.int32)
    want, _ = _run(model, inputs, "xla")
    assert not calls
    layers = attention.use_blockwise_attention(model, chunk_size=5)
    assert len(layers) == 2
    got, _ = _run(model, inputs, "xla")
    assert len(calls) == 2 and all((c["mask"] is None) == (name == "vit") for c in calls), calls
    pairs = [(g, w) for g, w in zip(got, want, strict=True) if w is not None]  # BERT's pooler
    assert _error(*zip(*[(np.float64(g), np.float64(w)) for g, w in pairs])) < 1e-5
    with pytest.raises(ValueError, match="holds no keras.layers.MultiHeadAttention"):
        attention.use_blockwise_attention(keras.Sequential([keras.layers.Dense(2)]))


def test_attention_layers_that_compute_their_own_attention_are_refused():
    """keras-hub's XLNet attention derives from MultiHeadAttention but never runs its attention
    computation: replacing it changed nothing, silently."""
    xlnet = keras_hub.models.XLNetBackbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32
    )
    with pytest.raises(ValueError, match="TwoStreamRelativeAttention in .* compute their"):
        attention.use_blockwise_attention(xlnet)


@pytest.mark.slow
def test_keras_hub_blockwise_attention_with_dropout_under_remat():
    """keras-hub's GPT-2 with dropout 0.2 and blockwise attention: remat recomputes each block
    and the gradients equal those without remat (the hashed masks are drawn again alike)."""
    from tests.remat.test_user_models import _check, _hub

    model, inputs = _hub("gpt2")
    model(inputs)
    attention.use_blockwise_attention(model)
    _check(model, inputs, "xla")


def test_a_batch_known_only_when_the_step_runs():
    """A serving signature's batch is None: blockwise attention then takes it from the tensors
    (dropout too), and gives plain attention's result."""
    kwargs = {**VISIBILITY["causal"], "dropout_rate": 0.2, "dropout_seed": SEED}
    spec = tf.TensorSpec([None, LENGTH, HEADS, DEPTH])
    plain = tf.function(lambda q, k, v: plain_attention(q, k, v, **kwargs))
    blockwise = tf.function(lambda q, k, v: blockwise_attention(q, k, v, chunk_size=8, **kwargs))
    got = blockwise.get_concrete_function(spec, spec, spec)(*_qkv())
    want = plain.get_concrete_function(spec, spec, spec)(*_qkv())
    assert _relative(got.numpy(), want.numpy()) < 1e-5


def test_a_checkpoint_of_plain_attention_restores_into_blockwise(tmp_path):
    keras.utils.set_random_seed(0)
    plain = language.DecoderLM(**TEXT)
    path = tf.train.Checkpoint(model=plain).save(str(tmp_path / "ckpt"))
    blockwise = language.DecoderLM(**TEXT, attention="blockwise", loss_chunk=4)
    tf.train.Checkpoint(model=blockwise).restore(path).assert_consumed()
    rows = _text_rows()
    assert _relative(blockwise(rows).numpy(), plain(rows).numpy()) < 1e-5


@pytest.mark.parametrize("jit_compile", [False, True])
def test_model_fit_of_a_keras_hub_classifier_attending_blockwise(jit_compile, monkeypatch):
    """`model.fit` of keras-hub's ViT under a classification head: the same losses per epoch
    with the one-liner as without it, and its blockwise path traced."""
    from tests.remat.test_user_models import _hub

    calls = []
    blockwise = attention.blockwise_attention
    monkeypatch.setattr(
        attention, "blockwise_attention", lambda *a, **k: calls.append(1) or blockwise(*a, **k)
    )
    images = tf.random.stateless_normal((8, 32, 32, 3), [5, 6])
    labels = tf.constant([0, 1, 2, 3] * 2)

    def history(use_blockwise: bool) -> list[float]:
        backbone, _ = _hub("vit", dropout=0.0)
        if use_blockwise:
            attention.use_blockwise_attention(backbone, chunk_size=5)
        model = keras.Sequential(
            [backbone, keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        return model.fit(images, labels, batch_size=4, epochs=2, verbose=0).history["loss"]

    want = history(False)
    assert not calls
    got = history(True)
    assert calls
    np.testing.assert_allclose(got, want, rtol=1e-5)
