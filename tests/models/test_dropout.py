"""framework.models.Dropout: Keras' dropout with a mask XLA fuses instead of storing."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import memory, remat
from framework.models import Dropout
from framework.models.dropout import keep_mask, keep_window, mask_key
from tests.memory.test_tpu import _sgd_step

# Integer ops on uint32 need kernels of each TensorFlow release: the whole module runs on 2.20 too.
pytestmark = pytest.mark.tf_compat

SHAPE = [512, 512]


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_masks_keep_one_minus_rate_and_are_uncorrelated(rate):
    mask = keep_mask(tf.TensorShape(SHAPE), rate, tf.constant([3, 7])).numpy().astype(float)
    values = mask.size
    sigma = np.sqrt(rate * (1 - rate) / values)
    assert abs(mask.mean() - (1 - rate)) < 5 * sigma
    # Five standard errors of a correlation over this many values: 0.01.
    bound = 5 / np.sqrt(values)
    flat = mask.ravel()
    for lag in (1, 2, 32, 128, 512, 4096):  # neighbours, rows, words, lanes
        assert abs(_correlation(flat[:-lag], flat[lag:])) < bound, lag
    for seed in ([3, 8], [4, 7]):  # the next call of the same layer, another layer
        other = keep_mask(tf.TensorShape(SHAPE), rate, tf.constant(seed)).numpy().astype(float)
        assert abs(_correlation(mask, other)) < bound, seed


def test_the_same_seed_gives_the_same_mask_in_eager_graph_and_xla():
    seed = tf.constant([11, 2], tf.int64)

    def draw(s):
        return keep_mask(tf.TensorShape([64, 33]), 0.3, s)

    eager = draw(seed).numpy()
    assert not eager.all() and eager.any()
    np.testing.assert_array_equal(tf.function(draw)(seed), eager)
    np.testing.assert_array_equal(tf.function(draw, jit_compile=True)(seed), eager)
    assert not np.array_equal(draw(seed + [0, 1]).numpy(), eager)


def _numpy_keep(flat_index: np.ndarray, rate: float, key: np.ndarray) -> np.ndarray:
    """The module's hash written again in numpy: the reference for positions past 2**31."""

    def mix(x):
        x = x.astype(np.uint64)
        for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):
            x ^= x >> shift
            if multiplier is not None:
                x = (x * multiplier) & 0xFFFFFFFF
        return x

    bits = mix(mix((flat_index + int(key[0])) & 0xFFFFFFFF) ^ int(key[1]))
    return bits >= round(rate * 2**32)


def test_a_window_of_a_tensor_of_more_than_2_31_values_has_its_own_positions():
    """Blockwise attention draws the mask of [batch, heads, S, S] chunk by chunk: the window's
    bits are those of its positions in the whole, past 2**31 too (the whole is never built)."""
    shape = tf.TensorShape([4, 16, 2**13, 2**13])  # 2**32 values
    begin, size = [3, 15, 2**13 - 8, 2**13 - 16], [1, 1, 8, 16]
    key = mask_key(tf.constant([5, 6]))
    got = keep_window(shape, (begin, size), 0.3, key).numpy()
    index = np.ravel_multi_index(
        np.meshgrid(*[np.arange(b, b + n) for b, n in zip(begin, size)], indexing="ij"),
        tuple(shape),
    )
    assert index.max() == 2**32 - 1
    np.testing.assert_array_equal(got, _numpy_keep(index, 0.3, key.numpy()))
    whole = keep_mask(tf.TensorShape([2, 3, 5, 7]), 0.3, tf.constant([5, 6])).numpy()
    window = keep_window(tf.TensorShape([2, 3, 5, 7]), ([1, 0, 2, 3], [1, 3, 2, 4]), 0.3, key)
    np.testing.assert_array_equal(window.numpy(), whole[1:2, :, 2:4, 3:7])


def test_a_tensor_past_the_index_range_is_refused():
    with pytest.raises(ValueError, match="at most 4294967296"):
        keep_mask(tf.TensorShape([2**16, 2**16 + 1]), 0.1, tf.constant([1, 2]))


def test_the_layer_behaves_as_keras_dropout():
    layer = Dropout(0.25, seed=3)
    x = tf.random.stateless_normal([16, 64], seed=[1, 2]) + 3.0
    np.testing.assert_array_equal(layer(x), x)  # inference: the inputs
    state = layer.seed_generator.state.numpy().copy()
    y = layer(x, training=True).numpy()
    kept = y != 0
    np.testing.assert_allclose(y[kept], x.numpy()[kept] / 0.75, rtol=1e-6)
    assert 0.6 < kept.mean() < 0.9
    # One seed-generator step per call, as Keras' layer: a resumed run draws the same masks.
    np.testing.assert_array_equal(layer.seed_generator.state.numpy(), state + [0, 1])
    assert not np.array_equal(layer(x, training=True).numpy() != 0, kept)
    rebuilt = Dropout.from_config(layer.get_config())
    assert (rebuilt.rate, rebuilt.seed) == (0.25, 3)
    # The same variables as Keras' layer, so checkpoints written with either restore into both.
    assert isinstance(layer, keras.layers.Dropout)
    assert [(v.name, v.dtype) for v in layer.variables] == [
        (v.name, v.dtype) for v in keras.layers.Dropout(0.25, seed=3).variables
    ]


def test_a_noise_shape_and_an_unknown_batch():
    layer = Dropout(0.5, noise_shape=(None, 1, 8), seed=1)

    @tf.function(input_signature=[tf.TensorSpec([None, 4, 8])])
    def apply(x):
        return layer(x, training=True)

    y = apply(tf.ones([6, 4, 8])).numpy()
    # One mask value per (example, column), shared along the axis of size 1 in noise_shape.
    assert (y == y[:, :1, :]).all()
    assert set(np.unique(y)) == {0.0, 2.0}


class Block(keras.layers.Layer):
    """A residual MLP written the ordinary Keras way: dropout takes `training` from the call
    context."""

    def __init__(self, width: int, dropout: type = Dropout, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4 * width, activation="gelu")
        self.down = keras.layers.Dense(width)
        self.drop = dropout(0.2, seed=4)

    def call(self, x):
        return x + self.drop(self.down(self.drop(self.up(x))))


def _model(width: int = 16, depth: int = 2, dropout: type = Dropout) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([Block(width, dropout, name=f"block{i}") for i in range(depth)])
    model.build((None, width))
    return model


def _gradients(model: keras.Model, x: tf.Tensor, mode: str) -> list[np.ndarray]:
    def grads(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, [x, *model.trainable_variables])

    if mode != "eager":
        grads = tf.function(grads, jit_compile=mode == "xla")
    return [g.numpy() for g in grads(x)]


def _counted(regions: list) -> list[int]:
    """Counts the Python runs of the checkpointed regions: forward passes and recomputations."""
    runs = [0]
    for region in regions:

        def counted(*args, _fn=region.call.fn, **kwargs):
            runs[0] += 1
            return _fn(*args, **kwargs)

        region.call.fn = counted
    return runs


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("policy", ["nothing_saveable", "random_masks_saveable", "dots_saveable"])
def test_remat_replays_the_masks(policy, mode):
    model = _model()
    x = tf.random.stateless_normal([8, 16], seed=[5, 6])
    state = [v.numpy() for v in model.variables]  # weights and seed states
    want = _gradients(model, x, mode)
    regions = remat.set_grad_checkpointing(model, policy=policy)
    assert len(regions) == 2
    runs = _counted(regions)
    for variable, value in zip(model.variables, state, strict=True):
        variable.assign(value)
    got = _gradients(model, x, mode)
    assert runs[0] >= 4  # each block's forward pass and its recomputation
    for g, w in zip(got, want, strict=True):  # masks drawn anew: an error near 1
        assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w)


def test_fit_with_remat_ends_on_the_weights_of_fit_without():
    x = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(32, 16)).astype(np.float32)

    def fitted(with_remat: bool) -> tuple[list[np.ndarray], int]:
        model = _model()  # the same weights and seed states each time
        runs = [0]
        if with_remat:
            runs = _counted(remat.set_grad_checkpointing(model, policy="nothing_saveable"))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=True)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return [v.numpy() for v in model.variables], runs[0]

    want, _ = fitted(False)
    got, runs = fitted(True)
    assert runs >= 4
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_random_masks_saveable_keeps_the_masks_as_bits():
    block = _model(depth=1).layers[0]
    remat.checkpoint(block, "random_masks_saveable")
    x = tf.random.stateless_normal([64, 16], seed=[5, 6])
    rows = remat.saved_residuals(lambda x: tf.reduce_sum(block(x, training=True) ** 2), x)
    # Masks of [64, 64] and [64, 16] values: two words per column.
    kept = [(r.dtype, r.shape) for r in rows if r.dtype in ("bool", "uint32")]
    assert kept == [("uint32", (2, 64)), ("uint32", (2, 16))]

    def unknown_batch(x):
        x = tf.compat.v1.placeholder_with_default(x, [None, 16])
        return tf.reduce_sum(block(x, training=True) ** 2)

    # A mask drawn over tf.shape(x) is still found (kept as booleans: its size is not static).
    rows = remat.saved_residuals(unknown_batch, x)
    assert [r.dtype for r in rows if r.dtype in ("bool", "uint32")] == ["bool", "bool"]


@pytest.mark.parametrize("dropout, masks", [(Dropout, 0), (keras.layers.Dropout, 2)])
def test_the_budget_keeps_only_masks_drawn_at_full_size(dropout, masks):
    """A whole budget keeps what the backward pass reads, but not a hashed mask: XLA fuses its
    redraw into every consumer, so keeping it would add memory and time; a mask compared from
    a full-size draw is kept, as bits."""
    block = _model(depth=1, dropout=dropout).layers[0]
    remat.checkpoint(block, "budget:1")
    x = tf.random.stateless_normal([64, 16], seed=[5, 6])
    rows = remat.saved_residuals(lambda x: tf.reduce_sum(block(x, training=True) ** 2), x)
    assert any(r.dtype == "float32" for r in rows), rows  # the budget keeps something
    assert sum(r.dtype in ("bool", "uint32") for r in rows) == masks, rows


def test_xla_stores_no_mask_without_remat():
    """XLA:CPU's plan of a step without remat: Keras' dropout keeps each mask until the backward
    pass, this one is recomputed where it is read."""
    batch, width = 1024, 64
    x = tf.TensorSpec([batch, width])
    ours = memory.compiled_bytes(_sgd_step(_model(width)), x)
    theirs = memory.compiled_bytes(_sgd_step(_model(width, dropout=keras.layers.Dropout)), x)
    masks = 2 * batch * (4 * width + width)  # values of both blocks' two masks
    assert ours.temp_bytes <= theirs.temp_bytes - masks  # at least a byte per mask value


@pytest.mark.parametrize(
    "dropout, low, high", [(Dropout, 10, 60), (keras.layers.Dropout, 1000, 1010)]
)
def test_the_budget_prices_a_hashed_mask_at_its_few_operations(dropout, low, high):
    """A mask hashed from two random words costs a few dozen FLOPs per value to recompute
    (against 1000 for one compared from a full-size draw), so `budget:F` does not keep it in place
    of a product that is dearer to recompute."""
    block = _model(depth=1, dropout=dropout).layers[0]
    masks = []

    def spy(op: remat.OpInfo) -> bool:
        if op.random and op.dtypes == (tf.bool,):
            masks.append(op.random_flops)
        return False

    remat.checkpoint(block, spy)
    remat.saved_residuals(lambda x: tf.reduce_sum(block(x, training=True)), tf.ones([8, 16]))
    assert len(masks) == 2 and all(low <= f <= high for f in masks), masks
