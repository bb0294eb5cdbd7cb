"""Peak memory and XLA's buffer plan: both must rank no remat above full remat.

Anything that needs an environment variable before TensorFlow starts (the CPU BFC allocator, an
XLA dump directory) runs in a fresh interpreter through `run_python`, since pytest runs every
test module in one process.
"""

from collections.abc import Callable

import pytest
import tensorflow as tf

from framework import memory
from tests.subprocesses import run_python

DEPTH, BATCH, WIDTH, HIDDEN = 8, 512, 256, 1024
ACTIVATION_BYTES = BATCH * WIDTH * 4  # one block's input or output
HIDDEN_BYTES = BATCH * HIDDEN * 4  # one block's inner activation
WEIGHT_BYTES = DEPTH * 2 * WIDTH * HIDDEN * 4


def make_mlp_step(remat: bool, jit_compile: bool) -> tuple[Callable, tf.Tensor]:
    """An SGD step over residual MLP blocks; with `remat`, each block is `tf.recompute_grad`.

    Without remat a block keeps its input and its inner activation (4x wider) for the backward
    pass; with it, only its input.
    """
    weights = [
        [
            tf.Variable(tf.random.stateless_normal(shape, seed=[i, j], stddev=0.05))
            for j, shape in enumerate([[WIDTH, HIDDEN], [HIDDEN, WIDTH]])
        ]
        for i in range(DEPTH)
    ]

    def make_block(w_in, w_out):
        def block(h):
            return h + tf.matmul(tf.nn.relu(tf.matmul(h, w_in)), w_out)

        return tf.recompute_grad(block) if remat else block

    blocks = [make_block(*pair) for pair in weights]
    variables = [w for pair in weights for w in pair]

    @tf.function(jit_compile=jit_compile)
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for block in blocks:
                h = block(h)
            loss = tf.reduce_mean(h * h)
        for w, g in zip(variables, tape.gradient(loss, variables), strict=True):
            w.assign_sub(0.01 * g)
        return loss

    return step, tf.random.stateless_normal([BATCH, WIDTH], seed=[7, 7])


# Measures both remat settings with the allocator (graph mode and XLA) and with XLA's buffer
# assignment, and reads XLA's own text dump of the same compiled programs.
_MEASURE_MLP = """
    import dataclasses, glob, json, sys
    from framework import memory
    from tests.memory.test_memory import make_mlp_step

    out = {}
    for remat in (False, True):
        for jit in (False, True):
            step, x = make_mlp_step(remat, jit)
            step(x)
            out[f"peak remat={remat} jit={jit}"] = dataclasses.asdict(memory.peak_bytes(step, x))
        compiled = memory.compiled_bytes(step, x)
        [path] = glob.glob(f"{sys.argv[1]}/*.{compiled.module}.*buffer-assignment.txt")
        parsed = memory.parse_buffer_assignment(open(path).read(), compiled.module)
        out[f"compiled remat={remat}"] = dataclasses.asdict(compiled)
        out[f"parsed remat={remat}"] = dataclasses.asdict(parsed)
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def mlp_measurements(tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("xla_dump")
    script = _MEASURE_MLP.replace("sys.argv[1]", repr(str(dump_dir)))
    return run_python(
        script,
        {"TF_CPU_ALLOCATOR_USE_BFC": "true", "XLA_FLAGS": f"--xla_dump_to={dump_dir}"},
    )


@pytest.mark.slow
@pytest.mark.tf_compat
@pytest.mark.parametrize("jit", [False, True])
def test_peak_bytes_ranks_no_remat_above_full_remat(mlp_measurements, jit):
    no_remat = mlp_measurements[f"peak remat=False jit={jit}"]
    remat = mlp_measurements[f"peak remat=True jit={jit}"]
    assert no_remat["live_before_bytes"] > 0
    # Without remat every block keeps its inner activation for the backward pass; with it, only
    # its input. Require a margin of two inner activations so scheduling noise cannot decide.
    step_no_remat = no_remat["peak_bytes"] - no_remat["live_before_bytes"]
    step_remat = remat["peak_bytes"] - remat["live_before_bytes"]
    assert step_no_remat > step_remat + 2 * HIDDEN_BYTES
    assert step_remat > ACTIVATION_BYTES


def test_compiled_bytes_ranks_no_remat_above_full_remat(mlp_measurements):
    no_remat = mlp_measurements["compiled remat=False"]
    remat = mlp_measurements["compiled remat=True"]
    for compiled in (no_remat, remat):
        # Input batch and the captured weights are the program's parameters.
        assert compiled["parameter_bytes"] == ACTIVATION_BYTES + WEIGHT_BYTES
    # No remat keeps every block's inner activation for the backward pass; full remat keeps
    # block inputs and recomputes one block at a time.
    assert no_remat["temp_bytes"] >= DEPTH * HIDDEN_BYTES
    assert no_remat["temp_bytes"] > remat["temp_bytes"] + DEPTH // 2 * HIDDEN_BYTES
    assert no_remat["peak_bytes"] > remat["peak_bytes"] + DEPTH // 2 * HIDDEN_BYTES


@pytest.mark.tf_compat
def test_compiled_bytes_names_the_largest_buffer():
    # In this process, without the --xla_dump_to of the measurements above: with it, XLA hands
    # back the unoptimised module beside the optimised buffer assignment, and temporaries lose
    # their shapes and names (see `compiled_bytes`).
    step, x = make_mlp_step(remat=False, jit_compile=True)
    largest = memory.compiled_bytes(step, x).peak_buffers[0]
    assert largest.size_bytes == HIDDEN_BYTES
    assert largest.shape == f"f32[{BATCH},{HIDDEN}]"


@pytest.mark.tf_compat
@pytest.mark.parametrize("remat", [False, True])
def test_text_dump_agrees_with_compiled_bytes(mlp_measurements, remat):
    compiled = mlp_measurements[f"compiled remat={remat}"]
    parsed = mlp_measurements[f"parsed remat={remat}"]
    for field in ("total_bytes", "parameter_bytes", "output_bytes", "temp_bytes"):
        assert parsed[field] == compiled[field], field
    # The text's peak counts values at one point of the schedule; the proto's, the packed heap.
    assert 0.8 * compiled["peak_bytes"] <= parsed["peak_bytes"] <= compiled["total_bytes"]
    assert any(b["op_name"].startswith("MatMul") for b in parsed["peak_buffers"])
    assert sum(b["size_bytes"] for b in parsed["peak_buffers"]) == parsed["peak_bytes"]


@pytest.mark.tf_compat
def test_compiled_bytes_of_a_matmul_chain_is_exact():
    w = tf.Variable(tf.ones([512, 512]))

    @tf.function(jit_compile=True)
    def chain(x):
        return tf.matmul(tf.matmul(tf.matmul(x, w), w), w)

    result = memory.compiled_bytes(chain, tf.TensorSpec([256, 512], tf.float32))
    mib = 1024**2
    # x (0.5 MiB) and w (1 MiB) in, one 0.5 MiB output; the middle product needs 0.5 MiB of temp
    # (the first product can live in the output buffer: XLA reuses it).
    assert result.parameter_bytes == int(1.5 * mib)
    assert result.output_bytes == mib // 2
    assert result.temp_bytes == mib // 2
    assert result.total_bytes == int(2.5 * mib)
    assert result.peak_bytes == int(2.5 * mib)
    assert result.peak_buffers[0].shape == "f32[512,512]"
    assert result.peak_buffers[0].kind == "parameter"
    assert {b.op_name for b in result.peak_buffers} >= {"XLA_Args", "MatMul_1"}
    [output] = [b for b in result.peak_buffers if b.kind == "output"]
    assert output.op_name == "MatMul_2"
    assert result == memory.compiled_bytes(chain, tf.zeros([256, 512]))
    assert "total 2.50 MiB" in result.summary()


def test_compiled_bytes_of_a_keras_train_step_counts_variables():
    import keras

    model = keras.Sequential([keras.Input([32]), keras.layers.Dense(64), keras.layers.Dense(8)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    x, y = tf.zeros([16, 32]), tf.zeros([16, 8])
    result = memory.compiled_bytes(train_step, x, y)
    weight_bytes = sum(v.numpy().nbytes for v in model.trainable_variables)
    # Adam keeps two slots per weight; inputs are parameters too.
    assert result.parameter_bytes >= 3 * weight_bytes + (16 * 32 + 16 * 8) * 4
    assert result.total_bytes == (result.parameter_bytes + result.output_bytes + result.temp_bytes)


@pytest.mark.tf_compat
def test_compiled_bytes_needs_jit_compile():
    @tf.function
    def f(x):
        return x + 1

    with pytest.raises(ValueError, match="jit_compile=True"):
        memory.compiled_bytes(f, tf.zeros([2]))


def test_parse_buffer_assignment_rejects_other_text():
    with pytest.raises(ValueError, match="BufferAssignment"):
        memory.parse_buffer_assignment("HloModule foo\n")


_ALLOCATOR_ERRORS = """
    import json, os
    import tensorflow as tf
    from framework import memory

    def error_of(call):
        try:
            call()
        except memory.AllocatorNotTrackedError as error:
            return str(error)
        return None

    tf.square(tf.ones([256, 256]))  # the runtime starts here, without the BFC allocator
    out = {"peak_bytes": error_of(lambda: memory.peak_bytes(tf.ones, [256], device="CPU:0"))}
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    out["set_too_late"] = error_of(lambda: memory.peak_bytes(tf.ones, [256], device="CPU:0"))
    out["enable_too_late"] = error_of(memory.enable_cpu_bfc_allocator)
    print(json.dumps(out))
"""

# With oneDNN on (the x86 default) TensorFlow 2.21 picks the BFC allocator by itself; with it off
# and the variable unset, CPU allocations are not tracked.
_NO_BFC_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": None, "TF_ENABLE_ONEDNN_OPTS": "0"}


def test_peak_bytes_refuses_cpu_without_bfc_allocator():
    errors = run_python(_ALLOCATOR_ERRORS, _NO_BFC_ENV)
    for case in ("peak_bytes", "set_too_late", "enable_too_late"):
        assert errors[case] is not None, case
        assert "TF_CPU_ALLOCATOR_USE_BFC=true" in errors[case]
        assert "before TensorFlow starts" in errors[case]


@pytest.mark.tf_compat
def test_enable_cpu_bfc_allocator_after_import_before_first_op():
    script = """
        import json
        import tensorflow as tf
        from framework import memory

        memory.enable_cpu_bfc_allocator()
        x = tf.ones([512, 512])
        result = memory.peak_bytes(lambda: tf.matmul(x, x) + 1.0)
        print(json.dumps({"step_bytes": result.step_bytes, "device": result.device}))
    """
    result = run_python(script, _NO_BFC_ENV)
    assert result["device"] == "CPU:0"
    assert result["step_bytes"] >= 512 * 512 * 4
