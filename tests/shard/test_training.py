"""Sharded training state on one device: the same program as on N replicas, with N = 1.

Each level trains the tiny ViT (dropout on, remat, micro-batches) to the unsharded run's
weights and random state; its checkpoints are an unsharded run's (keys, shapes, values) and
restore both ways; a warm start, an evaluation and the determinism check see the shards; what
cannot be sharded is one clear error. Several replicas, several workers, other replica counts:
`test_replicas.py` (subprocesses, the slow tier).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework.core import tf_internals
from framework.trainer import Trainer, determinism, optim
from tests import tiny

LEVELS = ("optimizer", "gradients", "weights")
ARGS = {
    **tiny.TRAINER_ARGS,
    **tiny.vit_with_dropout(),
    "train_steps": 4,
    "steps_per_loop": 2,
}
# The equality tests run the whole step: remat recomputes the blocks (gathering their weights
# again), micro-batches sum their gradients.
FULL_STEP = {"remat_policy": "nothing_saveable", "microbatches": 2}


def run(model_dir=None, **overrides) -> Trainer:
    return Trainer(None if model_dir is None else str(model_dir), **{**ARGS, **overrides})


def state(trainer: Trainer) -> list[np.ndarray]:
    """The model's and the optimizer's variables, sharded ones whole (as checkpoints hold them)."""
    whole = trainer.sharded.checkpoint_replacements() if trainer.sharded else {}
    variables = trainer.model.variables + trainer.optimizer.variables
    return [np.asarray(whole[id(v)].read() if id(v) in whole else v.numpy()) for v in variables]


def largest_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def unsharded():
    """The unsharded run, without clipping (clipped: see the test that clips)."""
    trainer = run(clip_norm=None, **FULL_STEP)
    trainer.train()
    return state(trainer)


# The gradients level (17 s more) runs with the slow tests; the fast tier trains the other two.
@pytest.mark.tf_compat
@pytest.mark.parametrize(
    "level", [pytest.param(x, marks=pytest.mark.slow) if x == "gradients" else x for x in LEVELS]
)
def test_each_level_trains_to_the_unsharded_runs_state_bit_for_bit(level, unsharded):
    trainer = run(clip_norm=None, shard_state=level, **FULL_STEP)
    trainer.train()
    # Bit for bit: the same gradients, summed by the same all-reduce, and an elementwise update
    # of the same elements; the dropout seeds advanced alike.
    assert largest_difference(state(trainer), unsharded) == 0.0
    # The model's own weights are current after training, at every level.
    for variable, value in zip(trainer.model.variables, unsharded):
        np.testing.assert_array_equal(variable.numpy(), value)


@pytest.mark.slow
def test_clipping_by_the_norm_over_the_parts_equals_clipping_by_the_whole_norm():
    clipped = {}
    for level in ("none", "weights"):
        trainer = run(clip_norm=0.05, shard_state=level)
        clipped[level] = (trainer.train()["grad_norm"], state(trainer))
    (norm, whole), (sharded_norm, parts) = clipped["none"], clipped["weights"]
    # The norm is summed in another order (per part, then over replicas): equal to float32's
    # last bits, and so are the clipped steps.
    assert sharded_norm == pytest.approx(norm, rel=1e-6)
    assert largest_difference(parts, whole) < 1e-5


def keys_and_shapes(model_dir) -> dict:
    prefix = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    return tf.train.load_checkpoint(prefix).get_variable_to_shape_map()


@pytest.mark.slow
def test_checkpoints_are_an_unsharded_runs_and_restore_both_ways(tmp_path):
    sharded = run(tmp_path / "sharded", shard_state="weights")
    sharded.train()
    plain = run(tmp_path / "plain")
    plain.train()
    assert keys_and_shapes(tmp_path / "sharded") == keys_and_shapes(tmp_path / "plain")

    into_plain = run(tmp_path / "sharded")  # the sharded run's checkpoint, unsharded
    assert into_plain.step == 4
    assert largest_difference(state(into_plain), state(sharded)) == 0.0
    into_sharded = run(tmp_path / "plain", shard_state="optimizer")
    assert into_sharded.step == 4
    assert largest_difference(state(into_sharded), state(plain)) == 0.0
    # The restored shards are what the model computes with.
    np.testing.assert_allclose(into_sharded.evaluate()["loss"], plain.evaluate()["loss"], rtol=1e-6)


def test_a_warm_start_reaches_the_shards(tmp_path):
    source = run(tmp_path / "source")
    source.train()
    warm = run(shard_state="weights", init_checkpoint=str(tmp_path / "source"))
    weights = [v.numpy() for v in source.model.trainable_variables]
    shards = [w.numpy() for w in warm.sharded.weights.whole_values()]
    assert largest_difference(shards, weights) == 0.0


def test_evaluation_computes_with_the_shards():
    trainer = run(shard_state="weights")
    trainer.train()
    loss = trainer.evaluate()["loss"]
    for variable in trainer.model.trainable_variables:  # what the host copy holds is not read
        variable.assign(tf.zeros_like(variable))
    assert trainer.evaluate()["loss"] == loss


@pytest.mark.slow
def test_the_determinism_check_compares_whole_values():
    assert determinism.first_difference(lambda: run(shard_state="weights"), 2) is None


def test_an_optimizer_that_reads_whole_weights_cannot_be_sharded():
    with pytest.raises(ValueError, match="Adafactor's update reads whole weights"):
        run(shard_state="optimizer", optimizer_fn=optim.adafactor)


def test_an_optimizer_keeping_averages_cannot_be_sharded():
    def averaging(schedule, weight_decay):
        return keras.optimizers.AdamW(schedule, use_ema=True, ema_overwrite_frequency=1)

    with pytest.raises(ValueError, match="use_ema=True, which sharded state does not hold"):
        run(shard_state="optimizer", optimizer_fn=averaging)


@pytest.mark.slow
def test_a_weight_regularizer_reaches_the_shards(unsharded):
    """The regularizer reads the weight the model computes with: gathered from the shards."""

    def model():
        keras.utils.set_random_seed(0)
        model = tiny.vit_with_dropout()["model_fn"]()
        model(tf.zeros([1, 8, 8, 3]))
        model.trainable_variables[-2].regularizer = keras.regularizers.L2(0.5)
        return model

    states = []
    for level in ("none", "weights"):
        trainer = run(clip_norm=None, shard_state=level, model_fn=model, **FULL_STEP)
        trainer.train()
        states.append(state(trainer))
    assert largest_difference(states[0], unsharded) > 1e-3  # the regularizer acts
    assert largest_difference(states[1], states[0]) < 1e-6


def test_weights_with_a_constraint_cannot_be_sharded():
    """The constraint would be applied to each part apart (it was dropped, silently)."""

    def model():
        keras.utils.set_random_seed(0)
        model = tiny.vit_with_dropout()["model_fn"]()
        model(tf.zeros([1, 8, 8, 3]))
        model.trainable_variables[-2].constraint = keras.constraints.NonNeg()
        return model

    with pytest.raises(ValueError, match="with a constraint .* cannot be sharded"):
        run(shard_state="optimizer", model_fn=model)


@pytest.mark.slow
def test_a_dense_layer_on_a_sequence_of_unknown_batch_trains_sharded():
    """A Dense kernel's gradient from a [batch, ..., dim] input of unknown batch (data batched
    without drop_remainder; every keras-hub transformer) had an unknown first dimension, and
    splitting it into shards was a TypeError."""

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input([8, 8, 3])
        hidden = keras.layers.GlobalAveragePooling2D()(keras.layers.Dense(16)(inputs))
        return keras.Model(inputs, keras.layers.Dense(4)(hidden))

    def unknown_batch(split, input_context=None, **kwargs):
        def loosen(*batch):
            keep = tf.ones(tf.shape(batch[0])[:1], tf.bool)
            return tuple(tf.boolean_mask(x, keep) for x in batch)

        return tiny.dataset_fn(split, input_context, **kwargs).map(loosen)

    assert unknown_batch("train", global_batch_size=4).element_spec[0].shape[0] is None
    states = []
    for level in ("none", "optimizer", "weights"):
        trainer = run(shard_state=level, model_fn=model, dataset_fn=unknown_batch)
        trainer.train()
        states.append(state(trainer))
    assert largest_difference(states[1], states[0]) < 1e-6
    assert largest_difference(states[2], states[0]) < 1e-6


def test_an_unknown_level_lists_the_levels():
    with pytest.raises(ValueError, match="'none', 'optimizer', 'gradients', 'weights'"):
        run(shard_state="zero3")


def test_a_layer_that_assigns_its_weights_in_its_call_cannot_have_them_sharded():
    class Counting(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

        def call(self, x):
            self.w.assign(self.w + 1.0)
            return x * self.w

    layer = Counting()
    layer.build((2,))
    gathered = tf.constant([3.0, 4.0])
    with tf_internals.keras_reads_redirected(lambda v: gathered if v is layer.w else None):
        with pytest.raises(ValueError, match="cannot be assigned"):
            layer(tf.ones([1, 2]))
