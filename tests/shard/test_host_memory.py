"""What sharded state holds in a host's memory, read from the CPU allocator's statistics (a fresh
process with TensorFlow's BFC allocator, whose `current` bytes are every live tensor's).

- A replica's shard lives in a buffer of its own: a slice of the whole value would share the
  whole's buffer, and the shard's variable would keep every weight whole on a CPU host.
- A model built with `tf_internals.trainable_weights_without_storage` holds no trainable weight,
  so a planner can cut a model larger than the host's memory into its shards; the program of the
  "weights" level it plans is the one the model with its weights gives.
"""

from tests.subprocesses import run_python

SCRIPT = r"""
    import contextlib
    import json
    import re

    import keras
    import tensorflow as tf
    from framework import shard
    from framework.core import tf_internals
    from framework.trainer import optim, train_step

    def live():
        return tf.config.experimental.get_memory_info("CPU:0")["current"]

    def model_and_state(deferred):
        keras.utils.set_random_seed(0)
        start = live()
        scope = tf_internals.trainable_weights_without_storage
        with scope() if deferred else contextlib.nullcontext():
            model = keras.Sequential(
                [keras.Input((1024,)), keras.layers.Dense(4096, name="up"),
                 keras.layers.Dropout(0.1, name="drop"), keras.layers.Dense(1024, name="down")],
                name="mlp",
            )
        built = live() - start
        optimizer, _ = optim.scheduled_optimizer(optim.adamw, 1e-3, 0, 10, 0.01)
        state = shard.ShardedState(
            "weights", tf.distribute.get_strategy(), model, optimizer, replicas=8
        )
        return model, state, built, live() - start

    out = {"weights": 4 * (2 * 1024 * 4096 + 4096 + 1024)}
    for deferred in (False, True):
        model, state, built, total = model_and_state(deferred)
        batch = (tf.zeros([2, 1024]), tf.zeros([2], tf.int32))
        step = train_step.compiled_gradients(model, sharded=state, in_program=True)
        hlo = step.experimental_get_compiler_ir(batch)(stage="hlo")
        # The instructions, without the ops' metadata and the function's number in names.
        hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
        hlo = re.sub(r"forward_backward_\d+", "forward_backward", hlo)
        out[str(deferred)] = {"built": built, "total": total, "hlo": hlo}
        del model, state, step
    print(json.dumps(out))
"""


def test_shards_and_a_model_without_weights_take_their_share_of_host_memory():
    out = run_python(SCRIPT, {"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    whole = out["weights"]
    stored, deferred = out["False"], out["True"]
    # Stored: the whole weights, and 1/8 of them three times (shard, AdamW's two moments).
    assert whole <= stored["built"] < 1.05 * whole, out
    assert stored["total"] - stored["built"] < 0.4 * whole, out
    # Without storage: the shards and moments alone (a dropout seed, a few counters beside).
    assert deferred["built"] < 0.01 * whole, out
    assert 0.37 * whole < deferred["total"] < 0.4 * whole, out
    assert deferred["hlo"] == stored["hlo"]
