"""Eager calls of Keras layers checkpointed with `nothing_saveable`: nothing is traced, the layer's
code runs once for the forward pass and once for the recomputation, and what a trace would have
found (closures, written variables, stateful random ops, the ops themselves) is read off the ops as
they run. Each case compares with the same layer called plainly, variables and seeds restored.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import remat
from tests.remat.test_semantics import assert_close, rand


class Layer(keras.layers.Layer):
    """Runs `body(self, x)`; counts its calls and whether each ran eagerly (not traced)."""

    def __init__(self, body, **kwargs):
        super().__init__(**kwargs)
        self.body = body
        self.dense = keras.layers.Dense(4)
        self.drop = keras.layers.Dropout(0.4, seed=11)
        self.norm = keras.layers.BatchNormalization()
        self.calls: list[bool] = []

    def call(self, x, training=None):
        self.calls.append(tf.executing_eagerly())
        return self.body(self, x)


def dense_drop_norm(layer, x):
    return layer.norm(layer.drop(tf.sin(layer.dense(x)), training=True), training=True)


def gradients(layer, x, extra=()):
    """d loss / d (x, extra, the layer's trainable variables), eagerly."""
    with tf.GradientTape() as tape:
        tape.watch([x, *extra])
        loss = tf.reduce_sum(layer(x, training=True) ** 2)
    return tape.gradient(loss, [x, *extra, *layer.trainable_variables])


def both(layer, run, policy: str = "nothing_saveable"):
    """`run()` plainly and with `layer` checkpointed with `policy`, from the same variables and
    seeds; returns (plain, remat) results, and the layer's variables after each."""
    start = [v.numpy() for v in layer.variables]
    want = run()
    after_plain = [v.numpy() for v in layer.variables]
    for v, value in zip(layer.variables, start):
        v.assign(value)
    remat.checkpoint(layer, policy)
    layer.calls.clear()
    try:
        got = run()
    finally:
        remat.checkpoint(layer, policy=None)
    for a, b in zip([v.numpy() for v in layer.variables], after_plain):
        np.testing.assert_allclose(a, b, rtol=1e-6)  # seeds and BatchNorm statistics
    assert len(layer.calls) >= 2, layer.calls  # the forward pass and a recomputation, at least
    return want, got


def built(body, closure: tf.Tensor | None = None):
    layer = Layer(body)
    layer.closure = closure
    layer(rand(3, 4))
    return layer


@pytest.mark.tf_compat
def test_untraced_forward_and_recomputation_match_the_plain_gradients():
    layer = built(dense_drop_norm)
    x = rand(3, 4)
    want, got = both(layer, lambda: gradients(layer, x))
    assert_close(got, want)
    assert layer.calls == [True, True]  # the forward pass and the recomputation, both eager


def test_closed_over_tensor_gets_its_gradient():
    c = rand(4)
    layer = built(lambda self, x: dense_drop_norm(self, x) * tf.sin(self.closure), c)
    x = rand(3, 4)
    want, got = both(layer, lambda: gradients(layer, x, [c]))
    assert got[1] is not None
    assert_close(got, want)


def test_unused_results_give_none_to_what_reaches_only_them():
    def two(self, x):
        return self.dense(x), tf.sin(self.closure) * 2.0

    c = rand(4)
    layer = built(two, c)
    x = rand(3, 4)

    def run():
        with tf.GradientTape() as tape:
            tape.watch([x, c])
            first, _ = layer(x, training=True)
            loss = tf.reduce_sum(first**2)
        return tape.gradient(loss, [x, c])

    want, got = both(layer, run)
    assert want[1] is None and got[1] is None
    assert_close(got, want)


@pytest.mark.tf_compat
def test_tf_function_inside_writing_the_layers_own_seed():
    noisy = tf.function(lambda layer, h: layer.drop(h, training=True))
    layer = built(lambda self, x: noisy(self, tf.sin(self.dense(x))) * 2.0)
    x = rand(3, 4)
    want, got = both(layer, lambda: gradients(layer, x))
    assert_close(got, want)
    assert layer.calls == [True, True]


def test_second_order_gradients():
    layer = built(lambda self, x: tf.sin(self.dense(x)) * self.drop(x, training=True))
    x = rand(3, 4)

    def run():
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = tf.reduce_sum(layer(x, training=True) ** 2)
            g = inner.gradient(loss, x)
            norm = tf.reduce_sum(g**2)
        return outer.gradient(norm, [x, *layer.trainable_variables])

    want, got = both(layer, run)
    assert_close(got, want, tol=1e-4)


@pytest.mark.tf_compat
def test_forward_mode_gives_the_plain_jvp():
    layer = built(lambda self, x: tf.sin(self.dense(x)))
    x, v = rand(3, 4), rand(3, 4)

    def run():
        with tf.autodiff.ForwardAccumulator(x, v) as acc:
            y = layer(x, training=True)
        return acc.jvp(y)

    want, got = both(layer, run)
    assert got is not None
    assert_close(got, want)


def test_nested_checkpointed_layer():
    inner = built(dense_drop_norm)
    outer = Layer(lambda self, x: self.inner(tf.tanh(self.dense(x)), training=True) + x)
    outer.inner = inner  # its variables are the outer layer's too
    outer(rand(3, 4))
    x = rand(3, 4)
    remat.checkpoint(inner)
    inner.calls.clear()
    want, got = both(outer, lambda: gradients(outer, x))
    assert_close(got, want)
    assert outer.calls == [True, True]
    # Checkpointed alone (2 calls), then in the outer layer's forward pass, plainly, and in its
    # recomputation, checkpointed (3).
    assert inner.calls == [True] * 5


def test_changing_python_state_is_a_mismatch_error():
    state = []

    def changing(self, x):
        state.append(1)
        return tf.sin(x) if len(state) % 2 else tf.cos(x) * 1.0

    layer = built(changing)
    remat.checkpoint(layer)
    with pytest.raises(remat.RecomputationMismatchError, match="differs from its forward pass"):
        gradients(layer, rand(3, 4))


def test_a_resource_freed_during_one_pass_is_no_mismatch(tmp_path):
    """Python frees a summary writer (an earlier trainer's, collected by the garbage collector)
    whenever its last reference goes, and TensorFlow destroys its resource right then, among the
    ops of the region that happens to be running: here in its forward pass only."""
    garbage = []

    def frees_in_the_forward_pass(self, x):
        h = tf.sin(self.dense(x))
        garbage.clear()  # the writer's last reference
        return self.drop(h, training=True) * 2.0

    layer = built(frees_in_the_forward_pass)
    x = rand(3, 4)

    def run():
        garbage.append(tf.summary.create_file_writer(str(tmp_path)))
        return gradients(layer, x)

    want, got = both(layer, run)
    assert_close(got, want)
    assert layer.calls == [True, True]  # the forward pass and the recomputation, both eager


def test_stateful_random_op_is_an_error():
    layer = built(lambda self, x: x * tf.random.uniform(tf.shape(x)))
    remat.checkpoint(layer)
    with pytest.raises(remat.UnreplayableRandomOpError, match="RandomUniform"):
        gradients(layer, rand(3, 4))


def test_update_of_a_variable_not_the_layers_own_is_an_error():
    generator = tf.random.Generator.from_seed(3)
    layer = built(lambda self, x: x * generator.uniform(x.shape))
    remat.checkpoint(layer)
    with pytest.raises(remat.RematError, match="not the layer's own"):
        gradients(layer, rand(3, 4))


def test_gradient_tape_inside_the_layer_is_loud():
    def inner_gradient(self, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            e = tf.reduce_sum(tf.sin(x) ** 2)
        g = tape.gradient(e, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return g * x

    layer = built(inner_gradient)
    remat.checkpoint(layer)
    with pytest.raises(remat.RecomputationMismatchError, match="gradient tape inside"):
        gradients(layer, rand(3, 4))
    # The same step in a tf.function traces the region and is exact.
    x = rand(3, 4)
    got = tf.function(lambda x: gradients(layer, x))(x)
    remat.checkpoint(layer, policy=None)
    assert_close(got, tf.function(lambda x: gradients(layer, x))(x))


def test_a_tensor_kept_in_a_layer_attribute_is_warned_of():
    """Eagerly, the forward pass runs with the tapes paused: attention scores a layer keeps for a
    plot are values no tape recorded, and a loss computed from them would get no gradient
    through them. The results and their gradients are unaffected."""

    def keeps_scores(self, x):
        self.scores = tf.nn.softmax(self.dense(x))
        self.norm.last = tf.sin(x)  # on a layer inside the checkpointed one
        return dense_drop_norm(self, x) * 2.0

    layer = built(keeps_scores)
    x = rand(3, 4)
    with pytest.warns(remat.TensorStoredAsideWarning) as warned:
        want, got = both(layer, lambda: gradients(layer, x))
    assert_close(got, want)
    said = " ".join(str(w.message) for w in warned)
    for attribute in (f"{layer.name}.scores", f"{layer.norm.name}.last"):
        assert f"{attribute}: the gradient tapes did not record it" in said
    quiet = built(dense_drop_norm)
    quiet.scores = tf.zeros([3, 4])  # a tensor from before the call is none of the call's
    remat.checkpoint(quiet)
    quiet.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat.TensorStoredAsideWarning)
        gradients(quiet, x)
    assert quiet.calls == [True, True]


@pytest.mark.parametrize("used", [0, 1])
def test_results_that_are_inputs_or_repeat(used):
    """A result that is the layer's input, and one tensor returned twice with one copy used."""

    def repeated(self, x):
        y = tf.sin(self.dense(x))
        return x, y, y

    layer = built(repeated)
    x = rand(3, 4)

    def run():
        with tf.GradientTape() as tape:
            tape.watch(x)
            same, first, second = layer(x, training=True)
            loss = tf.reduce_sum((first, second)[used] ** 2) + tf.reduce_sum(same)
        return tape.gradient(loss, [x, *layer.trainable_variables])

    want, got = both(layer, run)
    assert_close(got, want)


def test_mixed_precision_with_a_frozen_sublayer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = built(lambda self, x: tf.cast(dense_drop_norm(self, x), tf.float32))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    layer.dense.trainable = False  # its kernel is read up front, in float32, not autocast
    x = rand(3, 4)
    want, got = both(layer, lambda: gradients(layer, x))
    assert_close(got, want, tol=1e-3)  # float16 activations


def test_unseeded_keras_random_on_the_first_call():
    """Keras' global seed generator, created on the first unseeded draw, is created ahead."""
    layer = built(lambda self, x: x * keras.random.uniform(tf.shape(x)) + self.dense(x))
    x = rand(3, 4)
    remat.checkpoint(layer)
    keras.utils.set_random_seed(5)  # no global seed generator: the call creates it
    got = gradients(layer, x)
    remat.checkpoint(layer, policy=None)
    keras.utils.set_random_seed(5)
    assert_close(got, gradients(layer, x))


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_added_losses_reach_the_gradient(mode, policy):
    """A loss the layer adds and its sublayer's activity regularizer, in every path (untraced,
    traced eagerly, in a tf.function): the step differentiates them as without remat, and the
    layer holds the forward pass's losses alone."""

    def regularized(self, x):
        y = self.drop(self.dense(x), training=True)
        self.add_loss(tf.reduce_sum(tf.sin(y) ** 2))
        return self.norm(y, training=True)

    layer = built(regularized)
    layer.dense.activity_regularizer = keras.regularizers.L2(0.5)
    x = rand(3, 4)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            losses = [tf.identity(loss) for loss in layer.losses]
            total = tf.reduce_sum(y**2) + tf.add_n(losses)
        return tape.gradient(total, [x, *layer.trainable_variables]), losses

    def run():  # traced afresh for each setting
        return (step if mode == "eager" else tf.function(step, jit_compile=mode == "xla"))(x)

    want, got = both(layer, run, policy)
    assert len(got[1]) == len(want[1]) == 2
    assert_close(got, want)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_losses_of_a_layer_passed_in_reach_the_gradient(mode, policy):
    """A shared layer handed to the checkpointed one as an argument, regularized."""

    class Sharing(Layer):
        def call(self, x, shared=None, training=None):
            self.calls.append(tf.executing_eagerly())
            return self.dense(shared(x))

    class Model(keras.Model):  # tracks both: its calls clear their losses
        def __init__(self):
            super().__init__()
            self.shared = keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(1.0))
            self.block = Sharing(body=None)

        def call(self, x, training=None):
            return self.block(x, shared=self.shared, training=training)

    model, x = Model(), rand(3, 4)
    model(x)

    def step(x):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(model(x, training=True)) + tf.add_n(model.losses)
        return tape.gradient(total, model.trainable_variables)

    def run():
        return (step if mode == "eager" else tf.function(step))(x)

    want, got = both(model.block, run, policy)
    assert_close(got, want)


def test_losses_added_in_a_stateless_scope_are_an_error():
    def regularized(self, x):
        y = self.dense(x)
        self.add_loss(tf.reduce_sum(y**2))
        return y

    layer = built(regularized)
    remat.checkpoint(layer, "dots_saveable")
    values = [v.value for v in layer.trainable_variables]
    others = [v.value for v in layer.non_trainable_variables]
    with tf.GradientTape() as tape, pytest.raises(remat.RematError, match="stateless scope"):
        tape.watch(values)
        layer.stateless_call(values, others, rand(3, 4), return_losses=True)


def test_variables_created_in_the_call_are_an_error():
    """A sublayer first called (so built) inside the checkpointed call."""
    layer = built(lambda self, x: x if self.closure is None else self.norm(x, training=True))
    layer.closure = rand(4)
    remat.checkpoint(layer)
    with pytest.raises(remat.RematError, match="created variables"):
        gradients(layer, rand(3, 4))


def test_write_after_a_tf_function_read_of_a_foreign_variable_is_an_error():
    scale = tf.Variable(2.0, trainable=False)
    read = tf.function(lambda x: x * scale)

    def body(self, x):
        y = read(x)
        scale.assign(3.0)  # the recomputation's read would see 3.0
        return y

    layer = built(body)
    scale.assign(2.0)
    remat.checkpoint(layer)
    with pytest.raises(remat.RematError, match="may read it"):
        gradients(layer, rand(3, 4))


def test_fit_run_eagerly_with_training_left_implicit():
    """`set_grad_checkpointing` on a functional model of two such blocks, one `fit` step run
    eagerly; the blocks take `training` from Keras' call context. Same weights as without."""

    def implicit(self, x):
        return x + self.norm(self.drop(tf.sin(self.dense(x))))

    def model_and_data():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((4,))
        first, second = Layer(implicit), Layer(implicit)
        outputs = keras.layers.Dense(1)(second(first(inputs)))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
        return model, (first, second), rand(8, 4, seed=3), rand(8, 1, seed=4)

    weights = []
    for checkpointed in (False, True):
        model, blocks, x, y = model_and_data()
        if checkpointed:
            assert len(remat.set_grad_checkpointing(model)) == 2
        for block in blocks:
            block.calls.clear()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        weights.append([v.numpy() for v in model.variables])
        # Once per step plainly; with remat, once more in the backward pass, both untraced.
        assert all(b.calls == [True] * (2 if checkpointed else 1) for b in blocks), [
            b.calls for b in blocks
        ]
    for got, want in zip(weights[1], weights[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
