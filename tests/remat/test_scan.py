"""Scan over layers: a scanned model computes what the unrolled one computes, gradients and
dropout included, with each loop step rematerialized, and weights move between the layouts."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import memory, remat
from framework.core import jax_internals
from framework.core.tf_internals import hlo_pb2, xla_data_pb2
from framework.memory import tpu
from framework.models import language, scan, transformer, vit
from framework.runtime import flops

CONFIG = dict(image_size=16, patch_size=8, num_classes=5, dim=16, depth=3, num_heads=2, mlp_dim=32)


def pair(dropout: float = 0.1):
    """An unrolled ViT and a scanned one holding the same weights and dropout seeds."""
    keras.utils.set_random_seed(0)
    unrolled = vit.VisionTransformer(**CONFIG, dropout=dropout)
    scanned = vit.VisionTransformer(**CONFIG, dropout=dropout, scan_layers=True)
    transformer.copy_weights(unrolled, scanned)
    return unrolled, scanned


def step(model, mode: str):
    def run(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )
        return loss, tape.gradient(loss, model.trainable_variables)

    if mode == "eager":
        return run
    return tf.function(run, jit_compile=mode == "xla")


def unstacked(model, grads):
    """Gradients of a scanned model: (outside the blocks, per block in order)."""
    scanned = model.scanned_blocks
    by_variable = {id(v): g for v, g in zip(model.trainable_variables, grads)}
    trainable, _ = scanned._ordered()
    per_block = [[] for _ in range(scanned.depth)]
    for variable in trainable:
        for i, g in enumerate(tf.unstack(by_variable[id(variable)])):
            per_block[i].append(np.asarray(g))
    inside = {id(v) for v in scanned.variables}
    own = [np.asarray(by_variable[id(v)]) for v in model.trainable_variables if id(v) not in inside]
    return own, [g for block in per_block for g in block]


def split_unrolled(model, grads):
    in_blocks = {id(v) for b in model.blocks for v in b.variables}
    by_variable = {id(v): np.asarray(g) for v, g in zip(model.trainable_variables, grads)}
    own = [by_variable[id(v)] for v in model.trainable_variables if id(v) not in in_blocks]
    blocks = [by_variable[id(v)] for b in model.blocks for v in b.trainable_variables]
    return own, blocks


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("policy", [None, "nothing_saveable", "dots_saveable"])
def test_scanned_vit_matches_unrolled_with_dropout(mode, policy):
    unrolled, scanned = pair()
    if policy is not None:
        assert remat.set_grad_checkpointing(scanned, policy=policy) == [scanned.scanned_blocks]
    images = tf.random.stateless_normal((2, 16, 16, 3), seed=[len(mode), 7])
    labels = tf.constant([1, 3])
    loss_u, grads_u = step(unrolled, mode)(images, labels)
    loss_s, grads_s = step(scanned, mode)(images, labels)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
    for got, want in zip(unstacked(scanned, grads_s), split_unrolled(unrolled, grads_u)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    # Each block's dropout seeds advanced once, as in the unrolled model.
    for k, stacked in enumerate(scanned.scanned_blocks._ordered()[1]):
        rows = [b.non_trainable_variables[k].numpy().tolist() for b in unrolled.blocks]
        assert np.asarray(stacked).tolist() == rows


def test_each_loop_step_is_recomputed():
    _, scanned = pair()
    calls = []
    template = scanned.scanned_blocks.template
    original = template.call

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    template.call = counted
    images = tf.zeros((1, 16, 16, 3))
    remat.set_grad_checkpointing(scanned, policy="nothing_saveable")
    step(scanned, "graph")(images, tf.constant([0]))
    assert len(calls) == 2  # the block is traced once per pass (forward, rebuilt), not per layer
    assert remat.checkpointed_layers(scanned) == [scanned.scanned_blocks]
    remat.set_grad_checkpointing(scanned, enable=False)
    assert remat.checkpointed_layers(scanned) == []


@pytest.mark.slow
def test_the_compiled_loop_recomputes_what_the_policy_does_not_keep():
    """XLA's program of the step: the scanned loop with `dots_saveable` computes no product twice
    (the unrolled model's FLOPs without remat); `nothing_saveable` recomputes every block's
    products; and full remat plans fewer temporaries than no remat (TensorFlow's own loop
    gradient, whose trip count is only known when it runs, so its FLOPs are not counted)."""
    images, labels = tf.zeros((2, 16, 16, 3)), tf.constant([0, 1])
    unrolled, scanned = pair()
    plain = flops.forward_flops(step(unrolled, "xla"), images, labels)[0]
    counted, temps = {}, {}
    for policy in (None, "dots_saveable", "nothing_saveable"):
        remat.set_grad_checkpointing(scanned, policy=policy, enable=policy is not None)
        counted[policy], exact = flops.forward_flops(step(scanned, "xla"), images, labels)
        assert exact == (policy is not None)
        temps[policy] = memory.compiled_bytes(step(scanned, "xla"), images, labels).temp_bytes
    # A block's products on 2 x 5 tokens of width 16 (MLP 32, 2 heads of 8), 2 FLOPs each:
    # qkv, attention scores and values, output projection, MLP in; the MLP's output projection
    # is not recomputed, as the backward pass reads only its input.
    tokens, dim, mlp = 10, 16, 32
    scores = 2 * 2 * (2 * 2 * 5 * 5 * 8)  # two products over batch x heads x 5 x 5 x 8
    recomputed = 2 * tokens * dim * (3 * dim + dim + mlp) + scores
    assert counted["dots_saveable"] == plain, counted
    assert counted["nothing_saveable"] - plain == CONFIG["depth"] * recomputed, counted
    assert temps["nothing_saveable"] < temps[None], temps


def test_scan_matches_a_python_loop():
    """`remat.scan` on its own: carry, stacked and per-step inputs, a floating output per step
    and an integer one; gradients equal to a loop written out, for every policy."""
    xs = tf.random.stateless_normal((4, 3, 3), seed=[1, 2])
    bias = tf.random.stateless_normal((3,), seed=[3, 4])
    h0 = tf.random.stateless_normal((2, 3), seed=[5, 6])
    ids = tf.range(4)

    def body(h, slices, consts):
        w, i = slices
        h = tf.tanh(tf.matmul(h, w) + consts[0])
        return h, [tf.reduce_sum(h), i * 2]

    def loss_of(h, ys):
        return tf.reduce_sum(h * h) + tf.reduce_sum(ys[0] * tf.range(4.0))

    with tf.GradientTape() as tape:
        tape.watch([h0, xs, bias])
        h, outs = h0, []
        for i in range(4):
            h, ys = body(h, [xs[i], ids[i]], [bias])
            outs.append(ys[0])
        want_loss = loss_of(h, [tf.stack(outs)])
    want = tape.gradient(want_loss, [h0, xs, bias])
    for policy in (None, "nothing_saveable", "dots_saveable"):
        for mode in ("eager", "graph", "xla"):

            def run(policy=policy):
                with tf.GradientTape() as tape:
                    tape.watch([h0, xs, bias])
                    h, ys = remat.scan(body, h0, [xs, ids], [bias], policy=policy)
                    loss = loss_of(h, ys)
                return loss, ys[1], tape.gradient(loss, [h0, xs, bias])

            if mode != "eager":
                run = tf.function(run, jit_compile=mode == "xla")
            loss, doubled, got = run()
            np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
            assert doubled.numpy().tolist() == [0, 2, 4, 6]
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{policy} {mode}")


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_scan_second_order_and_an_eager_closure_match_a_python_loop(mode, policy):
    """Second-order gradients for the carry, the stacked inputs, the consts and an eager tensor
    the step closes over, equal to a loop written out. The stacked inputs' slices cross a
    barrier that has no gradient, and closures are no inputs of the loop: both once lost their
    share silently."""
    xs = tf.random.stateless_normal((3, 2, 2), seed=[1, 7])
    bias = tf.random.stateless_normal((2,), seed=[2, 7])
    closed = tf.random.stateless_normal((2, 2), seed=[3, 7])
    h0 = tf.random.stateless_normal((2, 2), seed=[4, 7])
    sources = [h0, xs, bias, closed]
    rebuilt = []  # the step's Python body run while the first gradient is taken

    def body(h, slices, consts):
        rebuilt.extend(during_gradient)
        return tf.tanh(h @ slices[0] + h @ closed + consts[0]), []

    def python_loop(h, xs, bias):
        for i in range(3):
            h, _ = body(h, [xs[i]], [bias])
        return h

    def second_order(loop):
        def run():
            with tf.GradientTape() as outer:
                outer.watch(sources)
                with tf.GradientTape() as inner:
                    inner.watch(sources)
                    loss = tf.reduce_sum(loop(h0, xs, bias) ** 2)
                during_gradient.append(1)
                first = inner.gradient(loss, sources)
                during_gradient.clear()
                total = tf.add_n([tf.reduce_sum(g**2) for g in first])
            return first + outer.gradient(total, sources)

        return run() if mode == "eager" else tf.function(run, jit_compile=mode == "xla")()

    during_gradient = []
    want = second_order(python_loop)
    got = second_order(lambda h, xs, bias: remat.scan(body, h, [xs], [bias], policy=policy)[0])
    for g, w, name in zip(got, want, ["h0", "xs", "bias", "closed"] * 2):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
    assert rebuilt, "the loop's gradient did not rebuild the step: no remat"


def test_scan_refuses_a_step_that_reads_a_variable():
    weight = tf.Variable(tf.ones((3, 3)))

    def body(h, slices, consts):
        return tf.matmul(h, weight) * slices[0], []

    with pytest.raises(remat.RematError, match="pass it to remat.scan in `xs`"):
        remat.scan(body, tf.ones((2, 3)), [tf.ones((4, 3))])


def test_weights_round_trip_between_layouts(tmp_path):
    unrolled, scanned = pair()
    back = vit.VisionTransformer(**CONFIG, dropout=0.1)
    transformer.copy_weights(scanned, back)
    for a, b in zip(unrolled.variables, back.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # A checkpoint of the scanned layout restores into a scanned model.
    tf.train.Checkpoint(model=scanned).write(str(tmp_path / "ckpt"))
    other = vit.VisionTransformer(**CONFIG, dropout=0.1, scan_layers=True)
    tf.train.Checkpoint(model=other).read(str(tmp_path / "ckpt")).assert_consumed()
    stacked = scanned.scanned_blocks.variables, other.scanned_blocks.variables
    for a, b in zip(
        scanned.trainable_variables + stacked[0], other.trainable_variables + stacked[1]
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(ValueError, match="blocks for a scan of depth"):
        scan.stack_weights(unrolled.blocks[:2], scanned.scanned_blocks)


def test_scanned_decoder_lm_matches_unrolled():
    config = dict(vocab_size=11, max_length=6, dim=8, depth=2, num_heads=2, mlp_dim=16)
    keras.utils.set_random_seed(0)
    unrolled = language.DecoderLM(**config)
    scanned = language.DecoderLM(**config, scan_layers=True)
    transformer.copy_weights(unrolled, scanned)
    inputs = {
        "tokens": tf.constant([[1, 2, 3, 4, 5, 6]]),
        "positions": tf.constant([[0, 1, 2, 0, 1, 2]]),
        "segment_ids": tf.constant([[1, 1, 1, 2, 2, 2]]),
    }
    np.testing.assert_allclose(scanned(inputs), unrolled(inputs), rtol=1e-5, atol=1e-6)


def test_a_tpu_converts_one_layers_weights_per_step_not_the_whole_stack():
    """A TPU multiplies float32 in bfloat16. Its compiler's bfloat16 propagation would convert
    each whole stacked weight once, before the loops, and hold that second copy for the whole
    step; the loop reads each slice as bits, so only one layer at a time is converted. Read from
    libtpu's optimised program for TPU v5e: no bfloat16 value of the stack's shape anywhere."""
    depth, width = 16, 768

    def block(h, ws, consts):
        return tf.tanh(tf.matmul(h, ws[0])), []

    @tf.function(jit_compile=True)
    def gradients(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            h, _ = remat.scan(block, x, [w], policy="nothing_saveable")
            loss = tf.reduce_sum(h * h)
        return tape.gradient(loss, w)

    specs = tf.TensorSpec([256, width]), tf.TensorSpec([depth, width, width])
    hlo = gradients.experimental_get_compiler_ir(*specs)(stage="hlo_serialized")
    chip = tpu.tpu_chip("v5e")
    device = jax_internals.tpu_device(chip.topology, chip.chip_config)
    compiled = jax_internals.compile_only(tpu.lower_random_for_tpu(hlo), device)

    def shapes(shape):
        yield shape
        for inner in shape.tuple_shapes:
            yield from shapes(inner)

    stacked_bf16 = [
        instruction.name
        for computation in hlo_pb2.HloProto.FromString(compiled.hlo_proto).hlo_module.computations
        for instruction in computation.instructions
        for shape in shapes(instruction.shape)
        if shape.element_type == xla_data_pb2.BF16 and list(shape.dimensions)[:1] == [depth]
    ]
    assert not stacked_bf16, stacked_bf16


def _hub_encoder_pair():
    """keras-hub's TransformerEncoder (dropout on), as 3 unrolled blocks and as ScannedBlocks
    with the same weights and seeds, in functional models with one head."""
    import keras_hub

    def make(name):
        return keras_hub.layers.TransformerEncoder(
            intermediate_dim=64, num_heads=4, dropout=0.1, name=name
        )

    def build(scanned: bool):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 32))
        blocks = scan.ScannedBlocks(make, 3) if scanned else [make(f"b{i}") for i in range(3)]
        h = blocks(inputs) if scanned else inputs
        for block in [] if scanned else blocks:
            h = block(h)
        h = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model(inputs, h), blocks

    (unrolled, blocks), (scanned, stack) = build(False), build(True)
    scan.stack_weights(blocks, stack)
    scanned.get_layer("head").set_weights(unrolled.get_layer("head").get_weights())
    return unrolled, blocks, scanned, stack


@pytest.mark.slow
class _TemplateCalls:
    """Spies on a scanned stack's template block: for each of its calls, whether a gradient was
    being taken (the step rebuilt in the backward loop) or not (the forward loop)."""

    def __init__(self, stack: scan.ScannedBlocks):
        self.during_gradient: list[bool] = []
        self._taking = False
        call = stack.template.call

        def counted(*args, **kwargs):
            self.during_gradient.append(self._taking)
            return call(*args, **kwargs)

        stack.template.call = counted

    @contextlib.contextmanager
    def taking_gradient(self):
        self._taking = True
        try:
            yield
        finally:
            self._taking = False


@pytest.mark.slow
def test_a_keras_hub_block_scanned_with_remat_matches_unrolled_in_every_mode_and_fit():
    """A block no one here wrote: each step rebuilt in the backward pass (the template is called
    while the gradient is taken), gradients equal to the unrolled blocks' with dropout on in
    eager, graph and XLA, and `model.fit(jit_compile=True)` ends on the same weights."""
    unrolled, blocks, scanned, stack = _hub_encoder_pair()
    assert remat.set_grad_checkpointing(scanned, policy="nothing_saveable") == [stack]
    template_calls = _TemplateCalls(stack)
    x = tf.random.stateless_normal((4, 8, 32), seed=[1, 2])
    y = tf.constant([0, 1, 2, 1])
    saved = [[v.numpy() for v in m.variables] for m in (unrolled, scanned)]

    def restore():
        for model, values in zip((unrolled, scanned), saved):
            for variable, value in zip(model.variables, values):
                variable.assign(value)

    def gradients(model):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            )
        with template_calls.taking_gradient():
            grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads

    trainable, _ = stack._ordered()
    for mode in ("eager", "graph", "xla"):
        restore()
        template_calls.during_gradient.clear()
        run = gradients if mode == "eager" else tf.function(gradients, jit_compile=mode == "xla")
        loss_u, grads_u = run(unrolled)
        run = gradients if mode == "eager" else tf.function(gradients, jit_compile=mode == "xla")
        loss_s, grads_s = run(scanned)
        rebuilt = template_calls.during_gradient
        assert rebuilt.count(True) == 1, (mode, rebuilt)  # the step, rebuilt once for all layers
        np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
        by_variable = {id(v): g for v, g in zip(unrolled.trainable_variables, grads_u)}
        by_variable.update({id(v): g for v, g in zip(scanned.trainable_variables, grads_s)})
        for k, stacked in enumerate(trainable):
            for i, block in enumerate(blocks):
                want = by_variable[id(block.trainable_variables[k])]
                np.testing.assert_allclose(by_variable[id(stacked)][i], want, atol=1e-6)
    restore()
    for model in (unrolled, scanned):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=True,
        )
        model.fit(x, y, epochs=2, batch_size=4, verbose=0, shuffle=False)
    for k, stacked in enumerate(trainable):
        for i, block in enumerate(blocks):
            np.testing.assert_allclose(stacked[i], block.trainable_variables[k], atol=1e-6)


class _ContextBlock(keras.layers.Layer):
    """A block whose call takes no `training`: its dropout reads it from the call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.dropout = keras.layers.Dropout(0.5, seed=3)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return x + self.dropout(tf.tanh(self.dense(x)))


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_block_without_a_training_argument_reads_it_from_the_call_context(mode):
    """Such a block scans as it runs unrolled: dropout on with `training=True` (the same masks,
    gradients equal to the unrolled blocks'), off with `training=False`."""
    keras.utils.set_random_seed(0)
    blocks = [_ContextBlock(name=f"b{i}") for i in range(3)]
    stack = scan.ScannedBlocks(lambda name: _ContextBlock(name=name), 3, "nothing_saveable")
    x = tf.random.stateless_normal((4, 8), seed=[1, 2])
    for block in blocks:
        block(x)
    stack(x)
    scan.stack_weights(blocks, stack)
    variables = [v for b in blocks for v in b.variables] + stack.variables
    start = [v.numpy() for v in variables]

    def unrolled(h, training):
        for block in blocks:
            h = block(h, training=training)
        return h

    def run(forward, training):
        for variable, value in zip(variables, start, strict=True):
            variable.assign(value)

        def gradients(x):
            with tf.GradientTape() as tape:
                y = forward(x, training=training)
                loss = tf.reduce_sum(y * y)
            return y, tape.gradient(loss, [b.dense.kernel for b in blocks] + [stack.stacked[0]])

        return tf.function(gradients, jit_compile=mode == "xla")(x)

    y_unrolled, grads = run(unrolled, True)
    y_scanned, scanned_grads = run(stack, True)
    np.testing.assert_allclose(y_scanned, y_unrolled, rtol=1e-6)
    assert np.mean(np.isclose(y_unrolled.numpy(), x.numpy())) > 0.3  # about half dropped
    trainable, _ = stack._ordered()
    assert trainable[0] is stack.stacked[0]  # the kernels
    for i, want in enumerate(grads[:3]):
        np.testing.assert_allclose(scanned_grads[-1][i], want, rtol=1e-5, atol=1e-6)
    y_unrolled, _ = run(unrolled, False)
    y_scanned, _ = run(stack, False)
    np.testing.assert_allclose(y_scanned, y_unrolled, rtol=1e-6)
    assert not np.any(np.isclose(y_unrolled.numpy(), x.numpy()))


class _LossBlock(keras.layers.Layer):
    """A block that adds losses three ways: a weight regularizer, an activity regularizer and
    `add_loss` (as a mixture-of-experts block adds its router's load-balancing loss)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(
            8,
            kernel_regularizer=keras.regularizers.L2(0.1),
            activity_regularizer=keras.regularizers.L1(0.01),
        )
        self.dropout = keras.layers.Dropout(0.2, seed=3)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x, training=None):
        h = self.dropout(tf.tanh(self.dense(x)), training=training)
        self.add_loss(tf.reduce_mean(h**2))
        return x + h


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("policy", [None, "nothing_saveable"])
def test_the_blocks_losses_become_the_scanned_layers_losses(mode, policy):
    """Each kind of loss the blocks add is one loss of the scanned layer, the sum over its
    blocks: the same total and gradients as the unrolled blocks (dropout on), and `fit` (which
    adds `model.losses`) ends on the same weights."""
    keras.utils.set_random_seed(0)
    blocks = [_LossBlock(name=f"b{i}") for i in range(3)]
    stack = scan.ScannedBlocks(lambda name: _LossBlock(name=name), 3, policy)
    unrolled, scanned = keras.Sequential(blocks), keras.Sequential([stack])
    x = tf.random.stateless_normal((4, 8), seed=[1, 2])
    unrolled(x), scanned(x)
    scan.stack_weights(blocks, stack)
    models = (unrolled, scanned)
    start = [[v.numpy() for v in m.variables] for m in models]

    def restore():
        for model, values in zip(models, start, strict=True):
            for variable, value in zip(model.variables, values, strict=True):
                variable.assign(value)

    # Whether the template's call runs while the gradient is taken: the step rebuilt, with its
    # losses, in the backward loop (remat) or not at all (TensorFlow's own loop gradient).
    template_calls = _TemplateCalls(stack)

    def gradients(model):
        def run(x):
            with tf.GradientTape() as tape:
                y = model(x, training=True)
                losses = model.losses
                loss = tf.reduce_sum(y) + tf.add_n(losses)
            with template_calls.taking_gradient():
                grads = tape.gradient(loss, model.trainable_variables)
            return loss, len(losses), grads

        return run if mode == "eager" else tf.function(run, jit_compile=mode == "xla")

    restore()
    loss_u, count_u, grads_u = gradients(unrolled)(x)
    loss_s, count_s, grads_s = gradients(scanned)(x)
    assert (count_u, count_s) == (9, 3)
    rebuilt = template_calls.during_gradient
    assert (True in rebuilt) == (policy is not None), rebuilt
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    trainable, _ = stack._ordered()
    by_variable = {id(v): g for v, g in zip(scanned.trainable_variables, grads_s, strict=True)}
    for k, stacked in enumerate(trainable):
        for i in range(len(blocks)):
            want = grads_u[i * len(trainable) + k]
            np.testing.assert_allclose(by_variable[id(stacked)][i], want, rtol=1e-5, atol=1e-6)
    if mode != "xla":
        return
    restore()
    for model in models:
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
        model.fit(x, tf.zeros_like(x), epochs=2, batch_size=4, verbose=0, shuffle=False)
    for k, stacked in enumerate(trainable):
        for i, block in enumerate(blocks):
            np.testing.assert_allclose(stacked[i], block.trainable_variables[k], atol=1e-6)


def test_eager_calls_after_calls_count_each_loss_once():
    """The template block runs outside any model call of its own, so Keras never clears what it
    remembers of earlier calls' losses; a new loss given the id of a freed one was counted twice
    (9 different totals in 30 eager calls, measured) until each step clears it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([scan.ScannedBlocks(lambda name: _LossBlock(name=name), 3)])
    x = tf.random.stateless_normal((4, 8), seed=[1, 2])
    model(x)
    start = [v.numpy() for v in model.variables]
    totals = set()
    for _ in range(30):
        for variable, value in zip(model.variables, start, strict=True):
            variable.assign(value)
        model(x, training=True)
        assert len(model.losses) == 3
        totals.add(float(tf.add_n(model.losses)))
    assert len(totals) == 1, totals


class _ConstrainedBlock(keras.layers.Layer):
    """A block whose kernel has a weight regularizer and a constraint."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(
            8,
            kernel_regularizer=keras.regularizers.L2(0.1),
            kernel_constraint=keras.constraints.MaxNorm(0.5),
        )

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return x + tf.tanh(self.dense(x))


def test_weight_regularizers_and_constraints_are_the_unrolled_blocks(monkeypatch):
    """Under mixed precision, a stack called twice per step: its weight regularizers count once
    (Keras computes them from the variables) in float32 on float32 weights, as the unrolled
    blocks' do; the loop gets the float32 stacks (each step's block casts its own slice); and
    the blocks' kernel constraint holds after `fit`, as it does unrolled."""
    seen = []
    scan_loop = remat.scan

    def recording(step, carry, xs, *args, **kwargs):
        seen.extend(x.dtype for x in xs)
        return scan_loop(step, carry, xs, *args, **kwargs)

    monkeypatch.setattr(scan.remat, "scan", recording)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(0)
        blocks = [_ConstrainedBlock(name=f"b{i}") for i in range(3)]
        stack = scan.ScannedBlocks(lambda name: _ConstrainedBlock(name=name), 3)
        inputs = keras.Input((8,))
        unrolled_out = scanned_out = inputs
        for _ in range(2):
            for block in blocks:
                unrolled_out = block(unrolled_out)
            scanned_out = stack(scanned_out)
        unrolled = keras.Model(inputs, unrolled_out)
        scanned = keras.Model(inputs, scanned_out)
        scan.stack_weights(blocks, stack)
        x = tf.random.stateless_normal((4, 8), seed=[1, 2])
        for model in (unrolled, scanned):
            model(x, training=True)
        assert seen and set(seen) == {tf.float32}, seen
        (regularized,) = scanned.losses
        assert regularized.dtype == tf.float32
        np.testing.assert_allclose(regularized, tf.add_n(unrolled.losses), rtol=1e-6)
        for model in (unrolled, scanned):
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            model.fit(x, tf.zeros_like(x), epochs=1, batch_size=4, verbose=0)
        (kernel,) = stack._ordered()[0][:1]
        norms = np.linalg.norm(kernel.numpy(), axis=1)  # each block's columns
        assert norms.max() <= 0.5 + 1e-6, norms
        for i, block in enumerate(blocks):
            np.testing.assert_allclose(kernel[i], block.dense.kernel, atol=1e-6)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_keras_hub_mixtral_blocks_scanned_keep_their_router_losses(mode):
    """keras-hub's Mixtral decoder blocks add their router's load-balancing loss in `call`:
    scanned, the loss total and the gradients equal the unrolled blocks' (dropout on)."""
    import keras_hub

    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=16, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, num_experts=4, top_k=2,
    )  # fmt: skip
    decoder = type(backbone.transformer_layers[0])  # the class, by its public model

    def make(name):
        return decoder(
            intermediate_dim=32, num_query_heads=2, num_key_value_heads=1, num_experts=4,
            top_k=2, router_aux_loss_coef=1.0, dropout=0.1, name=name,
        )  # fmt: skip

    keras.utils.set_random_seed(0)
    blocks = [make(f"b{i}") for i in range(3)]
    stack = scan.ScannedBlocks(make, 3, "nothing_saveable")
    unrolled, scanned = keras.Sequential(blocks), keras.Sequential([stack])
    x = tf.random.stateless_normal((2, 8, 16), seed=[1, 2])
    unrolled(x), scanned(x)
    scan.stack_weights(blocks, stack)
    results = []
    for model in (unrolled, scanned):
        keras.utils.set_random_seed(1)

        def run(x, model=model):
            with tf.GradientTape() as tape:
                y = model(x, training=True)
                router = tf.add_n(model.losses)
                loss = tf.reduce_sum(y * y) + router
            return router, loss, tape.gradient(loss, model.trainable_variables)

        results.append(tf.function(run, jit_compile=mode == "xla")(x))
    (router_u, loss_u, grads_u), (router_s, loss_s, grads_s) = results
    assert float(router_u) > 0.1  # the coefficient is 1: a loss that moves the gradients
    np.testing.assert_allclose(router_s, router_u, rtol=1e-5)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
    trainable, _ = stack._ordered()
    by_variable = {id(v): g for v, g in zip(scanned.trainable_variables, grads_s, strict=True)}
    for k, stacked in enumerate(trainable):
        for i in range(3):
            want = grads_u[i * len(trainable) + k]
            np.testing.assert_allclose(by_variable[id(stacked)][i], want, rtol=1e-4, atol=1e-5)


class _UnseededDropPath(keras.layers.Layer):
    """Drops the whole residual branch per example with an unseeded draw, which reads Keras'
    global seed generator (keras-hub's DINOv2 drop path does this)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x, training=None):
        keep = keras.random.uniform((tf.shape(x)[0], 1)) > 0.5
        return x + tf.where(keep, self.dense(x), 0.0)


class _TupleBlock(_ContextBlock):
    def call(self, x):
        return super().call(x), None


class _LazyBlock(keras.layers.Layer):
    """Makes its sublayer's variables in its first call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)

    def build(self, input_shape):
        pass

    def call(self, x):
        return x + self.dense(x)


class _HalfBuiltBlock(_LazyBlock):
    """Builds one sublayer in `build` and leaves another to its first call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(8)

    def build(self, input_shape):
        self.first.build(input_shape)

    def call(self, x):
        return super().call(self.first(x))


class _CrossBlock(_ContextBlock):
    def build(self, x_shape, context_shape=None):
        super().build(x_shape)

    def call(self, x, context=None):
        return super().call(x) if context is None else super().call(x) + context


@pytest.mark.parametrize("policy", [None, "nothing_saveable"])
def test_blocks_scan_cannot_run_raise_what_to_do(policy):
    """Blocks ScannedBlocks cannot run fail loudly with what to do, whatever the policy: one
    drawing from Keras' global seed generator (it would draw the same values at every step,
    silently without remat until now), one returning a tuple, ones making all or some of their
    variables in their call, and a cross-attention block built from a second input's shape."""
    x = tf.random.stateless_normal((4, 8), seed=[1, 2])
    unseeded = scan.ScannedBlocks(lambda name: _UnseededDropPath(name=name), 3, policy)
    with pytest.raises(remat.RematError, match="seed_generator_state.*give the layer a seed"):
        unseeded(x, training=True)
    with pytest.raises(ValueError, match="_TupleBlock.call returned tuple: wrap the block"):
        scan.ScannedBlocks(lambda name: _TupleBlock(name=name), 3, policy)(x)
    with pytest.raises(ValueError, match="_LazyBlock.build made none"):
        scan.ScannedBlocks(lambda name: _LazyBlock(name=name), 3, policy)(x)
    with pytest.raises(ValueError, match=r"_HalfBuiltBlock made variables in its call .*\(2 st"):
        scan.ScannedBlocks(lambda name: _HalfBuiltBlock(name=name), 3, policy)(x)
    cross = scan.ScannedBlocks(lambda name: _CrossBlock(name=name), 3, policy)
    cross(x)  # without the second input it runs
    with pytest.raises(ValueError, match=r"takes `context_shape` for the `context`.*build_shapes"):
        cross(x, context=x)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_keras_hub_cross_attention_decoders_scan_with_build_shapes(mode):
    """keras-hub's TransformerDecoder with cross-attention (BART's), built from the encoder
    output's shape given as `build_shapes`: outputs and gradients, the encoder output's
    included, equal the unrolled blocks' (dropout on, full remat)."""
    import keras_hub

    def make(name):
        return keras_hub.layers.TransformerDecoder(32, 2, dropout=0.1, name=name)

    keras.utils.set_random_seed(0)
    x = tf.random.stateless_normal((2, 6, 16), seed=[1, 2])
    encoded = tf.random.stateless_normal((2, 5, 16), seed=[3, 4])
    blocks = [make(f"b{i}") for i in range(3)]
    for block in blocks:
        block(x, encoder_sequence=encoded)
    stack = scan.ScannedBlocks(
        make, 3, "nothing_saveable", build_shapes={"encoder_sequence_shape": (None, 5, 16)}
    )
    stack(x, encoder_sequence=encoded)
    scan.stack_weights(blocks, stack)

    def unrolled(h, encoder_sequence, training):
        for block in blocks:
            h = block(h, encoder_sequence=encoder_sequence, training=training)
        return h

    def gradients(forward, variables):
        def run(x, encoded):
            with tf.GradientTape() as tape:
                tape.watch(encoded)
                y = forward(x, encoder_sequence=encoded, training=True)
                loss = tf.reduce_sum(y * y)
            return y, tape.gradient(loss, [encoded, *variables])

        return tf.function(run, jit_compile=mode == "xla")(x, encoded)

    results = [
        gradients(unrolled, [v for b in blocks for v in b.trainable_variables]),
        gradients(stack, stack.trainable_variables),
    ]
    (y_u, grads_u), (y_s, grads_s) = results
    np.testing.assert_allclose(y_s, y_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads_s[0], grads_u[0], rtol=1e-4, atol=1e-5)  # the encoder's
    trainable, _ = stack._ordered()
    by_variable = dict(zip([id(v) for v in stack.trainable_variables], grads_s[1:], strict=True))
    for k, stacked in enumerate(trainable):
        for i in range(3):
            want = grads_u[1 + i * len(trainable) + k]
            np.testing.assert_allclose(by_variable[id(stacked)][i], want, rtol=1e-4, atol=1e-5)
