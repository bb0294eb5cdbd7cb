"""framework.remat checks that need a fresh process: allocator memory, leaks, MirroredStrategy.

The BFC allocator statistics and logical CPU devices must be configured
before TensorFlow initialises, which pytest's shared process has already done. One process (this
file run as a script) splits the CPU in two logical devices, then runs every scenario and prints
one JSON line with their results, which the tests check: one TensorFlow start for all of them.
"""

from __future__ import annotations

import json

import pytest

from tests.subprocesses import run_json

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


@pytest.fixture(scope="module")
def scenarios() -> dict:
    return run_json([__file__], {"TF_CPU_ALLOCATOR_USE_BFC": "true"}, timeout=600)


def test_memory_ratios_under_xla(scenarios):
    peaks = scenarios["memory"]
    full, none, dots = peaks["everything_saveable"], peaks["nothing_saveable"], peaks["dots"]
    assert none <= 0.35 * full, peaks
    assert none < dots < full, peaks


def test_no_leak_over_50_steps(scenarios):
    result = scenarios["leak"]
    # The first step of each setting traced two blocks, each forward and recomputed.
    assert set(result["runs"].values()) == {4}, result["runs"]
    for key, grown in result["drift"].items():
        assert grown <= 32 * 1024, (key, result)


def test_mirrored_strategy_two_replicas(scenarios):
    result = scenarios["mirrored"]
    assert result["errors"], "no policy was checked"
    # Each replica traced each of the two blocks forward and recomputed.
    assert set(result["runs"].values()) == {8}, result["runs"]
    for key, err in result["errors"].items():
        assert err < 1e-5, (key, result)


def test_eager_replicas_of_mirrored_strategy(scenarios):
    """Replicas run in threads of their own, each checkpointed layer untraced: gradients equal
    to the plain ones on every replica, each block run twice per replica."""
    result = scenarios["mirrored_eager"]
    assert result["runs"] == 2 * 2 * 2, result
    assert result["error"] < 1e-5 and result["largest_norm"] > 1e-3, result


def test_scanned_blocks_under_mirrored_strategy(scenarios):
    result = scenarios["scan_mirrored"]
    assert result["error"] < 1e-5 and result["largest_norm"] > 1e-3, result


def _stack(tf, keras, n, d, seq, batch):
    from tests.remat.test_remat import Block

    keras.utils.set_random_seed(0)
    blocks = [Block(d=d, heads=4, name=f"b{i}") for i in range(n)]
    x = tf.random.normal((batch, seq, d))
    for blk in blocks:
        blk(x)
    return blocks, x


def _loss(tf, blocks, y):
    for blk in blocks:
        y = blk(y, training=True)
    return tf.reduce_sum(y * y)


def _memory() -> dict:
    import keras
    import tensorflow as tf

    from framework import memory, remat

    blocks, x = _stack(tf, keras, n=6, d=64, seq=128, batch=8)  # full remat: 0.13 of no remat
    variables = [v for blk in blocks for v in blk.trainable_variables]
    peaks = {}
    for policy in ("everything_saveable", "nothing_saveable", "dots"):
        for blk in blocks:
            remat.checkpoint(blk, policy)

        @tf.function(jit_compile=True)
        def step(x):
            with tf.GradientTape() as tape:
                loss = _loss(tf, blocks, x)
            return tape.gradient(loss, variables)

        step(x)
        peaks[policy] = memory.peak_bytes(step, x).step_bytes
    return peaks


def _leak() -> dict:
    import keras
    import tensorflow as tf

    from framework import remat
    from tests.remat.test_remat import Block

    blocks, x = _stack(tf, keras, n=2, d=32, seq=32, batch=4)
    variables = [v for blk in blocks for v in blk.trainable_variables]
    drift, runs = {}, {}
    for mode in ("eager", "graph", "xla"):
        for policy in ("nothing_saveable", "dots_saveable"):
            for blk in blocks:
                remat.checkpoint(blk, policy)

            def step(x):
                with tf.GradientTape() as tape:
                    loss = _loss(tf, blocks, x)
                for v, g in zip(variables, tape.gradient(loss, variables), strict=False):
                    v.assign_sub(1e-6 * g)
                return loss

            if mode != "eager":
                step = tf.function(step, jit_compile=mode == "xla")
            live = []
            for i in range(50):
                live.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
                before = Block.calls
                step(x)
                if i == 0:
                    runs[f"{mode}/{policy}"] = Block.calls - before
            # Allocator noise is +-20 KiB here; a leak of one small activation per step (16 KiB)
            # grows the later window by 300 KiB.
            drift[f"{mode}/{policy}"] = max(live[30:]) - max(live[5:30])
    return {"drift": drift, "runs": runs}


def _mirrored() -> dict:
    import keras
    import tensorflow as tf

    from framework import remat

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        blocks, _ = _stack(tf, keras, n=2, d=16, seq=8, batch=2)
        scale = tf.Variable(1.5)
    variables = [v for blk in blocks for v in blk.trainable_variables] + [scale]
    data = tf.random.normal((4, 8, 16), seed=3)
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: data[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
    )

    def loss_grads(x):
        with tf.GradientTape() as tape:
            loss = _loss(tf, blocks, x * scale)
        return tape.gradient(loss, variables)

    def run():
        # Each replica's step is jit-compiled, as the trainer's (eager calls: test_remat.py).
        def replica(x):
            return tf.function(loss_grads, jit_compile=True)(x)

        @tf.function
        def distributed(x):
            return strategy.run(replica, args=(x,))

        for blk in blocks:
            blk.drop.seed_generator.state.assign([3, 0])
        per_replica = distributed(dist)
        return [strategy.experimental_local_results(g) for g in per_replica]

    from tests.remat.test_remat import Block

    errors, runs = {}, {}
    for blk in blocks:
        remat.checkpoint(blk, None)
    want = run()
    for policy in ("nothing_saveable", "dots_with_no_batch_dims_saveable", "budget:0.3"):
        for blk in blocks:
            remat.checkpoint(blk, policy)
        before = Block.calls
        got = run()
        runs[policy] = Block.calls - before
        err = 0.0
        for g_rep, w_rep in zip(got, want, strict=False):
            for g, w in zip(g_rep, w_rep, strict=False):
                assert g is not None
                err = max(err, float(tf.norm(g - w) / (tf.norm(w) + 1e-30)))
        errors[policy] = err
    return {"errors": errors, "runs": runs}


def _mirrored_eager() -> dict:
    """Two replicas called eagerly (`strategy.run` outside a tf.function), full remat against
    none: the largest relative gradient difference over replicas and variables."""
    import keras
    import tensorflow as tf

    from framework import remat
    from tests.remat.test_remat import Block

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        blocks, _ = _stack(tf, keras, n=2, d=16, seq=8, batch=2)
    variables = [v for blk in blocks for v in blk.trainable_variables]
    data = tf.random.normal((4, 8, 16), seed=4)
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: data[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
    )

    def replica(x):
        with tf.GradientTape() as tape:
            loss = _loss(tf, blocks, x)
        return tape.gradient(loss, variables)

    def run():
        for blk in blocks:
            blk.drop.seed_generator.state.assign([3, 0])
        return [strategy.experimental_local_results(g) for g in strategy.run(replica, (dist,))]

    want = run()
    for blk in blocks:
        remat.checkpoint(blk, "nothing_saveable")
    before = Block.calls
    got = run()
    runs = Block.calls - before
    error, largest = 0.0, 0.0
    for g_rep, w_rep in zip(got, want, strict=True):
        for g, w in zip(g_rep, w_rep, strict=True):
            error = max(error, float(tf.norm(g - w) / (tf.norm(w) + 1e-30)))
            largest = max(largest, float(tf.norm(w)))
    return {"error": error, "largest_norm": largest, "runs": runs}


def _scan_mirrored() -> dict:
    """A scanned ViT with full remat against the unrolled one, each replica's step jit-compiled:
    the largest relative gradient difference over replicas and variables."""
    import numpy as np
    import tensorflow as tf

    from framework import remat
    from tests.remat.test_scan import pair, split_unrolled, unstacked

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        unrolled, scanned = pair()
    remat.set_grad_checkpointing(scanned, policy="nothing_saveable")
    images = tf.random.stateless_normal((4, 16, 16, 3), seed=[4, 2])
    labels = tf.constant([1, 3, 0, 2])
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: (
            images[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2],
            labels[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2],
        )
    )

    def grads_of(model):
        def loss_grads(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            return tape.gradient(loss, model.trainable_variables)

        @tf.function
        def distributed(batch):
            # A compiled function per replica: each captures its own copy of the variables.
            return strategy.run(
                lambda *b: tf.function(loss_grads, jit_compile=True)(*b), args=batch
            )

        per_replica = distributed(dist)
        return [[g.numpy() for g in strategy.experimental_local_results(r)] for r in per_replica]

    want, got = grads_of(unrolled), grads_of(scanned)
    err, norm = 0.0, 0.0
    for replica in range(2):
        w = split_unrolled(unrolled, [g[replica] for g in want])
        g = unstacked(scanned, [g[replica] for g in got])
        for gs, ws in zip(g, w, strict=True):
            for a, b in zip(gs, ws, strict=True):
                err = max(err, float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30)))
                norm = max(norm, float(np.linalg.norm(b)))
    return {"error": err, "largest_norm": norm}


if __name__ == "__main__":
    import tensorflow as tf

    # Before anything runs: the mirrored scenario needs two logical devices; the others use the
    # first (its allocator's statistics are those of the whole CPU).
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
    print(
        json.dumps(
            {
                "mirrored": _mirrored(),
                "mirrored_eager": _mirrored_eager(),
                "scan_mirrored": _scan_mirrored(),
                "memory": _memory(),
                "leak": _leak(),
            }
        )
    )
