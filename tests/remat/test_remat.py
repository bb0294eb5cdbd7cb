"""Tests for framework.remat: gradients equal to no remat (dropout on), API, errors, XLA, residuals.

Tests that need a fresh process (BFC allocator, logical devices) are in test_remat_subprocess.py.
The small transformer-like `Block` here is also used by those subprocess scenarios.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import memory, remat
from framework.remat import policies

TOL = 1e-5


class Block(keras.layers.Layer):
    """Pre-norm transformer-like block: LayerNorm, einsum attention, MLP, three Dropouts.

    `Block.calls` counts the Python calls of `call`: a checkpointed block runs once for the
    forward pass and once for the recomputation (per trace), a plain one once.
    """

    calls = 0

    def __init__(self, d: int = 16, heads: int = 2, rate: float = 0.2, tagged: bool = True, **kw):
        super().__init__(**kw)
        self.d, self.h, self.rate, self.tagged = d, heads, rate, tagged
        self.ln1 = keras.layers.LayerNormalization()
        self.ln2 = keras.layers.LayerNormalization()
        self.qkv = keras.layers.Dense(3 * d)
        self.proj = keras.layers.Dense(d)
        self.fc1 = keras.layers.Dense(4 * d, activation="gelu")
        self.fc2 = keras.layers.Dense(d)
        self.drop = keras.layers.Dropout(rate, seed=3)

    def call(self, x, training=None):
        Block.calls += 1
        b, s = tf.shape(x)[0], tf.shape(x)[1]
        qkv = tf.reshape(self.qkv(self.ln1(x)), [b, s, 3, self.h, self.d // self.h])
        q, k, v = tf.unstack(qkv, axis=2)
        a = tf.nn.softmax(tf.einsum("bqhd,bkhd->bhqk", q, k) / 4.0)
        a = self.drop(a, training=training)
        o = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", a, v), [b, s, self.d])
        if self.tagged:
            o = remat.checkpoint_name(o, "attn_out")
        x = x + self.drop(self.proj(o), training=training)
        h = self.fc1(self.ln2(x))
        if self.tagged:
            h = remat.checkpoint_name(h, "mlp_hidden")
        return x + self.drop(self.fc2(h), training=training)

    def get_config(self):
        return {**super().get_config(), "d": self.d, "heads": self.h, "rate": self.rate}


def rel_err(got, want) -> float:
    errs = []
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=False):
        assert a is not None and b is not None
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return max(errs)


ALL_POLICIES = [
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    policies.save_only_these_names("attn_out"),
    policies.save_any_names_but_these("attn_out"),
    lambda op: op.op_type in ("Softmax", "Erf") or op.name == "mlp_hidden",
    "random_masks_saveable",
    "dots_saveable+random_masks_saveable",
    "budget:0.3",
]
POLICY_IDS = [
    "everything",
    "nothing",
    "dots",
    "dots_no_batch",
    "only_names",
    "but_names",
    "custom",
    "masks",
    "dots+masks",
    "budget",
]


def make_stack(n: int = 1, d: int = 16, seq: int = 8, batch: int = 2):
    keras.utils.set_random_seed(1)
    blocks = [Block(d=d, name=f"block{i}") for i in range(n)]
    x = tf.random.normal((batch, seq, d))
    for blk in blocks:
        blk(x)
    return blocks, x


def stack_step(blocks, mode: str):
    variables = [v for blk in blocks for v in blk.trainable_variables]

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for blk in blocks:
                y = blk(y, training=True)
            loss = tf.reduce_sum(y * y)
        return [loss] + tape.gradient(loss, [x] + variables)

    if mode == "graph":
        return tf.function(step)
    if mode == "xla":
        return tf.function(step, jit_compile=True)
    return step


def seed_states(blocks):
    return [blk.drop.seed_generator.state.numpy().tolist() for blk in blocks]


def reset_seeds(blocks):
    for blk in blocks:
        blk.drop.seed_generator.state.assign([3, 0])


@pytest.fixture(scope="module")
def stack():
    return make_stack(n=1)


@pytest.mark.slow
@pytest.mark.tf_compat
@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_every_policy_matches_no_remat_with_dropout(stack, mode):
    blocks, _ = stack
    x = tf.random.normal((2, 8, 16), seed=7)
    for blk in blocks:
        remat.checkpoint(blk, None)
    reset_seeds(blocks)
    want = stack_step(blocks, mode)(x)
    want_states = seed_states(blocks)
    reset_seeds(blocks)
    no_dropout = stack_step(blocks, mode)
    for blk in blocks:
        blk.drop.rate = 0.0
    assert abs(float(no_dropout(x)[0]) - float(want[0])) > 1e-3, "dropout must be active"
    for blk in blocks:
        blk.drop.rate = 0.2
    for policy, pid in zip(ALL_POLICIES, POLICY_IDS, strict=False):
        for blk in blocks:
            remat.checkpoint(blk, policy)
        reset_seeds(blocks)
        before = Block.calls
        got = stack_step(blocks, mode)(x)
        runs = 1 if pid == "everything" else 2  # the recomputation runs the block again
        assert Block.calls - before == runs * len(blocks), (mode, pid, Block.calls - before)
        assert rel_err(got, want) < TOL, (mode, pid, rel_err(got, want))
        assert seed_states(blocks) == want_states, "RNG state must advance once per call"
    for blk in blocks:
        remat.checkpoint(blk, None)


def test_function_signature_kwargs_nested_ints_and_variables():
    w = tf.Variable(tf.random.normal((4, 4), seed=1))
    seed = tf.constant([5, 6])

    calls = []

    def fn(x, pair, *, scale, mask=None, repeat=2, flag=True):
        calls.append(1)
        a, b = pair
        h = x @ w
        for _ in range(repeat):
            h = tf.tanh(h) * scale
        h = tf.nn.experimental.stateless_dropout(h, 0.3, seed=seed)
        ids = tf.cast(mask, tf.int32) * 2
        return {"h": h + a, "parts": (h * b, ids), "flag": flag, "none": None}

    def loss_of(out):
        return tf.reduce_sum(out["h"] ** 2) + tf.reduce_sum(out["parts"][0])

    x = tf.random.normal((3, 4), seed=2)
    a, b = tf.random.normal((3, 4), seed=3), tf.random.normal((3, 4), seed=4)
    mask = tf.constant([[True, False, True, True]] * 3)
    wrapped = remat.checkpoint(fn, "dots_saveable")

    def grads(f, tape_mode):
        def run():
            with tf.GradientTape() as tape:
                tape.watch([x, a, b])
                out = f(x, (a, b), scale=tf.constant(0.5), mask=mask, repeat=3)
                loss = loss_of(out)
            assert out["flag"] is True and out["none"] is None
            assert out["parts"][1].dtype == tf.int32
            return out["parts"][1], tape.gradient(loss, [x, a, b, w])

        return tf.function(run)() if tape_mode == "graph" else run()

    for mode in ("eager", "graph"):
        ids_ref, g_ref = grads(fn, mode)
        calls.clear()
        ids, g = grads(wrapped, mode)
        assert len(calls) == 2, (mode, len(calls))  # forward pass and recomputation
        np.testing.assert_array_equal(ids, ids_ref)
        assert rel_err(g, g_ref) < TOL


def test_keyword_only_call_gets_gradients_in_eager():
    calls = []

    def body(*, x):
        calls.append(1)
        return tf.sin(x) * x

    wrapped = remat.checkpoint(body)
    x = tf.constant([0.5, 1.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = wrapped(x=x)
    g = tape.gradient(y, x)
    assert g is not None and len(calls) == 2
    np.testing.assert_allclose(g, np.cos(x) * x + np.sin(x), rtol=1e-6)


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_nested_checkpoints_and_keras_random(policy):
    gen = keras.random.SeedGenerator(11)
    w1 = tf.Variable(tf.random.normal((8, 8), seed=5))
    w2 = tf.Variable(tf.random.normal((8, 8), seed=6))

    calls = {"inner": 0, "outer": 0}

    def inner(h):
        calls["inner"] += 1
        h = tf.nn.relu(h @ w2)
        return keras.random.dropout(h, 0.5, seed=gen)

    def outer_with(inner_fn):
        def outer(x):
            calls["outer"] += 1
            h = tf.tanh(x @ w1)
            h = inner_fn(h) + keras.random.normal(tf.shape(h), seed=gen) * 0.1
            return inner_fn(h)

        return outer

    x = tf.random.normal((4, 8), seed=8)

    @tf.function
    def run(f):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(f(x) ** 2)
        return [loss] + tape.gradient(loss, [x, w1, w2])

    gen.state.assign([11, 0])
    want = run(outer_with(inner))
    state = gen.state.numpy().tolist()
    gen.state.assign([11, 0])
    nested = remat.checkpoint(outer_with(remat.checkpoint(inner, policy)), policy)
    calls.update(inner=0, outer=0)
    got = run(nested)
    # The outer region runs twice; each of its two inner calls runs in the outer forward pass,
    # in the outer recomputation and in its own recomputation.
    assert calls == {"inner": 6, "outer": 2}, calls
    assert rel_err(got, want) < TOL
    assert gen.state.numpy().tolist() == state


def test_stateful_random_op_is_a_clear_error():
    wrapped = remat.checkpoint(lambda x: tf.nn.dropout(x, 0.5))
    x = tf.ones((4, 4))
    with pytest.raises(remat.UnreplayableRandomOpError, match="RandomUniform"):
        with tf.GradientTape() as tape:
            tape.watch(x)
            wrapped(x)


def test_determinism_check_names_first_difference():
    calls = []

    def fn(x):
        calls.append(1)
        return tf.exp(x) if len(calls) == 1 else tf.sigmoid(x)

    wrapped = remat.checkpoint(fn)

    @tf.function(autograph=False)
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = wrapped(x)
        return tape.gradient(y, x)

    with pytest.raises(remat.RecomputationMismatchError, match=r"op #0.*Exp.*Sigmoid"):
        run(tf.ones((2, 3)))


def test_policy_resolution_and_predicates():
    assert remat.get_policy("full") is policies.nothing_saveable
    assert remat.get_policy("dots") is policies.dots_saveable
    assert remat.get_policy(None) is policies.everything_saveable
    assert remat.get_policy("none") is policies.everything_saveable
    assert remat.get_policy("Dots_Saveable") is policies.dots_saveable
    with pytest.raises(ValueError, match="dots_with_no_batch_dims_saveable"):
        remat.get_policy("dot")

    def einsum(eq):
        attr = tf.compat.v1.AttrValue(s=eq.encode())
        return remat.OpInfo("Einsum", ((1,),), (tf.float32,), attrs=("equation", attr))

    no_batch = policies.dots_with_no_batch_dims_saveable
    assert no_batch(einsum("bsd,df->bsf")) and not no_batch(einsum("bhqd,bhkd->bhqk"))
    assert no_batch(remat.OpInfo("BatchMatMulV2", (), (), input_shapes=((2, 3, 4), (4, 5))))
    assert not no_batch(remat.OpInfo("BatchMatMulV2", (), (), input_shapes=((2, 3, 4), (2, 4, 5))))
    only = policies.save_only_these_names("a")
    assert only(remat.OpInfo("Identity", (), (), name="a"))
    assert not only(remat.OpInfo("Identity", (), (), name="b"))

    mask = remat.OpInfo("GreaterEqual", ((4,),), (tf.bool,), random=True)
    relu_mask = remat.OpInfo("Greater", ((4,),), (tf.bool,))
    random_floats = remat.OpInfo("StatelessRandomUniformV2", ((4,),), (tf.float32,), random=True)
    masks = policies.random_masks_saveable
    assert masks(mask) and not masks(relu_mask) and not masks(random_floats)
    both = remat.get_policy(" dots_saveable + random_masks_saveable")
    assert both(mask) and both(remat.OpInfo("MatMul", (), ())) and not both(random_floats)
    with pytest.raises(ValueError, match="join them with"):
        remat.get_policy("dots_saveable+masks")


@pytest.fixture(scope="module")
def optimized_hlo() -> Callable[[str], str]:
    """The optimized HLO of a 2-block XLA step under a policy; each policy's is compiled once for
    the module (the tests below count in the same programs)."""
    blocks, x = make_stack(n=2)

    @functools.cache
    def hlo(policy: str) -> str:
        for blk in blocks:
            remat.checkpoint(blk, policy)
        return stack_step(blocks, "xla").experimental_get_compiler_ir(x)(stage="optimized_hlo")

    return hlo


def _count_in_optimized_hlo(
    optimized_hlo: Callable[[str], str], pattern: str, policies_to_try: tuple[str, ...]
) -> dict[str, int]:
    """How often `pattern` occurs in the optimized HLO of a 2-block XLA step, per policy."""
    return {policy: len(re.findall(pattern, optimized_hlo(policy))) for policy in policies_to_try}


@pytest.mark.slow
@pytest.mark.tf_compat
def test_xla_keeps_recomputation_and_saved_dots(optimized_hlo):
    counts = _count_in_optimized_hlo(
        optimized_hlo, r"\bdot\(", ("everything_saveable", "nothing_saveable", "dots_saveable")
    )
    assert counts["dots_saveable"] == counts["everything_saveable"], counts
    assert counts["nothing_saveable"] > counts["everything_saveable"], counts


@pytest.mark.slow
def test_random_masks_saved_as_bits_and_never_regenerated(optimized_hlo):
    rng_calls = _count_in_optimized_hlo(
        optimized_hlo,
        r"to_apply=%rng",
        ("everything_saveable", "nothing_saveable", "random_masks_saveable"),
    )
    assert rng_calls["everything_saveable"] > 0, rng_calls
    assert rng_calls["nothing_saveable"] == 2 * rng_calls["everything_saveable"], rng_calls
    assert rng_calls["random_masks_saveable"] == rng_calls["everything_saveable"], rng_calls

    blocks, x = make_stack(n=1)
    blk = blocks[0]
    remat.checkpoint(blk, "random_masks_saveable")
    rows = remat.saved_residuals(lambda x: tf.reduce_sum(blk(x, training=True) ** 2), x)
    # Three dropout calls of [2, 2, 8, 8], [2, 8, 16] and [2, 8, 16] values: 32 rows of 8 columns,
    # and twice 16 rows, too few for a word, so 256 rows of 1 column: 8 uint32 words each.
    kept = [(r.dtype, r.bytes) for r in rows if r.dtype in ("bool", "uint8", "uint32")]
    assert kept == [("uint32", 32)] * 3
    remat.checkpoint(blk, None)


# (shape, bytes kept): rank 1; too few rows for a 32-bit word (one column); 33 and 40 rows
# padded to 64.
@pytest.mark.parametrize(
    "shape, kept_bytes", [((5,), 4), ((3, 5, 7), 16), ((33, 2), 16), ((40, 3), 24)]
)
def test_kept_masks_of_any_shape_give_no_remat_gradients(shape, kept_bytes):
    x = tf.random.normal(shape, seed=7)

    def fn(x):
        return tf.nn.experimental.stateless_dropout(tf.sin(x), 0.5, seed=[1, 2]) * x

    wrapped = remat.checkpoint(fn, "random_masks_saveable")
    rows = remat.saved_residuals(lambda x: tf.reduce_sum(wrapped(x)), x)
    assert [r.bytes for r in rows if r.dtype == "uint32"] == [kept_bytes]

    def grad(f):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(f(x) ** 2)
        return tape.gradient(loss, x)

    for jit_compile in (False, True):
        got = tf.function(lambda: grad(wrapped), jit_compile=jit_compile)()
        want = tf.function(lambda: grad(fn), jit_compile=jit_compile)()
        assert rel_err(got, want) < TOL


@pytest.mark.slow
def test_full_remat_holds_one_regions_random_bits_at_a_time():
    """Forward seeds are tied to each region's input: XLA cannot draw all regions' bits first."""
    blocks, x = make_stack(n=8, d=64, seq=128, batch=8)
    for blk in blocks:
        remat.checkpoint(blk, "nothing_saveable")
    temp = {}
    for rate in (0.2, 0.0):
        for blk in blocks:
            blk.drop.rate = rate
        temp[rate] = memory.compiled_bytes(stack_step(blocks, "xla"), x).temp_bytes
    for blk in blocks:
        blk.drop.rate = 0.2
        remat.checkpoint(blk, None)
    # One block draws 4 random bytes for each of 8*4*128*128 + 2*8*128*64 dropout values.
    one_block_bits = 4 * (8 * 4 * 128 * 128 + 2 * 8 * 128 * 64)
    assert temp[0.2] - temp[0.0] <= 1.1 * one_block_bits, (temp, one_block_bits)


def test_saved_residuals_reports_what_the_policy_keeps(capsys):
    blocks, x = make_stack(n=1)
    blk = blocks[0]

    def loss(x):
        return tf.reduce_sum(blk(x, training=True) ** 2)

    def activation_bytes(policy):
        remat.checkpoint(blk, policy)
        rows = remat.saved_residuals(loss, x)
        return rows, sum(r.bytes for r in rows if r.kind == "activation")

    rows_all, full = activation_bytes("everything_saveable")
    rows_none, none = activation_bytes("nothing_saveable")
    rows_dots, dots = activation_bytes("dots_saveable")
    rows_names, _ = activation_bytes(policies.save_only_these_names("attn_out"))
    assert none < dots < full
    assert any(r.kind == "argument" and r.shape == (2, 8, 16) for r in rows_none)
    assert not any("Einsum" in r.origin for r in rows_none)
    assert any("Einsum" in r.origin for r in rows_dots)
    assert any("checkpoint_name 'attn_out'" in r.origin for r in rows_names)
    assert all(r.bytes == int(np.prod(r.shape)) * tf.as_dtype(r.dtype).size for r in rows_all)
    remat.print_saved_residuals(loss, x)
    printed = capsys.readouterr().out
    assert "total:" in printed and "bytes" in printed
    remat.checkpoint(blk, None)


@pytest.mark.parametrize(
    "policy",
    [
        policies.save_only_these_names("attn_out", "atn_out"),
        policies.save_any_names_but_these("atn_out"),
        policies.save_from_both_policies(
            policies.dots_saveable, policies.save_only_these_names("atn_out")
        ),
    ],
)
def test_a_policy_name_no_tag_gives_warns_and_one_that_all_give_does_not(policy):
    blocks, x = make_stack(n=1)
    blk = remat.checkpoint(blocks[0], policy)

    def loss(x):
        return tf.reduce_sum(blk(x, training=True) ** 2)

    with pytest.warns(
        remat.UnmatchedNameWarning, match=r"\['atn_out'\].*tags \['attn_out', 'mlp_hidden'\]"
    ):
        remat.saved_residuals(loss, x)
    remat.checkpoint(blk, policies.save_only_these_names("attn_out"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat.UnmatchedNameWarning)
        rows = remat.saved_residuals(loss, x)
    assert any("checkpoint_name 'attn_out'" in r.origin for r in rows)


def _functional(n_blocks=2):
    inp = keras.Input((8, 16))
    h = keras.layers.Dense(16, name="embed")(inp)
    for i in range(n_blocks):
        h = Block(name=f"blk{i}")(h)
    out = keras.layers.Dense(1, name="head")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inp, out)


class Subclassed(keras.Model):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.embed = keras.layers.Dense(16)
        self.blocks = [Block(name=f"sblk{i}") for i in range(2)]
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.head = keras.layers.Dense(1)

    def call(self, x, training=None):
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h, training=training)
        return self.head(self.pool(h))


def _sequential():
    return keras.Sequential(
        [
            keras.Input((8, 16)),
            keras.layers.Dense(16),
            Block(name="q0"),
            Block(name="q1"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )


def _fit_weights(build, remat_kwargs, jit_compile):
    keras.utils.set_random_seed(2)
    model = build()
    model(np.zeros((1, 8, 16), np.float32))
    if remat_kwargs is not None:
        remat.set_grad_checkpointing(model, **remat_kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(8, 8, 16)).astype(np.float32)
    ys = rng.normal(size=(8, 1)).astype(np.float32)
    model.fit(xs, ys, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model, [v.numpy() for v in model.trainable_variables]


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_functional_matches_no_remat(jit_compile):
    _, want = _fit_weights(_functional, None, jit_compile)
    model, got = _fit_weights(_functional, {"policy": "dots_saveable"}, jit_compile)
    assert sorted(layer.name for layer in remat.checkpointed_layers(model)) == ["blk0", "blk1"]
    assert rel_err(got, want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("build", [_sequential, Subclassed], ids=["sequential", "subclassed"])
def test_fit_sequential_and_subclassed_match_no_remat(build):
    _, want = _fit_weights(build, None, True)
    model, got = _fit_weights(build, {"policy": "full"}, True)
    assert len(remat.checkpointed_layers(model)) == 2
    assert all(isinstance(layer, Block) for layer in remat.checkpointed_layers(model))
    assert rel_err(got, want) < TOL


@pytest.mark.slow
def test_set_grad_checkpointing_selection_undo_and_serialization(tmp_path):
    model = _functional(3)
    model(np.zeros((1, 8, 16), np.float32))
    chosen = remat.set_grad_checkpointing(model, layers=["blk1", "head"])
    assert sorted(layer.name for layer in chosen) == ["blk1", "head"]
    chosen = remat.set_grad_checkpointing(model, layers=keras.layers.Dense)
    assert {"embed", "head"} < {layer.name for layer in chosen} and len(chosen) == 2 + 3 * 4
    chosen = remat.set_grad_checkpointing(model, layers=lambda layer: layer.name == "blk2")
    assert [layer.name for layer in chosen] == ["blk2"]
    with pytest.raises(ValueError, match="nope"):
        remat.set_grad_checkpointing(model, layers=["nope"])
    x = np.random.default_rng(1).normal(size=(2, 8, 16)).astype(np.float32)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros((2, 1), np.float32), verbose=0)
    assert model.train_function is not None
    remat.set_grad_checkpointing(model, policy="dots")
    assert model.train_function is None, "compiled functions must be retraced with remat"
    model.fit(x, np.zeros((2, 1), np.float32), verbose=0)
    before = model(x).numpy()
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"Block": Block})
    np.testing.assert_allclose(loaded(x).numpy(), before, rtol=1e-6)
    assert remat.set_grad_checkpointing(model, enable=False) == []
    assert remat.checkpointed_layers(model) == []
    assert type(model.get_layer("blk0")).call is Block.call
    assert "call" not in model.get_layer("blk0").__dict__
    np.testing.assert_allclose(model(x).numpy(), before, rtol=1e-6)


def test_checkpoint_names_can_be_left_out_of_a_graph():
    def graph_text() -> str:
        traced = tf.function(lambda x: remat.checkpoint_name(x * 2, "h"))
        return str(traced.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def())

    assert "_remat_checkpoint_name" in graph_text()
    with remat.without_checkpoint_names():
        assert "_remat_checkpoint_name" not in graph_text()
    assert "_remat_checkpoint_name" in graph_text()


class _GeluBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.runs = 0
        self.up = keras.layers.Dense(64, activation="gelu")
        self.down = keras.layers.Dense(16)
        self.drop = keras.layers.Dropout(0.2)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x, training=False):
        self.runs += 1
        return self.norm(x + self.drop(self.down(self.up(x)), training=training))


# The Grappler passes that fuse or rewrite a region's bfloat16 ops otherwise than the plain
# step's (docs/remat.md, "Limitations").
_REWRITES_OFF = {"remapping": False, "arithmetic_optimization": False}


def _gemma3():
    import keras_hub

    model = keras_hub.models.Gemma3Backbone(
        vocabulary_size=50, num_layers=2, image_size=16, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8,
        vision_encoder=None, dropout=0.2, sliding_window_size=4,
        use_sliding_window_attention=True,
    )  # fmt: skip
    tokens = tf.random.stateless_uniform((2, 8), [1, 2], 1, 50, tf.int32)
    return model, {"token_ids": tokens, "padding_mask": tf.ones((2, 8), tf.int32)}


@pytest.mark.parametrize("name", ["gelu_blocks", "gemma3"])
def test_bfloat16_in_a_tf_function_is_bit_identical_without_grapplers_rewrites(name, monkeypatch):
    """The documented cause of mixed-precision differences outside XLA: Grappler's remapper
    (MatMul + bias + GELU) and arithmetic optimizer (keras-hub Gemma3's bfloat16 casts) rewrite
    a region otherwise than the plain step. With both off, remat is exact to the bit, dropout
    on; each block ran twice (forward pass and recomputation)."""
    previous = tf.config.optimizer.get_experimental_options()  # lists options set, not defaults
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    tf.config.optimizer.set_experimental_options(_REWRITES_OFF)
    runs = []
    try:
        keras.utils.set_random_seed(0)
        if name == "gemma3":
            model, x = _gemma3()
            block_class = type(model.get_layer("decoder_block_0"))
            call = block_class.call
            monkeypatch.setattr(
                block_class, "call", lambda self, *a, **k: runs.append(self) or call(self, *a, **k)
            )
        else:
            model = keras.Sequential([keras.Input((16,)), _GeluBlock(), _GeluBlock()])
            x = tf.random.stateless_normal((4, 16), [1, 2])
        start = [v.numpy() for v in model.variables]  # weights and dropout seed states

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.cast(model(x, training=True), tf.float32) ** 2)
            return [loss, *tape.gradient(loss, model.trainable_variables)]

        def run():  # a new tf.function: one traced before remat stays without it
            for variable, value in zip(model.variables, start, strict=True):
                variable.assign(value)
            return [tf.convert_to_tensor(t).numpy() for t in tf.function(step)(x)]

        want = run()
        blocks = remat.set_grad_checkpointing(model)
        for block in blocks:
            block.runs = 0
        runs.clear()
        got = run()
    finally:
        keras.mixed_precision.set_global_policy("float32")
        tf.config.optimizer.set_experimental_options(
            {option: previous.get(option, True) for option in _REWRITES_OFF}
        )
    if name == "gemma3":
        assert len(blocks) == 2 and [runs.count(block) for block in blocks] == [2, 2]
    else:
        assert [block.runs for block in blocks] == [2, 2]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
