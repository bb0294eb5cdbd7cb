"""Remat on anyone's code: the semantic cases of JAX's `RematTest`, TensorFlow's `recompute_grad`
tests and PyTorch's checkpoint tests, written for `remat.checkpoint`.

Every case compares gradients against the same code with the checkpoint replaced by a plain call,
on fresh random inputs, and counts how often the region's Python body runs: once for the forward
pass and once for the recomputation (a checkpoint that silently does nothing runs it once).
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import remat

MODES = ["eager", "graph", "xla"]
POLICIES = ["nothing_saveable", "dots_saveable", "dots_saveable+random_masks_saveable"]


def plain(fn, policy=None):
    """The reference: what `remat.checkpoint` must be equivalent to."""
    return fn


class Counted:
    """Wraps a function and counts its Python calls (traces in graph mode)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def compiled(step, mode):
    if mode == "eager":
        return step
    return tf.function(step, jit_compile=mode == "xla", autograph=False)


def grads(mode, loss, *xs):
    """d loss / d xs in `mode`."""

    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            value = loss(*xs)
        return tape.gradient(value, list(xs))

    return compiled(step, mode)(*xs)


def assert_close(got, want, tol=1e-5):
    got, want = tf.nest.flatten(got), tf.nest.flatten(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None), (got, want)
        if g is not None:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def rand(*shape, seed=None):
    return tf.random.stateless_normal(shape, seed=[seed or np.random.randint(1 << 30), 1])


def check(mode, policy, make_loss, xs, runs=2):
    """`make_loss(wrap)` builds a loss using `wrap(fn, policy)` for its region(s); gradients with
    remat must equal those with `plain`, and the region body must have run `runs` times."""
    counters = []

    def wrap_remat(fn, policy=policy):
        counters.append(Counted(fn))
        return remat.checkpoint(counters[-1], policy)

    want = grads(mode, make_loss(plain), *xs)
    got = grads(mode, make_loss(wrap_remat), *xs)
    assert_close(got, want)
    assert counters and all(c.calls >= runs for c in counters), [c.calls for c in counters]
    return got


def assert_recomputed_and_equal(gradients, tol):
    """`gradients(wrap)` equals `gradients(plain)` with each region wrapped in
    `remat.checkpoint`, and each region's body ran again for the recomputation."""
    want = gradients(plain)
    counted = []

    def wrap_remat(fn):
        counted.append(Counted(fn))
        return remat.checkpoint(counted[-1])

    assert_close(gradients(wrap_remat), want, tol=tol)
    assert counted and all(c.calls >= 2 for c in counted), [c.calls for c in counted]


# 1. Tensors the region closes over are inputs of the region.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_closed_over_tensor_gets_its_gradient(mode, policy):
    def make(wrap):
        def loss(x):
            y = 2.0 * tf.sin(x)
            return tf.reduce_sum(wrap(lambda x: tf.cos(x) * tf.sin(y))(x))

        return loss

    check(mode, policy, make, [rand(3)])


@pytest.mark.parametrize("mode", MODES)
def test_closed_over_tensor_used_at_top_level_and_in_a_branch(mode):
    def make(wrap):
        def loss(x, w):
            def region(x):
                branch = tf.cond(tf.reduce_sum(x) > -1e9, lambda: x @ w, lambda: x)
                return branch + x @ w

            return tf.reduce_sum(wrap(region)(x) ** 2)

        return loss

    check(mode, "dots_saveable", make, [rand(2, 2), rand(2, 2)])

    w = rand(2, 2)  # closed over by the step: an eager tensor in eager mode, captured otherwise

    def step(wrap):
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                y = make(wrap)(x, w)
            return tape.gradient(y, [x, w])

        return compiled(run, mode)

    x = rand(2, 2)
    assert_close(step(remat.checkpoint)(x), step(plain)(x))


@pytest.mark.parametrize("mode", MODES)
def test_zero_argument_region_and_closed_over_matmul(mode):
    def make(wrap):
        def loss(x, w):
            h = tf.tanh(x @ w)
            z = wrap(lambda: tf.sin(h) @ tf.transpose(w), "dots_saveable")()
            return tf.reduce_sum(z * z)

        return loss

    check(mode, None, make, [rand(4, 5), rand(5, 5)])


@pytest.mark.parametrize("mode", MODES)
def test_closed_over_variable_integer_mask_and_ragged_values(mode):
    w = tf.Variable(rand(6, 6, seed=3))
    mask = tf.constant([1, 0, 1, 1, 0, 1])
    ragged = tf.RaggedTensor.from_row_lengths(rand(6, seed=4), [2, 4])

    def make(wrap):
        def loss(x):
            scale = tf.reduce_sum(ragged * 1.0)

            def region(x):
                runs.append(1)
                return tf.cast(mask, tf.float32) * tf.tanh(x @ w) * scale

            return tf.reduce_sum(wrap(region)(x) ** 2)

        return loss

    def step(wrap):
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                value = make(wrap)(x)
            return tape.gradient(value, [x, w])

        return compiled(run, mode)

    x = rand(2, 6)
    runs: list = []
    got = step(remat.checkpoint)(x)
    assert len(runs) == 2
    assert_close(got, step(plain)(x))


# 2. A checkpointed callable stays checkpointed whatever wraps it.


@pytest.mark.tf_compat
@pytest.mark.parametrize("jit", [False, True])
def test_tf_function_around_a_checkpoint_still_recomputes(jit):
    def sin_sin(x):
        """Doc."""
        return tf.sin(tf.sin(x))

    body = Counted(sin_sin)
    body.__doc__ = sin_sin.__doc__
    checkpointed = remat.checkpoint(body)
    assert checkpointed.__doc__ == "Doc." and not hasattr(checkpointed, "__wrapped__")
    region = tf.function(checkpointed, jit_compile=jit)
    x = rand(3)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(region(x))
    g = tape.gradient(y, x)
    assert_close(g, tf.cos(tf.sin(x)) * tf.cos(x))
    assert body.calls == 2


def test_checkpoint_keeps_name_and_signature():
    def block(x, scale=2.0, *, training=False):
        return tf.sin(x) * scale

    body = Counted(block)
    body.__name__, body.__signature__ = block.__name__, inspect.signature(block)
    wrapped = remat.checkpoint(body)
    assert wrapped.__name__ == "block"
    assert list(inspect.signature(wrapped).parameters) == ["x", "scale", "training"]
    x = rand(3)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(wrapped(x, training=True))
    assert_close(tape.gradient(y, x), 2.0 * tf.cos(x))
    assert body.calls == 2


def _tensor_control_flow(x):
    """Python `if` and `for` on tensors: only AutoGraph makes them graph control flow."""
    if tf.reduce_sum(x) > 0:
        x = tf.sin(x)
    else:
        x = tf.cos(x)
    for i in tf.range(tf.shape(x)[0]):
        x = x * tf.cast(i + 1, x.dtype)
    return x


class _TensorControlFlowLayer(keras.layers.Layer):
    def call(self, x):
        return _tensor_control_flow(x)


def _outcome(run):
    try:
        return run()
    except Exception as error:  # noqa: BLE001 (the error class is the outcome compared)
        return type(error)


@pytest.mark.parametrize("mode", MODES)
def test_autograph_converts_a_function_as_a_direct_call_would_and_a_layer_as_keras_does(mode):
    """A `tf.function` (AutoGraph on, its default) converts the functions it calls, so a region
    with Python control flow on tensors works as it does without remat; eager regions are traced
    and converted as `tf.function` converts. Keras 3 never converts a layer's `call`: a
    checkpointed layer fails or works exactly as the plain one."""

    def gradients(wrap, region):
        fn = wrap(region)

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.reduce_sum(fn(x) ** 2)
            return tape.gradient(y, x)

        return step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")

    for sign in (1.0, -1.0):
        x = sign * tf.abs(rand(3)) + 0.1 * sign
        counted = Counted(_tensor_control_flow)
        got = gradients(lambda fn: remat.checkpoint(fn), counted)(x)
        assert_close(got, gradients(plain, _tensor_control_flow)(x))
        assert counted.calls == 2

    x = rand(3)
    want = _outcome(lambda: gradients(plain, _TensorControlFlowLayer())(x))
    got = _outcome(lambda: gradients(remat.checkpoint, _TensorControlFlowLayer())(x))
    if isinstance(want, type):
        assert got is want, (got, want)
    else:
        assert_close(got, want)


# 3. Nesting.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_region_inside_region_and_two_children(mode, policy):
    def make(wrap):
        inner_a = wrap(lambda x: tf.sin(x @ tf.ones([4, 4])))
        inner_b = wrap(lambda x: tf.tanh(x) * tf.cos(x))

        def outer(x):
            return inner_b(inner_a(x)) + inner_a(x * 2.0)

        return lambda x: tf.reduce_sum(wrap(outer)(x) ** 2)

    check(mode, policy, make, [rand(3, 4)])


@pytest.mark.parametrize("mode", MODES)
def test_binomial_checkpointing(mode):
    """JAX's recursive checkpointing of a chain of functions: checkpoints nested log2(n) deep."""

    def make(wrap):
        def chain(fs):
            if len(fs) == 1:
                return fs[0]
            half = len(fs) // 2
            first, second = chain(fs[:half]), chain(fs[half:])
            return wrap(lambda x: second(first(x)))

        return lambda x: tf.reduce_sum(chain([tf.sin] * 8)(x))

    check(mode, "nothing_saveable", make, [rand(5)])


# 4. Control flow inside a region.


def _cond(x):
    return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.sin(x) @ tf.ones([4, 4]), lambda: tf.cos(x))


def _while(x):
    def step(i, y):
        return i + 1, tf.sin(y @ tf.eye(4))

    _, y = tf.while_loop(lambda i, y: i < 3, step, (0, x), maximum_iterations=3)
    return y


def _scan(x):
    return tf.scan(lambda acc, row: tf.tanh(acc * row), x, initializer=tf.ones([4]))


def _map(x):
    return tf.map_fn(lambda row: tf.sin(row) * tf.reduce_sum(row), x)


CONTROL_FLOW = {"cond": _cond, "while": _while, "scan": _scan, "map_fn": _map}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("construct", sorted(CONTROL_FLOW))
def test_control_flow_inside_a_region(mode, policy, construct):
    body = CONTROL_FLOW[construct]

    def make(wrap):
        return lambda x: tf.reduce_sum(wrap(lambda x: body(x) * 2.0)(x) ** 2)

    check(mode, policy, make, [rand(3, 4)])


def _dropout_then_tanh(x):
    return tf.tanh(keras.random.dropout(x @ tf.eye(4), 0.5, seed=_SECOND_ORDER_SEEDS) * x)


_SECOND_ORDER_SEEDS = keras.random.SeedGenerator(3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("construct", sorted(CONTROL_FLOW) + ["dropout"])
def test_second_order_through_control_flow_and_dropout(mode, construct):
    body = CONTROL_FLOW.get(construct, _dropout_then_tanh)
    _SECOND_ORDER_SEEDS.state.assign([3, 0])

    runs = []

    def counted(x):
        runs.append(1)
        return body(x)

    def hessian_vector(wrap):
        def step(x, v):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    y = tf.reduce_sum(wrap(counted)(x) ** 2)
                g = inner.gradient(y, x)
                gv = tf.reduce_sum(g * v)
            return outer.gradient(gv, x)

        return compiled(step, mode)

    x, v = rand(3, 4), rand(3, 4)
    want = hessian_vector(plain)(x, v)
    _SECOND_ORDER_SEEDS.state.assign([3, 0])
    runs.clear()
    assert_close(hessian_vector(remat.checkpoint)(x, v), want, tol=1e-4)
    assert len(runs) >= 2, len(runs)


_KEPT_SEEDS = keras.random.SeedGenerator(5)


@pytest.mark.tf_compat
@pytest.mark.parametrize("mode", ["eager", "graph", pytest.param("xla", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "policy",
    [
        "dots_saveable",
        "dots_saveable+random_masks_saveable",
        remat.policies.save_only_these_names("h"),
    ],
)
def test_second_order_through_the_values_a_policy_keeps(mode, policy):
    """A Hessian-vector product through values the policy keeps (a matmul, a named value, a
    dropout mask), for an input and a variable, with two tapes and as a forward accumulator's
    JVP of the gradient: the first gradient reads the kept values, so the second must
    differentiate them too (in eager mode they once were constants to it)."""
    w = tf.Variable(rand(4, 4))
    runs = []

    def block(x):
        runs.append(1)
        h = remat.checkpoint_name(tf.matmul(x, w), "h")
        return tf.matmul(tf.tanh(keras.random.dropout(h, 0.3, seed=_KEPT_SEEDS)), w)

    def hessian_vector(wrap):
        def step(x, v):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    outer.watch(x)
                    y = tf.reduce_sum(tf.sin(wrap(block)(x)))
                gx, gw = inner.gradient(y, [x, w])
                gv = tf.reduce_sum(gx * v) + tf.reduce_sum(gw * gw)
            return [gx, gw, *outer.gradient(gv, [x, w])]

        return compiled(step, mode)

    def forward_over_reverse(wrap):  # the same product, as a JVP of the gradient
        def step(x, v):
            with tf.autodiff.ForwardAccumulator(x, v) as accumulator:
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf.reduce_sum(tf.sin(wrap(block)(x)))
                gx = tape.gradient(y, x)
            return accumulator.jvp(gx)

        return compiled(step, mode)

    x, v = rand(3, 4), rand(3, 4)
    for product in (hessian_vector, forward_over_reverse):
        _KEPT_SEEDS.state.assign([5, 0])
        want = product(plain)(x, v)
        _KEPT_SEEDS.state.assign([5, 0])
        runs.clear()
        got = product(lambda fn: remat.checkpoint(fn, policy))(x, v)
        assert_close(got, want, tol=1e-4)
        assert len(runs) >= 2, len(runs)


@pytest.mark.parametrize("mode", MODES)
def test_closure_inside_a_scanned_region_body(mode):
    def make(wrap):
        def loss(x, w):
            def region(x):
                step = lambda acc, row: tf.tanh(tf.linalg.matvec(w, acc) + row)  # noqa: E731
                return tf.scan(step, x, tf.ones([4]))

            return tf.reduce_sum(wrap(region)(x) ** 2)

        return loss

    check(mode, "dots_saveable", make, [rand(5, 4), rand(4, 4)])


@pytest.mark.tf_compat
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["nothing_saveable", "random_masks_saveable"])
def test_dropout_inside_cond_and_while_gets_the_forward_masks(mode, policy):
    drop = keras.layers.Dropout(0.5, seed=11)

    runs = []

    def body(x):
        runs.append(1)
        y = tf.cond(tf.reduce_sum(x) > -1e9, lambda: drop(x, training=True), lambda: x)
        _, z = tf.while_loop(
            lambda i, z: i < 2,
            lambda i, z: (i + 1, drop(tf.sin(z), training=True)),
            (0, y),
            maximum_iterations=2,
        )
        return z

    def make(wrap):
        return lambda x: tf.reduce_sum(wrap(body)(x) ** 2)

    x = rand(4, 8)
    state = drop.seed_generator.state
    state.assign([11, 0])
    want = grads(mode, make(plain), x)
    after_plain = state.numpy().tolist()
    state.assign([11, 0])
    runs.clear()
    got = grads(mode, make(lambda f: remat.checkpoint(f, policy)), x)
    assert len(runs) == 2
    assert_close(got, want)
    assert state.numpy().tolist() == after_plain  # the step advanced the seed once


# 5. Functions traced inside a region.


@pytest.mark.parametrize("mode", MODES)
def test_tf_function_first_traced_inside_a_region(mode):
    def make(wrap):
        inner = tf.function(lambda x: tf.sin(x) @ tf.ones([4, 4]))
        drop = keras.layers.Dropout(0.3, seed=5)
        noisy = tf.function(lambda x: drop(x, training=True))

        def region(x):
            return noisy(inner(x)) * inner(x * 2.0)

        return lambda x: tf.reduce_sum(wrap(region)(x) ** 2)

    check(mode, "nothing_saveable", make, [rand(3, 4)])


# 6. Regions inside loop bodies (a user's own scan over layers) and conditionals.


@pytest.mark.tf_compat
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["scan", "while_loop", "cond", "switch_case"])
@pytest.mark.parametrize("order", [1, 2])
def test_region_in_a_loop_body_or_a_branch_closing_over_tensors_and_a_variable(mode, where, order):
    """The recomputation runs in TensorFlow's gradient loop body or gradient branch, which take
    only captures of graph tensors they know: what the region closes over (a variable, a graph
    tensor and, to first order, an eager tensor) reaches it through the enclosing graph, and so
    does an argument from outside the body or branch."""
    w = tf.Variable(rand(4, 4, seed=4))
    eager = rand(4, seed=5)
    drop = keras.layers.Dropout(0.3, seed=6)

    def block(h, c, bias):
        return tf.tanh(drop(tf.linalg.matvec(w, h) + c + bias, training=True))

    def make(wrap, closed, bias):
        def loss(xs, c):
            if closed:
                layer = wrap(lambda h: block(h, c, bias))
            else:
                region = wrap(block)
                layer = lambda h: region(h, c, bias)  # noqa: E731
            taken = tf.reduce_sum(c) > -1e9
            if where == "scan":
                out = tf.scan(lambda acc, row: layer(acc + row), xs, tf.ones([4]))
            elif where == "while_loop":
                step = lambda i, h: (i + 1, layer(h + xs[i]))  # noqa: E731
                out = tf.while_loop(lambda i, h: i < 3, step, (0, xs[0]), maximum_iterations=3)[1]
            elif where == "cond":
                out = tf.cond(taken, lambda: layer(xs[0]), lambda: xs[1])
            else:
                branches = [lambda: xs[1], lambda: layer(xs[0]), lambda: layer(xs[2])]
                out = tf.switch_case(tf.cast(taken, tf.int32), branches)
            return tf.reduce_sum(out**2)

        return loss

    def gradients(wrap, xs, c, closed, bias):
        def first(xs, c):
            with tf.GradientTape() as tape:
                tape.watch([xs, c])
                value = make(wrap, closed, bias)(xs, c)
            return tape.gradient(value, [xs, c, w])

        def run(xs, c):
            if order == 1:
                return first(xs, c)
            with tf.GradientTape() as outer:
                outer.watch([xs, c])
                norm = sum(tf.reduce_sum(g**2) for g in first(xs, c))
            return outer.gradient(norm, [xs, c, w])

        drop.seed_generator.state.assign([6, 0])
        return compiled(run, mode)(xs, c)

    xs, c = rand(3, 4), rand(4)
    # The region closes over an eager tensor too; under a second tape that fails in TensorFlow's
    # own gradient code (docs/remat.md), so the second order closes over a variable and a graph
    # tensor only.
    closed, bias = True, eager if order == 1 else 0.0
    if order == 2 and where in ("cond", "switch_case") and mode != "eager":
        # In a branch, closing over the graph tensor fails there too (an assertion of cond_v2),
        # as docs/remat.md says: a fix must update both. Passed as arguments, the graph tensor
        # and the eager one work (and a variable, closed over).
        gradients(plain, xs, c, closed, bias)
        with pytest.raises(AssertionError):
            gradients(remat.checkpoint, xs, c, closed, bias)
        closed, bias = False, eager
    assert_recomputed_and_equal(lambda wrap: gradients(wrap, xs, c, closed, bias), tol=1e-4)


# 7. Keras' call context: what an outer layer call hands down reaches the recomputation.


class TrainingScale(keras.layers.Layer):
    """Builds the same op in training and inference, with another constant: a recomputation in
    the wrong mode would give a wrong gradient that no op-by-op comparison of types sees."""

    def call(self, x, training=None):
        return x * (0.5 if training else 2.0)


class ImplicitBlock(keras.layers.Layer):
    """A block written the ordinary Keras 3 way: `training` is never passed on."""

    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.scale = TrainingScale()
        self.drop = keras.layers.Dropout(0.3, seed=8)
        self.out = keras.layers.Dense(8)

    def call(self, x):
        ImplicitBlock.calls += 1
        return x + self.out(self.drop(self.scale(tf.tanh(self.dense(x)))))


def _implicit_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    h = inputs
    for _ in range(2):
        h = ImplicitBlock()(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def _model_grads(model, mode, x):
    start = [v.numpy() for v in model.variables]  # weights and seed states

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) * tf.range(1.0, 3.0)[:, None])
        grads = tape.gradient(loss, model.trainable_variables)
        return [tf.convert_to_tensor(g) for g in grads]  # an embedding's IndexedSlices

    got = compiled(step, mode)(x)
    for v, value in zip(model.variables, start, strict=True):
        v.assign(value)
    return got


@pytest.mark.tf_compat
@pytest.mark.parametrize("mode", MODES)
def test_training_taken_from_the_call_context_survives_the_recomputation(mode):
    model = _implicit_model()
    x = rand(2, 8)
    want = _model_grads(model, mode, x)
    assert len(remat.set_grad_checkpointing(model)) == 2
    ImplicitBlock.calls = 0
    assert_close(_model_grads(model, mode, x), want)
    assert ImplicitBlock.calls >= 4, ImplicitBlock.calls  # 2 blocks: forward and recomputation


def test_a_recomputation_outside_the_call_context_is_a_mismatch_error(monkeypatch):
    import contextlib

    from framework.core import tf_internals

    model = _implicit_model()
    remat.set_grad_checkpointing(model, policy="dots_saveable")
    ignored = lambda state: contextlib.nullcontext()  # noqa: E731
    monkeypatch.setattr(tf_internals, "keras_call_state_entered", ignored)
    with pytest.raises(remat.RecomputationMismatchError, match=r"training=True.*training=None"):
        _model_grads(model, "graph", rand(2, 8))


class MaskedAttention(keras.layers.Layer):
    """Attention that takes its padding mask from the Keras mask riding on its input, as
    `MultiHeadAttention` (and keras-hub's transformer layers) do."""

    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.attention = keras.layers.MultiHeadAttention(2, 4, dropout=0.2, seed=9)

    def call(self, x):
        MaskedAttention.calls += 1
        return x + self.attention(x, x)


@pytest.mark.parametrize("mode", MODES)
def test_keras_masks_reach_the_region_and_leave_it(mode):
    keras.utils.set_random_seed(4)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    for _ in range(2):
        h = MaskedAttention()(h)
    model = keras.Model(tokens, keras.layers.GlobalAveragePooling1D()(h))
    x = tf.constant([[3, 4, 5, 0, 0, 0], [7, 8, 9, 10, 11, 0]])
    want = _model_grads(model, mode, x)
    assert len(remat.set_grad_checkpointing(model)) == 2
    MaskedAttention.calls = 0
    assert_close(_model_grads(model, mode, x), want)
    assert MaskedAttention.calls >= 4, MaskedAttention.calls  # 2 blocks, each recomputed


class CountedAttention(keras.layers.MultiHeadAttention):
    """Keras' `MultiHeadAttention`, counting its calls (its `call` as it is: Keras reads the
    signature to pass masks)."""

    calls = 0

    def _compute_attention(self, *args, **kwargs):
        CountedAttention.calls += 1
        return super()._compute_attention(*args, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_a_region_that_clears_its_inputs_masks_clears_the_callers(mode, policy):
    """Keras' `MultiHeadAttention` takes the mask off its inputs, so the residual sum and the
    pooling after it see none. As regions of their own, the layers ran on the traced function's
    inputs: the caller's tensor kept its mask and the model computed something else (gradients
    off by up to 68 times in graph mode). Twice in eager mode: a reused trace must clear it too."""
    keras.utils.set_random_seed(4)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    for _ in range(2):
        attended = CountedAttention(2, 4, dropout=0.2, seed=9)(h, h)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, attended]))
    model = keras.Model(tokens, keras.layers.GlobalAveragePooling1D()(h))
    x = tf.constant([[3, 4, 5, 0, 0, 0], [7, 8, 9, 10, 11, 0]])
    want = _model_grads(model, mode, x)
    regions = remat.set_grad_checkpointing(model, policy=policy)
    assert [type(r) for r in regions] == [CountedAttention] * 2, regions
    CountedAttention.calls = 0
    assert_close(_model_grads(model, mode, x), want)
    assert CountedAttention.calls >= 4, CountedAttention.calls  # 2 layers, recomputed
    if mode == "eager":  # again, through the traces made for the first call
        assert_close(_model_grads(model, mode, x), want)


class NormalizedBlock(keras.layers.Layer):
    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.norm = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        NormalizedBlock.calls += 1
        return x + self.norm(self.dense(x), training=training)


def test_an_eager_trace_is_made_again_after_a_layer_is_frozen():
    """Fine-tuning freezes BatchNorm between two eager runs (`fit(run_eagerly=True)`): a region
    traced before would go on updating its statistics, in training mode."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), NormalizedBlock(), NormalizedBlock()])
    assert len(remat.set_grad_checkpointing(model, policy="dots_saveable")) == 2
    x = rand(2, 8)
    _model_grads(model, "eager", x)
    norms = [layer.norm for layer in model.layers]
    for norm in norms:
        norm.trainable = False
    before = [norm.moving_mean.numpy() for norm in norms]
    NormalizedBlock.calls = 0
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=True))
    tape.gradient(loss, model.trainable_variables)
    assert NormalizedBlock.calls >= 4, NormalizedBlock.calls  # traced again, and recomputed
    for norm, mean in zip(norms, before):
        np.testing.assert_array_equal(norm.moving_mean.numpy(), mean)


def test_an_eager_trace_of_a_function_is_made_again_after_a_layer_it_calls_is_frozen():
    """The same for a checkpointed function that calls a layer: its layers are only known once
    it has run, and the trace remembers their flags. Gradients and statistics are compared with
    the plain function over one unfrozen and one frozen step."""
    keras.utils.set_random_seed(0)
    norm = keras.layers.BatchNormalization()
    w = tf.Variable(rand(8, 8))
    norm.build((None, 8))
    start = [v.numpy() for v in [*norm.variables, w]]
    x = rand(4, 8)

    def body(x):
        return norm(tf.tanh(x @ w), training=True)

    def two_steps(fn):
        for v, value in zip([*norm.variables, w], start):
            v.assign(value)
        got = []
        for trainable in (True, False):
            norm.trainable = trainable
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x) ** 2)
            got += [*tape.gradient(loss, [x, w]), norm.moving_mean.numpy()]
        norm.trainable = True
        return got

    counted = Counted(body)
    assert_close(two_steps(remat.checkpoint(counted, "dots_saveable")), two_steps(body))
    assert counted.calls == 4  # traced twice, recomputed twice


# 8. Smaller semantic cases.


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_a_variables_gradient_waits_for_the_recomputations_reads_of_it(policy):
    """Keras' `fit` with `steps_per_execution` > 1 (without XLA) updated a weight before the
    recomputation had read it for the other gradients, about one run in three: graph mode orders
    the two by control edges only, which Grappler dropped there. A variable's gradient now
    depends on the recomputation's reads by data, even where its value does not (`x @ w`)."""
    w = tf.Variable(rand(4, 4))
    region = remat.checkpoint(lambda x: x @ w, policy)
    built_by_forward = []

    @tf.function
    def gradient(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(region(x) ** 2)
        built_by_forward.append(len(tf.compat.v1.get_default_graph().get_operations()))
        return tape.gradient(loss, w)

    graph = gradient.get_concrete_function(tf.TensorSpec([2, 4])).graph
    recomputed = graph.get_operations()[built_by_forward[0] :]
    reads = [op for op in recomputed if op.type == "ReadVariableOp"]
    assert reads  # the recomputation reads w again
    ancestors, frontier = set(), [graph.outputs[0].op]
    while frontier:
        op = frontier.pop()
        if op not in ancestors:
            ancestors.add(op)
            frontier += [t.op for t in op.inputs]
    assert any(read in ancestors for read in reads)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_taken_inside_a_region(mode):
    def make(wrap):
        def region(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                e = tf.reduce_sum(tf.sin(x) ** 2)
            return tape.gradient(e, x) * x

        return lambda x: tf.reduce_sum(wrap(region)(x) ** 2)

    check(mode, "nothing_saveable", make, [rand(5)])


@pytest.mark.parametrize("mode", MODES)
def test_user_custom_gradient_inside_a_region(mode):
    @tf.custom_gradient
    def clip_grad(x):
        return tf.identity(x), lambda dy: tf.clip_by_value(dy, -0.1, 0.1)

    def make(wrap):
        return lambda x: tf.reduce_sum(wrap(lambda x: clip_grad(tf.sin(x)) * x)(x) ** 3)

    check(mode, "nothing_saveable", make, [rand(6)])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [0, 2])
def test_an_empty_batch_and_a_variable_without_elements(mode, batch):
    """The data edges that order a recomputation read one element of each input and variable
    it ties: an empty batch and a variable of shape [0, 3] have none, and give the plain
    gradients all the same."""
    v, empty = tf.Variable(rand(3, 3)), tf.Variable(tf.zeros([0, 3]))

    def make(wrap):
        return lambda x: wrap(lambda x: tf.reduce_sum(tf.sin(x @ v)) + tf.reduce_sum(empty))(x)

    check(mode, "nothing_saveable", make, [rand(batch, 3)])


@pytest.mark.parametrize("mode", MODES)
def test_python_values_in_and_out(mode):
    region = remat.checkpoint(lambda a, b: a * b + 1)
    assert region(2.0, 3) == 7.0

    def make(wrap):
        def region(x, scale, opts, name):
            assert isinstance(scale, np.float64) and opts == {"k": [1, 2]} and name == "n"
            return {"y": tf.sin(x) * scale, "label": name, "n": 3}

        def loss(x):
            out = wrap(region)(x, np.float64(0.5), {"k": [1, 2]}, name="n")
            assert out["label"] == "n" and out["n"] == 3 and out["y"].dtype == tf.float32
            return tf.reduce_sum(out["y"])

        return loss

    check(mode, "nothing_saveable", make, [rand(4)])


@pytest.mark.parametrize("mode", MODES)
def test_unconnected_inputs_and_unused_variables_get_none(mode):
    used, unused = tf.Variable(rand(3, seed=1)), tf.Variable(rand(3, seed=2))

    runs = []

    def region(x, unrelated):
        runs.append(unused)  # closed over, never read
        return tf.sin(x) * used

    def step(wrap):
        def run(x, unrelated):
            with tf.GradientTape() as tape:
                tape.watch([x, unrelated])
                y = tf.reduce_sum(wrap(region)(x, unrelated))
            return tape.gradient(y, [x, unrelated, used, unused])

        return compiled(run, mode)

    x, u = rand(3), rand(3)
    got = step(remat.checkpoint)(x, u)
    assert got[1] is None and got[3] is None and len(runs) == 2
    assert_close(got, step(plain)(x, u))


class FrozenBlock(keras.layers.Layer):
    """A block whose first projection is frozen, as in a fine-tuned backbone."""

    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.frozen = keras.layers.Dense(4, trainable=False)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        FrozenBlock.calls += 1
        return self.dense(tf.tanh(self.frozen(x)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_a_watched_non_trainable_variable_gets_its_gradient(mode, policy):
    """`tape.watch` on a non-trainable variable: its read inside a region is differentiated as
    without remat (TensorFlow's `tf.custom_gradient` and `tf.recompute_grad` give None), and a
    tape that does not watch it neither gets it nor starts watching it."""
    scale = tf.Variable(rand(3, seed=3), trainable=False)
    runs = []

    def region(x):
        runs.append(1)
        return tf.sin(x * scale)

    def function_step(wrap):
        fn = wrap(region)

        def run(x):
            with tf.GradientTape() as tape, tf.GradientTape() as other:
                tape.watch([x, scale])
                y = tf.reduce_sum(fn(x) ** 2)
            assert not any(v is scale for v in other.watched_variables())
            return tape.gradient(y, [x, scale])

        return compiled(run, mode)

    x = rand(3)
    got = function_step(lambda fn: remat.checkpoint(fn, policy))(x)
    assert got[1] is not None and len(runs) == 2
    assert_close(got, function_step(plain)(x))

    block = FrozenBlock()
    block(x[None])

    def layer_step(x):
        with tf.GradientTape() as tape:
            tape.watch(block.frozen.kernel.value)  # Keras' variable stores a tf.Variable
            y = tf.reduce_sum(block(x) ** 2)
        return tape.gradient(y, [block.frozen.kernel, *block.trainable_variables])

    want = compiled(layer_step, mode)(x[None])
    remat.checkpoint(block, policy)
    FrozenBlock.calls = 0
    got = compiled(layer_step, mode)(x[None])
    assert got[0] is not None and FrozenBlock.calls == 2
    assert_close(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_inputs_and_variables_reaching_only_unused_results_get_none(mode):
    v, w = tf.Variable(rand(3, seed=1)), tf.Variable(rand(3, seed=2))
    region = Counted(lambda x, y: (tf.cos(x) * v, tf.sin(y) * w))

    def run(x, y):
        with tf.GradientTape() as tape:
            tape.watch([x, y])
            used, _ = remat.checkpoint(region)(x, y)
            value = tf.reduce_sum(used)
        return tape.gradient(value, [x, y, v, w])

    got = compiled(run, mode)(rand(3), rand(3))
    assert got[1] is None and got[3] is None
    assert got[0] is not None and got[2] is not None
    # The forward pass and one recomputation, traced for the result used (in eager mode too:
    # not ahead, for every result).
    assert region.calls == 2

    def through_sign(x, y):  # a used result whose real gradient is zeros (`sign`'s ZerosLike)
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = tf.reduce_sum(tf.sign(remat.checkpoint(region)(x, y)[0]))
        return tape.gradient(value, [x, v])

    zeros = compiled(through_sign, mode)(rand(3), rand(3))
    assert all(g is not None and not np.any(g) for g in zeros), zeros


@pytest.mark.tf_compat
def test_eager_gradients_of_one_call_through_different_results():
    """One persistent tape, one eager call, two gradients: each sees the results it uses, and
    both equal the plain function's."""
    v, w = tf.Variable(rand(3, seed=1)), tf.Variable(rand(3, seed=2))
    region = Counted(lambda x, y: (tf.cos(x) * v * y, tf.sin(y) * w))
    x, y = rand(3, seed=3), rand(3, seed=4)

    def gradients(wrap):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, y])
            first, second = wrap(region)(x, y)
            losses = [tf.reduce_sum(first), tf.reduce_sum(second**2), tf.reduce_sum(first * second)]
        return [tape.gradient(loss, [x, y, v, w]) for loss in losses]

    got, want = gradients(remat.checkpoint), gradients(plain)
    for g, expected in zip(got, want):
        assert [t is None for t in g] == [t is None for t in expected], (g, expected)
        assert_close(g, expected)
    assert [t is None for t in got[1]] == [True, False, True, False]
    # Forward, the backward for both results (traced ahead, used by the third), first alone,
    # second alone; the plain function once.
    assert region.calls == 4 + 1


@pytest.mark.parametrize("mode", MODES)
def test_only_some_outputs_used_and_integer_outputs(mode):
    def make(wrap):
        def region(x):
            return tf.sin(x), tf.cos(x), tf.argmax(x), tf.shape(x)

        def loss(x):
            a, _, idx, shape = wrap(region)(x)
            assert idx.dtype == tf.int64 and shape.dtype == tf.int32
            return tf.reduce_sum(a)

        return loss

    check(mode, "nothing_saveable", make, [rand(5)])


@pytest.mark.parametrize("mode", MODES)
def test_random_generator_inside_a_region(mode):
    gen = tf.random.Generator.from_seed(7)
    runs = []

    def make(wrap):
        def region(x):
            runs.append(1)
            return x * tf.cast(gen.uniform(x.shape) > 0.5, x.dtype) + tf.sin(x)

        return lambda x: tf.reduce_sum(wrap(region)(x) ** 2)

    x = rand(16)
    gen.reset_from_seed(7)
    want = grads(mode, make(plain), x)
    state = gen.state.numpy()
    gen.reset_from_seed(7)
    runs = []
    got = grads(mode, make(remat.checkpoint), x)
    assert len(runs) == 2
    assert_close(got, want)
    np.testing.assert_array_equal(gen.state.numpy(), state)


@pytest.mark.parametrize("mode", MODES)
def test_errors_keep_their_class_through_tf_function(mode):
    def stateful(x):
        return x * tf.random.uniform(tf.shape(x))

    calls = []

    def changing(x):
        calls.append(1)
        return tf.sin(x) if len(calls) == 1 else tf.cos(x)

    for fn, error in (
        (stateful, remat.UnreplayableRandomOpError),
        (changing, remat.RecomputationMismatchError),
    ):
        with pytest.raises(error) as info:
            grads(mode, lambda x, fn=fn: tf.reduce_sum(remat.checkpoint(fn)(x)), rand(3))
        assert isinstance(info.value, remat.RematError)


@pytest.mark.parametrize("mode", MODES)
def test_a_python_value_that_changes_between_the_passes_is_a_mismatch(mode):
    """The same ops around another constant (a Python counter the region reads) would
    differentiate another function: the determinism check compares the constants too."""
    calls = []

    def scaled_by_calls(x):
        calls.append(1)
        return tf.sin(x) * float(len(calls))

    with pytest.raises(remat.RecomputationMismatchError, match=r"as 2.0 where .* built 1.0"):
        grads(mode, lambda x: tf.reduce_sum(remat.checkpoint(scaled_by_calls)(x)), rand(3))


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_forward_mode_gives_the_plain_jvp(policy):
    w = rand(4, 4)

    def sin_of_product_times_x(x):
        return tf.sin(x @ w) * x

    body = Counted(sin_of_product_times_x)
    region = remat.checkpoint(body, policy)
    x, v = rand(3, 4), rand(3, 4)

    def jvp(fn, x, v):
        with tf.autodiff.ForwardAccumulator(x, v) as accumulator:
            y = fn(x)
        return accumulator.jvp(y)

    want = jvp(sin_of_product_times_x, x, v)
    np.testing.assert_allclose(jvp(region, x, v), want, rtol=1e-5, atol=1e-6)
    assert body.calls >= 2  # forward-mode goes through the recomputation's gradient
    for jit in (False, True):
        got = tf.function(lambda x, v: jvp(region, x, v), jit_compile=jit)(x, v)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _dots(step, *args) -> int:
    hlo = step.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    return hlo.count(" dot(")


def test_xla_keeps_the_recomputation_when_the_upstream_gradient_is_constant():
    w = rand(32, 32)

    def step(wrap):
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.reduce_sum(wrap(lambda x: tf.sin(tf.sin(x @ w) @ w))(x))
            return y, tape.gradient(y, x)

        return tf.function(run, jit_compile=True)

    x = rand(8, 32)
    assert_close(step(remat.checkpoint)(x), step(plain)(x))
    assert _dots(step(remat.checkpoint), x) > _dots(step(plain), x)


def _live_key_derivations(function) -> int:
    """How many `StatelessRandomGetKeyCounter` ops of a traced step feed another op, in its
    graph and the functions it calls (the recomputation's own derivation is left unused)."""
    graph = function.get_concrete_function(rand(4, 8)).graph.as_graph_def()
    live = 0
    for nodes in [graph.node, *(f.node_def for f in graph.library.function)]:
        derived = {n.name for n in nodes if n.op == "StatelessRandomGetKeyCounter"}
        read = {i.lstrip("^").split(":")[0] for n in nodes for i in n.input}
        live += len(derived & read)
    return live


@pytest.mark.parametrize("jit", [False, True])
def test_the_recomputation_draws_with_the_forward_pass_keys(jit):
    """The key a random op derives from its seed is kept whatever the policy (three words; XLA
    expands each derivation into hundreds of ops): the recomputed draw reads the forward pass's
    key, the masks stay the same."""
    keras.utils.set_random_seed(1)
    dense, drop = keras.layers.Dense(8), keras.layers.Dropout(0.5, seed=3)
    runs = []

    def make(wrap):
        def region(x):
            runs.append(1)
            return drop(tf.sin(dense(drop(x, training=True))), training=True)

        return lambda x: tf.reduce_sum(wrap(region)(x) ** 2)

    x = rand(4, 8)
    make(plain)(x)
    start = [v.numpy() for v in drop.variables]

    def step(loss):
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                value = loss(x)
            return tape.gradient(value, [x, *dense.trainable_variables])

        return tf.function(run, jit_compile=jit, autograph=False)

    results = {}
    for name, wrap in [("plain", plain), ("remat", remat.checkpoint)]:
        for v, value in zip(drop.variables, start, strict=True):
            v.assign(value)
        function = step(make(wrap))
        results[name] = function(x)
        assert _live_key_derivations(function) == 2
    assert len(runs) == 4  # the build, a trace of the plain step, two of the checkpointed one
    assert_close(results["remat"], results["plain"])
