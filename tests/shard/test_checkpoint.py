"""A checkpoint view saves an object graph with stand-ins for some of its variables, under the
same keys as the objects themselves; restoring it writes through the stand-ins."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework.shard import WholeValue, checkpoint_view


def small_model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def keys(prefix: str) -> dict:
    return tf.train.load_checkpoint(prefix).get_variable_to_shape_map()


def test_a_view_with_stand_ins_saves_the_keys_and_restores_through_them(tmp_path):
    model, optimizer = small_model()
    plain = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "plain"))
    kernel = model.layers[0].kernel
    written = []
    stand_in = WholeValue(read=lambda: tf.fill(kernel.shape, 7.0), write=written.append)
    replaced = {id(kernel): stand_in}
    view = tf.train.Checkpoint(
        model=checkpoint_view(model, replaced), optimizer=checkpoint_view(optimizer, replaced)
    )
    saved = view.save(str(tmp_path / "view"))
    assert keys(saved) == keys(plain)
    # Saved once (the kernel and its momentum are the [3, 2] values), from the stand-in.
    reader = tf.train.load_checkpoint(saved)
    values = [reader.get_tensor(k) for k, shape in keys(saved).items() if shape == [3, 2]]
    assert sorted(float(v.max()) for v in values) == [0.0, 7.0]
    # The optimizer refers to the same kernel: one object in the view as in the model, saved once.
    view.restore(plain).assert_existing_objects_matched()
    assert len(written) == 1
    np.testing.assert_array_equal(written[0], kernel.numpy())


def test_nothing_replaced_is_the_object_itself():
    model, _ = small_model()
    assert checkpoint_view(model, {}) is model


def test_a_stand_in_for_an_object_that_saves_values_and_has_children_is_refused():
    class Odd(tf.__internal__.tracking.Trackable):
        def _serialize_to_tensors(self):
            return {}

        def _trackable_children(self, save_type="checkpoint", **kwargs):
            return {"child": tf.Variable(1.0)}

    root = tf.train.Checkpoint(odd=Odd())
    with pytest.raises(TypeError, match="saves values and has children"):
        tf.train.Checkpoint(x=checkpoint_view(root, {-1: None})).save("ram://view/ckpt")
