"""The memory-budget policy: what it keeps, within its budget, in a fixed order, with exact
gradients under dropout, and its errors."""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from framework import remat
from framework.models import scan
from framework.remat import backward, policies
from tests.remat.test_remat import TOL, Block, make_stack, rel_err, reset_seeds, stack_step


def _op(op_type, shapes, dtypes=None, input_shapes=(), attrs=(), random=False):
    dtypes = dtypes or (tf.float32,) * len(shapes)
    return policies.OpInfo(
        op_type, tuple(shapes), tuple(dtypes), attrs=attrs, input_shapes=input_shapes, random=random
    )


def test_recompute_flops_count_products_exactly_and_the_rest_per_value():
    matmul = _op("MatMul", [(8, 32)], input_shapes=((8, 64), (64, 32)))
    assert policies.recompute_flops(matmul) == 2 * 8 * 32 * 64
    # Shapes a trace leaves unknown (a dense layer in Keras' fit): the kernel says what is summed.
    unknown = _op("MatMul", [(None, 32)], input_shapes=((None, None), (64, 32)))
    assert policies.recompute_flops(unknown) == 2 * 32 * 64
    equation = tf.compat.v1.AttrValue(s=b"bqhd,bkhd->bhqk")
    attention = _op(
        "Einsum",
        [(2, 4, 16, 16)],
        input_shapes=((2, 16, 4, 8), (2, 16, 4, 8)),
        attrs=("equation", equation),
    )
    assert policies.recompute_flops(attention) == 2 * (2 * 4 * 16 * 16) * 8
    conv = _op("Conv2D", [(1, 8, 8, 16)], input_shapes=((1, 8, 8, 3), (3, 3, 3, 16)))
    assert policies.recompute_flops(conv) == 2 * (8 * 8 * 16) * 27
    assert policies.recompute_flops(_op("Tanh", [(4, 4)])) == 16
    mask = _op("GreaterEqual", [(4, 8)], [tf.bool], random=True)
    assert policies.recompute_flops(mask) == policies.RANDOM_FLOPS_PER_VALUE * 32
    assert policies.kept_bytes(mask) == 4  # one bit per value
    assert policies.recompute_flops(_op("Reshape", [(4, 4)])) == 0
    assert policies.recompute_flops(_op("StridedSlice", [()], [tf.int32])) == 0


def test_select_keeps_the_most_flops_per_byte_within_the_budget():
    ops = [
        _op("Mul", [(64, 64)]),  # 4096 FLOPs for 16 KiB
        # ViT-B's widest product (contracting 3072): 1536 FLOPs per byte kept.
        _op("MatMul", [(64, 64)], input_shapes=((64, 3072), (3072, 64))),  # 25 MFLOPs, 16 KiB
        # A keep mask's redraw outweighs it per byte (8000 FLOPs per byte, kept as bits).
        _op("GreaterEqual", [(64, 64)], [tf.bool], random=True),  # 4.1 MFLOPs for 512 B
        _op("Softmax", [(64, 64)]),
        _op("Add", [(64, 64)]),
    ]
    # No gradient reads the product's output (its consumer is a bias add, say) nor the Add's:
    # the product is still worth keeping (the recomputation skips it), the Add is not.
    read = [True, False, True, True, False]
    assert policies.MemoryBudget(0.0).select(ops, read) == {}
    # The whole is what the gradients read: the Mul, the mask and the Softmax (33280 bytes).
    assert list(policies.MemoryBudget(0.55).select(ops, read)) == [2, 1]  # mask, then product
    assert list(policies.MemoryBudget(1.0).select(ops, read)) == [2, 1, 0]  # ties: earlier op
    for fraction in np.linspace(0, 1, 11):
        assert 4 not in policies.MemoryBudget(fraction).select(ops, read)  # never the Add
    whole = sum(policies.kept_bytes(op) for op, r in zip(ops, read, strict=True) if r)
    for fraction in np.linspace(0, 1, 11):
        kept = policies.MemoryBudget(fraction).select(ops, read)
        assert sum(policies.kept_bytes(ops[i]) for i in kept) <= fraction * whole


def test_kept_masks_are_priced_as_the_target_compiler_stores_them():
    """A bit a value on XLA:CPU and GPUs (remat packs them), a byte on a TPU (libtpu keeps a
    `pred` a value): there the widest product outranks a full-size draw's mask per byte."""
    mask = _op("GreaterEqual", [(64, 64)], [tf.bool], random=True)
    assert policies.kept_bytes(mask, policies.MASK_BITS["TPU"]) == 4096
    assert policies.kept_bytes(mask, policies.MASK_BITS["GPU"]) == 512
    ops = [
        _op("Mul", [(64, 64)]),
        _op("MatMul", [(64, 64)], input_shapes=((64, 3072), (3072, 64))),  # 1536 FLOPs a byte
        mask,  # 8000 FLOPs a byte as bits, 1000 as bytes
        _op("Softmax", [(64, 64)]),
    ]
    read = [True, False, True, True]
    on_cpu = remat.get_policy("budget:0.55")
    on_tpu = remat.get_policy("budget:0.55", mask_bits=policies.MASK_BITS["TPU"])
    assert (on_cpu.mask_bits, on_tpu.mask_bits) == (1, 8) and on_tpu.__name__ == "budget:0.55"
    assert list(on_cpu.select(ops, read)) == [2, 1]  # mask, then product
    assert list(on_tpu.select(ops, read)) == [1]  # the product; the mask's byte a value no more
    assert list(policies.MemoryBudget(1.0, mask_bits=8).select(ops, read)) == [1, 2, 0]


class _Recorded(policies.MemoryBudget):
    """A budget that also notes, per region, the bytes of the whole and of what it kept."""

    def select(self, ops, read):
        kept = super().select(ops, read)
        whole = sum(policies.kept_bytes(op) for op, r in zip(ops, read, strict=True) if r)
        self.regions.append((whole, sum(policies.kept_bytes(ops[i]) for i in kept)))
        return kept


def _kept(blk, x, policy):
    remat.checkpoint(blk, policy)
    rows = remat.saved_residuals(lambda x: tf.reduce_sum(blk(x, training=True) ** 2), x)
    return [r for r in rows if ", kept by budget" in r.origin]


def test_kept_bytes_grow_with_the_fraction_and_stay_within_it():
    blocks, x = make_stack(n=1)
    blk = blocks[0]
    kept, regions = {}, {}
    for fraction in (0.0, 0.1, 0.3, 0.6, 1.0):
        policy = _Recorded(fraction)
        object.__setattr__(policy, "regions", [])
        kept[fraction] = _kept(blk, x, policy)
        regions[fraction] = policy.regions
    # By the policy's own count: each region keeps at most its fraction of what its backward
    # pass reads (the residual report adds padding of masks to 32-bit words).
    for fraction, counts in regions.items():
        assert counts and all(k <= fraction * whole for whole, k in counts), (fraction, counts)
    total = {f: sum(r.bytes for r in rows) for f, rows in kept.items()}
    assert total[0.0] == 0
    assert total[0.1] < total[0.3] < total[0.6] < total[1.0], total
    # The masks (8000 FLOPs per byte) come first, and every kept value says why it was kept.
    assert any("GreaterEqual" in r.origin for r in kept[0.1])
    assert all("FLOPs/byte" in r.origin for r in kept[0.3])
    # The same model keeps the same values.
    again, _ = make_stack(n=1)

    def picks(rows):  # what was kept, without the layers' instance names
        return [(r.origin.split(" (")[0], r.shape, r.bytes) for r in rows]

    assert picks(_kept(again[0], x, "budget:0.3")) == picks(kept[0.3])
    remat.checkpoint(blk, None)


@pytest.mark.parametrize(
    "mode, fractions",
    [("eager", (0.0, 0.3, 1.0)), pytest.param("xla", (0.3,), marks=pytest.mark.tf_compat)],
)
def test_budget_gradients_match_no_remat_with_dropout(mode, fractions):
    blocks, _ = make_stack(n=1)
    x = tf.random.normal((2, 8, 16), seed=11)
    reset_seeds(blocks)
    want = stack_step(blocks, mode)(x)
    for fraction in fractions:
        for blk in blocks:
            remat.checkpoint(blk, policies.memory_budget(fraction))
        reset_seeds(blocks)
        before = Block.calls
        got = stack_step(blocks, mode)(x)
        assert Block.calls - before == 2 * len(blocks), "each block must be recomputed"
        assert rel_err(got, want) < TOL, (mode, fraction, rel_err(got, want))
        for blk in blocks:
            remat.checkpoint(blk, None)


class _Picks(policies.MemoryBudget):
    """A budget that also notes, per region, the types of the ops whose values it kept."""

    def select(self, ops, read):
        kept = super().select(ops, read)
        self.picks.append([ops[i].op_type for i in sorted(kept)])
        return kept


def test_the_budget_picks_the_same_values_when_fit_leaves_the_batch_unknown():
    """Keras' `fit` traces its step with the batch dimension unknown. The budget must keep, in
    keras-hub's encoder blocks, what it keeps at the batch size it prices an unknown one as: it
    once failed there (a product whose contracted size the shapes did not give) and priced
    every value of the batch's size at 0 bytes. (At another batch size it may keep other
    values: what does not scale with the batch weighs more in a small one.)"""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((8, 16)),
            *[keras_hub.layers.TransformerEncoder(32, num_heads=2, dropout=0.1) for _ in "ab"],
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    x = tf.random.normal((4, 8, 16), seed=5)
    stand_in = backward.STAND_IN_SIZE

    @tf.function(input_signature=[tf.TensorSpec((stand_in, 8, 16))])
    def known_batch(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    picks = {}
    for batch in (stand_in, None):
        policy = _Picks(0.3)
        object.__setattr__(policy, "picks", [])
        remat.set_grad_checkpointing(model, policy=policy)
        if batch is None:
            data = tf.data.Dataset.from_tensor_slices((x, x)).batch(2)
            assert data.element_spec[0].shape[0] is None
            model.fit(data, epochs=1, verbose=0)
        else:
            known_batch.get_concrete_function()
        picks[batch] = policy.picks
    # Both blocks were checkpointed with the budget in each trace, and it kept something.
    assert len(picks[stand_in]) == 2 and picks[stand_in][0] and len(picks[None]) >= 2, picks
    assert all(p == picks[stand_in][0] for p in picks[stand_in] + picks[None]), picks
    remat.set_grad_checkpointing(model, enable=False)


def _encoder(name: str) -> keras.layers.Layer:
    return keras_hub.layers.TransformerEncoder(32, num_heads=2, dropout=0.1, name=name)


def test_a_scanned_stack_prices_an_unknown_batch_as_a_known_one():
    """The same in a scanned stack: `fit` traces its loop step with the batch unknown, and the
    budget must keep what it keeps in a trace at the stand-in batch size."""
    stand_in = backward.STAND_IN_SIZE
    x = tf.random.normal((4, 8, 16), seed=5)
    picks = {}
    for batch in (stand_in, None):
        policy = _Picks(0.3)
        object.__setattr__(policy, "picks", [])
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((8, 16)), scan.ScannedBlocks(_encoder, 2, policy)])
        model.compile(optimizer="sgd", loss="mse")
        if batch is None:
            model.fit(tf.data.Dataset.from_tensor_slices((x, x)).batch(2), epochs=1, verbose=0)
        else:
            with tf.GradientTape() as tape:
                x8 = tf.random.normal((stand_in, 8, 16), seed=6)
                tape.gradient(tf.reduce_sum(model(x8, training=True) ** 2), model.variables)
        picks[batch] = policy.picks
    assert picks[stand_in] and picks[stand_in][0] and picks[None], picks
    assert all(p == picks[stand_in][0] for p in picks[stand_in] + picks[None]), picks


def test_a_region_that_cannot_run_at_the_pricing_sizes_is_priced_as_traced():
    """The pricing trace sets unknown dimensions to a stand-in size; code that refuses that size
    (a position table shorter than it, say) is priced from its own trace instead of failing."""

    def short_sequences_only(x):
        if x.shape[1] is not None and x.shape[1] > 4:
            raise ValueError("at most 4 positions")
        return tf.tanh(x @ tf.ones((3, 3)))

    region = remat.checkpoint(short_sequences_only, "budget:0.5")

    @tf.function(input_signature=[tf.TensorSpec((None, None, 3))])
    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(region(x))
        return tape.gradient(y, x)

    x = tf.random.normal((2, 3, 3), seed=4)
    want = (1 - tf.tanh(x @ tf.ones((3, 3))) ** 2) @ tf.ones((3, 3))
    np.testing.assert_allclose(gradient(x), want, rtol=1e-5, atol=1e-6)


def test_budget_names_and_errors():
    assert remat.get_policy("budget:0.25") == policies.MemoryBudget(0.25)
    assert remat.get_policy(" Budget:1 ").fraction == 1.0
    assert policies.policy_name(remat.get_policy("budget:0.25")) == "budget:0.25"
    assert "budget:<fraction>" in remat.policy_names()
    for bad in ("budget:1.5", "budget:-0.1", "budget:x", "budget:nan"):
        with pytest.raises(ValueError, match="a fraction in"):
            remat.get_policy(bad)
    for joined in ("budget:0.3+dots_saveable", "dots_saveable+budget:0.3"):
        with pytest.raises(ValueError, match="cannot be joined"):
            remat.get_policy(joined)
    for bad in (True, 2, "0.3"):
        with pytest.raises(ValueError, match=r"in \[0, 1\]"):
            policies.memory_budget(bad)
    assert np.isclose(policies.memory_budget(0).fraction, 0.0)
