"""framework.trainer.train_step, losses and optimizers: micro-batches, label smoothing, gin
choices."""

from __future__ import annotations

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import remat
from framework.core import tf_internals
from framework.core.errors import TrainerError
from framework.models import transformer, vit
from framework.trainer import Trainer, losses, optim, settings, train_step
from tests import tiny


def _model_and_batch(batch_size: int = 8, weighted: bool = True):
    keras.utils.set_random_seed(1)
    model = vit.VisionTransformer(**tiny.MODEL)
    rng = np.random.default_rng()  # fresh inputs every run
    images = tf.constant(rng.normal(size=(batch_size, 8, 8, 3)), tf.float32)
    labels = tf.constant(rng.integers(0, 4, size=batch_size), tf.int32)
    weights = tf.constant(rng.integers(0, 2, size=batch_size), tf.float32)
    model(images)
    return model, ((images, labels, weights) if weighted else (images, labels))


@pytest.mark.parametrize("policy", [None, "nothing_saveable"])
def test_microbatched_gradients_equal_the_whole_batch(policy, monkeypatch):
    model, batch = _model_and_batch()
    whole_sums, whole = train_step.compiled_gradients(model)(batch)
    calls = []
    block_call = transformer.TransformerBlock.call
    monkeypatch.setattr(
        transformer.TransformerBlock,
        "call",
        lambda self, *a, **k: calls.append(1) or block_call(self, *a, **k),
    )
    if policy:
        remat.set_grad_checkpointing(model, policy=policy)
    parts_sums, parts = train_step.compiled_gradients(model, microbatches=4)(batch)
    for a, b in zip(whole_sums, parts_sums, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5)
    # Summed in another order (4 parts): float32 rounding, relative to each gradient's scale
    # (an element near zero can differ by more than 1e-4 of itself).
    for a, b in zip(whole, parts, strict=True):
        scale = float(np.abs(a.numpy()).max())
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5 * scale)
    # One trace of the loop body (not 4 unrolled copies); with remat each block runs again in
    # the backward pass.
    assert len(calls) == tiny.MODEL["depth"] * (2 if policy else 1)


def test_a_batch_that_does_not_split_into_microbatches_is_a_clear_error():
    model, batch = _model_and_batch(batch_size=6)
    with pytest.raises(ValueError, match="6 examples does not split into Trainer.microbatches = 4"):
        train_step.gradients(model, batch, microbatches=4)


@pytest.mark.slow
def test_microbatched_training_equals_whole_batch_training():
    runs = {
        m: Trainer(None, **{**tiny.TRAINER_ARGS, "train_steps": 2}, microbatches=m) for m in (1, 4)
    }
    for run in runs.values():
        run.train()
    for a, b in zip(*(r.model.trainable_variables for r in runs.values()), strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothing_equals_the_one_hot_definition(smoothing):
    rng = np.random.default_rng()
    logits = rng.normal(size=(5, 7, 11)).astype(np.float32)
    labels = rng.integers(0, 11, size=(5, 7))
    expected = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=smoothing, reduction=None
    )(tf.one_hot(labels, 11), logits)
    got = losses.cross_entropy(logits, labels, label_smoothing=smoothing)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_soft_labels_are_cross_entropy_against_class_probabilities(smoothing):
    """Mixed labels (mixup, cutmix): the loss of l * a + (1 - l) * b is l CE(a) + (1 - l) CE(b)."""
    rng = np.random.default_rng()
    logits = rng.normal(size=(6, 5)).astype(np.float32)
    first, second = rng.integers(0, 5, size=6), rng.integers(0, 5, size=6)
    mix = rng.uniform(size=(6, 1)).astype(np.float32)
    soft = mix * tf.one_hot(first, 5) + (1 - mix) * tf.one_hot(second, 5)
    expected = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=smoothing, reduction=None
    )(soft, logits)
    got = losses.cross_entropy(logits, soft, label_smoothing=smoothing)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    parts = [
        losses.cross_entropy(logits, labels, label_smoothing=smoothing)
        for labels in (first, second)
    ]
    np.testing.assert_allclose(got, mix[:, 0] * parts[0] + (1 - mix[:, 0]) * parts[1], rtol=1e-5)


def test_one_hot_labels_give_the_gradients_and_accuracy_of_integer_labels():
    model, (images, labels, weights) = _model_and_batch()
    sums, grads = train_step.gradients(model, (images, labels, weights))
    soft_sums, soft_grads = train_step.gradients(model, (images, tf.one_hot(labels, 4), weights))
    np.testing.assert_allclose(np.array(soft_sums), np.array(sums), rtol=1e-6)
    for a, b in zip(grads, soft_grads, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-7)
    unweighted = train_step.batch_sums(model, (images, tf.one_hot(labels, 4)))
    assert unweighted[2].numpy() == 8  # one weight per image, not per class


def test_bad_label_smoothing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1.0"):
        losses.cross_entropy(tf.zeros([2, 3]), tf.zeros([2], tf.int32), label_smoothing=1.0)


@pytest.mark.parametrize(
    "labels, message",
    [
        # Float class ids when the batch equals the classes (4): read as probabilities before.
        (tf.constant([0.0, 1.0, 2.0, 3.0]), "class ids in floating point; cast them to int32"),
        (tf.zeros([4, 1], tf.int32), "drop the labels' last axis of size 1"),
        (tf.one_hot([0, 1, 2, 3], 4, dtype=tf.int32), "integer class ids with one axis fewer"),
        (tf.zeros([4, 5]), "probabilities over 5 classes, the logits over 4"),
    ],
)
def test_labels_that_do_not_fit_the_logits_are_one_clear_error(labels, message):
    with pytest.raises(TrainerError, match=message):
        losses.cross_entropy(tf.zeros([4, 4]), labels)


def test_a_model_with_several_outputs_is_one_clear_error():
    inputs = keras.Input([3])
    model = keras.Model(inputs, [keras.layers.Dense(4)(inputs), keras.layers.Dense(2)(inputs)])
    batch = (tf.zeros([2, 3]), tf.zeros([2], tf.int32))
    with pytest.raises(TrainerError, match="needs one tensor of logits"):
        train_step.batch_sums(model, batch)


def scaled_loss(logits, labels, *, factor=1.0):
    """A custom loss of the user's: cross-entropy times a gin-bound factor."""
    return factor * losses.cross_entropy(logits, labels)


@pytest.fixture
def gin_config():
    gin.clear_config()
    yield
    gin.clear_config()


def _gin_trainer(*bindings: str) -> Trainer:
    gin.parse_config(
        [
            "Trainer.model_fn = @models.VisionTransformer",
            "Trainer.dataset_fn = @data.shapes",
            *(f"models.VisionTransformer.{k} = {v!r}" for k, v in tiny.MODEL.items()),
            *(f"data.shapes.{k} = {v!r}" for k, v in tiny.DATA.items()),
            *(f"Trainer.{k} = {v!r}" for k, v in tiny.TRAINING.items()),
            *bindings,
        ]
    )
    return Trainer(None, train_steps=2)


def test_custom_loss_and_optimizer_by_gin_only(gin_config):
    gin.external_configurable(scaled_loss, module="test")
    trainer = _gin_trainer(
        "Trainer.optimizer_fn = @optim.sgd",
        "optim.sgd.momentum = 0.8",
        "Trainer.loss_fn = @test.scaled_loss",
        "test.scaled_loss.factor = 0.0",
        "Trainer.weight_decay = 0.0",
    )
    assert isinstance(trainer.optimizer, optim.ReducedGradientSGD)
    assert trainer.optimizer.momentum == pytest.approx(0.8)
    before = [v.numpy() for v in trainer.model.trainable_variables]
    metrics = trainer.train()
    assert metrics["loss"] == 0.0  # the bound factor reached the loss
    assert metrics["grad_norm"] == 0.0
    for a, b in zip(before, trainer.model.trainable_variables, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


def test_default_optimizer_and_loss_take_their_gin_bindings(gin_config):
    trainer = _gin_trainer(
        "optim.adamw.beta_2 = 0.98", "losses.cross_entropy.label_smoothing = 0.2"
    )
    assert trainer.optimizer.beta_2 == pytest.approx(0.98)
    assert trainer.settings.loss_fn is settings.cross_entropy
    assert trainer.train()["loss"] > 0


def capped_loss(logits, labels):
    """A user's loss written with Python control flow on a tensor, as a `tf.function` allows."""
    per_label = losses.cross_entropy(logits, labels)
    if tf.reduce_max(per_label) > 1e6:
        per_label = tf.minimum(per_label, 1e6)
    return per_label


def test_a_users_loss_with_an_if_on_a_tensor_trains_and_evaluates():
    """The step's own code is traced without AutoGraph (the model is called from unconverted
    code: ENABLED there before); a user's loss is still converted (its `if` becomes a `tf.cond`)
    in the train and the eval step. Unconverted, the first trace raises
    OperatorNotAllowedInGraphError."""
    statuses = []

    class AutoGraphStatus(keras.layers.Layer):
        """Records whether AutoGraph converts the code that calls the model (the step's)."""

        def call(self, x):
            statuses.append(tf.__internal__.autograph.control_status_ctx().status.name)
            return x

    def model_fn():
        return keras.Sequential([AutoGraphStatus(), tiny.model_fn()])

    args = {**tiny.TRAINER_ARGS, "model_fn": model_fn, "train_steps": 1, "loss_fn": capped_loss}
    trainer = Trainer(None, **args)
    losses_seen = [trainer.train()["loss"], trainer.evaluate()["loss"]]
    assert all(np.isfinite(loss) and loss > 0 for loss in losses_seen), losses_seen
    # The train and the eval step traced (after the build's eager call), neither converted.
    assert len(statuses) >= 3 and "ENABLED" not in statuses, statuses


@pytest.mark.slow
def test_adafactor_trains():
    trainer = Trainer(None, **{**tiny.TRAINER_ARGS, "train_steps": 3}, optimizer_fn=optim.adafactor)
    before = [v.numpy() for v in trainer.model.trainable_variables]
    assert np.isfinite(trainer.train()["loss"])
    assert any(
        not np.array_equal(a, b.numpy())
        for a, b in zip(before, trainer.model.trainable_variables, strict=True)
    )


@pytest.mark.slow
def test_a_trainer_without_model_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(None, **{**tiny.TRAINER_ARGS, "train_steps": 5, "eval_every": 5})
    trainer.train()
    trainer.evaluate()
    assert trainer.step == 5 and trainer.run_state is None
    assert trainer.save() is None
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("make", [keras.optimizers.Lion, keras.optimizers.RMSprop])
def test_a_keras_optimizer_takes_the_gradients_the_trainer_summed_as_they_are(make):
    """An `optimizer_fn` may return one of Keras' own optimizers. Under a strategy Keras sums
    its gradients over the replicas, which the trainer has done already: on N replicas the
    update was N times too large, sharded it added up different replicas' parts."""
    trainer = Trainer(None, **{**tiny.TRAINER_ARGS, "optimizer_fn": lambda rate, _: make(rate)})
    assert isinstance(trainer.optimizer, make)
    assert isinstance(trainer.optimizer, tf_internals.GradientsAlreadyReduced)
    # Two replicas, against the trainer's own optimizer: tests/shard/test_replicas.py.


@pytest.mark.parametrize(
    "make, message",
    [
        # Updates divided by the loss scale (2**15 times too small): the step scales no loss.
        (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "2\\*\\*15"),
        # Under a strategy Keras' accumulation fails; on one device a step was two batches.
        (lambda: keras.optimizers.SGD(gradient_accumulation_steps=2), "Trainer.microbatches"),
        # The averaged weights were never swapped in: evaluation and exports held the raw ones.
        (lambda: keras.optimizers.SGD(use_ema=True), "no ema_overwrite_frequency"),
    ],
)
def test_keras_optimizer_settings_the_step_would_undo_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        optim.for_reduced_gradients(make())
    optim.for_reduced_gradients(keras.optimizers.SGD(use_ema=True, ema_overwrite_frequency=1))


def _plain_mlp() -> keras.Model:
    """No blocks and no place to cut its graph: nothing for remat to checkpoint."""
    inputs = keras.Input([8, 8, 3])
    return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Flatten()(inputs)))


def _bfloat16_mlp() -> keras.Model:
    inputs = keras.Input([8, 8, 3])
    hidden = keras.layers.Dense(4, dtype="bfloat16")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, hidden)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # Only a warning before, and a run that trained without remat.
        ({"model_fn": _plain_mlp, "remat_policy": "dots_saveable"}, "found nothing to check"),
        # A traceback in the step's clipping (one device) or all-reduce (several).
        ({"model_fn": _bfloat16_mlp}, "the model has bfloat16 weights"),
    ],
)
def test_models_the_trainer_cannot_train_as_asked_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        Trainer(None, **{**tiny.TRAINER_ARGS, **overrides})


def test_remat_policy_none_asks_for_nothing_to_checkpoint():
    Trainer(None, **{**tiny.TRAINER_ARGS, "model_fn": _plain_mlp, "remat_policy": "none"})


def test_a_global_dtype_policy_of_the_users_is_not_silently_replaced():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="global dtype policy is 'mixed_float16'"):
            Trainer(None, **tiny.TRAINER_ARGS)
    finally:
        keras.config.set_dtype_policy("float32")


def test_the_losses_a_model_adds_count_as_in_keras_fit():
    """Weight and activity regularizers (and `add_loss`) add to the mean loss; they were left
    out of the trainer's step."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, "tanh", kernel_regularizer=keras.regularizers.L2(0.3)),
            keras.layers.Dense(4, activity_regularizer=keras.regularizers.L1(0.1)),
        ]
    )
    rng = np.random.default_rng()
    x = tf.constant(rng.normal(size=(5, 6)), tf.float32)
    labels = tf.constant(rng.integers(0, 4, size=5), tf.int32)
    (loss, _, weight), grads = train_step.compiled_gradients(model)((x, labels))
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        want_loss = tf.reduce_mean(losses.cross_entropy(logits, labels)) + sum(model.losses)
    want = tape.gradient(want_loss, model.trainable_variables)
    assert len(model.losses) == 2
    np.testing.assert_allclose(loss / weight, want_loss, rtol=1e-5)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g / weight, w, rtol=1e-4, atol=1e-6)
