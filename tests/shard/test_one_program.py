"""The step a TPU compiles - one XLA program of all replicas, gathers and reduce-scatters inside
it - run on 4 CPU replicas by XLA:CPU (through jax, whose CPU client runs collectives among
replicas; TensorFlow's own XLA:CPU runs none).

For the "gradients" and "weights" levels, with and without remat, the ViT with dropout (and at
"weights" keras-hub's GPT-2 backbone, whose layers no one here wrote): each replica's program
returns its parts of the gradients summed over all replicas' batches, as the unsharded pass
computes them one replica's batch at a time (within 1e-5 of the largest value of each part: the
sum runs in another order). With remat, the weights of each block are
gathered again in its recomputation: the program holds more gathers than the pass without.
"""

import pytest

from tests.subprocesses import run_python

pytestmark = pytest.mark.slow  # a process of its own: jax's CPU devices are set at its start

SCRIPT = """
    import functools, json
    import keras, keras_hub, numpy as np, tensorflow as tf
    from framework.core import jax_internals
    from framework.core.tf_internals import hlo_pb2

    REPLICAS = 4
    jax_internals.cpu_devices(REPLICAS)

    from framework import shard
    from framework.models import VisionTransformer
    from framework.trainer import optim, train_step
    from tests import tiny

    def gathers(hlo):
        module = hlo_pb2.HloModuleProto.FromString(hlo)
        return sum(
            i.opcode == "all-reduce" and i.metadata.op_type == "XlaAllReduce"
            and len(i.shape.dimensions) == 2 and i.shape.dimensions[0] == REPLICAS
            for c in module.computations for i in c.instructions
        )

    def model_and_batch(name):
        keras.utils.set_random_seed(0)
        if name == "vit":
            model = VisionTransformer(**tiny.MODEL, dropout=0.1)
            return model, next(iter(tiny.dataset_fn("train", global_batch_size=4 * REPLICAS)))
        # A model no one here wrote: keras-hub's GPT-2 backbone, each token's 16 features
        # read as the logits of 16 classes.
        model = keras_hub.models.GPT2Backbone(
            vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8, dropout=0.2,
        )
        ids = tf.random.stateless_uniform((4 * REPLICAS, 8), [1, 2], 1, 50, tf.int32)
        # Keys in sorted order: the program takes a dict's values in the order they were put
        # in, `tf.nest.flatten` (the arguments below) in the keys' order.
        inputs = {{"padding_mask": tf.ones_like(ids), "token_ids": ids}}
        return model, (inputs, ids % 16)

    def case(name, level, policy):
        model, (x, y) = model_and_batch(name)
        if policy:
            from framework import remat
            remat.set_grad_checkpointing(model, policy=policy)
        optimizer, _ = optim.scheduled_optimizer(optim.adamw, 1e-3, 0, 10, 0.05)
        state = shard.ShardedState(
            level, tf.distribute.get_strategy(), model, optimizer, replicas=REPLICAS
        )
        rows = lambda r: tf.nest.map_structure(lambda t: t[4 * r : 4 * r + 4], (x, y))
        batches = [rows(r) for r in range(REPLICAS)]
        program = train_step.compiled_gradients(model, sharded=state, in_program=True)
        captured = program.get_concrete_function(batches[0]).captured_inputs
        hlo = program.experimental_get_compiler_ir(batches[0])(stage="hlo_serialized")

        # Each replica: its batch, then the program's captured variables - its own parts of the
        # shards, the others (seed states; the replicated weights at "gradients") as they are.
        variables = {{id(v.value.handle): v for v in model.variables + state.shards}}
        weights = zip(state.shards, state.layouts, model.trainable_variables)
        parts = {{id(s): (layout, w) for s, layout, w in weights}}
        arguments = []
        for r, batch in enumerate(batches):
            values = [t.numpy() for t in tf.nest.flatten(batch)]
            for handle in captured:
                v = variables[id(handle)]
                layout, whole = parts.get(id(v), (None, None))
                value = v.value if layout is None else layout.shard(whole.value, r)
                values.append(value.numpy())
            arguments.append(values)
        outputs = jax_internals.run_on_cpu_replicas(hlo, arguments)

        # The unsharded program, one replica's batch at a time from the same seed state, summed
        # (compiled too: keras-hub's dropout draws other bits under XLA than in eager mode).
        seeds = [(v, v.numpy()) for v in model.variables if not v.trainable]
        unsharded = train_step.compiled_gradients(model)
        total = None
        for batch in batches:
            for v, value in seeds:
                v.assign(value)
            _, grads = unsharded(batch)
            grads = [g.numpy() for g in grads]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        # Relative to each part's largest value, or where a gradient is zero but for rounding
        # (a key's bias: the softmax ignores what shifts every key alike) to 1e-4 of the largest.
        floor = 1e-4 * max(float(np.max(np.abs(t))) for t in total)
        error = 0.0
        for r in range(REPLICAS):
            got = outputs[r][3 : 3 + len(state.shards)]  # after (loss_sum, correct, count)
            for g, layout, want in zip(got, state.layouts, total):
                part = layout.shard(want, r).numpy()
                scale = max(float(np.max(np.abs(part))), floor)
                error = max(error, float(np.max(np.abs(g - part)) / scale))
        return error, gathers(hlo)

    result = {{}}
    for level in ("gradients", "weights"):
        for policy in (None, "nothing_saveable"):
            result[f"vit/{{level}}/{{policy}}"] = case("vit", level, policy)
    for policy in (None, "nothing_saveable"):
        result[f"gpt2/weights/{{policy}}"] = case("gpt2", "weights", policy)
    print(json.dumps(result))
"""


def test_the_one_program_step_on_four_replicas_gives_each_its_parts_of_the_summed_gradients():
    result = run_python(SCRIPT.format(), timeout=900)
    for name, (error, _) in result.items():
        assert error < 1e-5, (name, result)
    # "gradients" reads replicated weights: it gathers nothing.
    gradients = result["vit/gradients/None"][1], result["vit/gradients/nothing_saveable"][1]
    assert gradients == (0, 0), result
    # "weights" gathers each weight where it is read; remat reads the blocks' weights again.
    for model in ("vit", "gpt2"):
        plain, remat = (
            result[f"{model}/weights/None"][1],
            result[f"{model}/weights/nothing_saveable"][1],
        )
        assert plain > 10 and remat > plain, result
