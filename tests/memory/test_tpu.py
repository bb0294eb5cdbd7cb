"""The TPU compiler's plan of a step, compiled on this CPU by libtpu's compile-only client.

Each compilation here is a small step (a few seconds for libtpu); whole models belong in
benchmarks/remat_policies.py. The `tpu` extra is part of the test install, so nothing skips.
"""

import re

import keras
import pytest
import tensorflow as tf

from framework import memory, remat
from framework.core import jax_internals
from framework.core.tf_internals import hlo_pb2, xla_data_pb2
from framework.memory import tpu
from framework.models.scan import ScannedBlocks
from tests.subprocesses import REPO_DIR, run_python

BATCH, WIDTH = 16384, 1024


def _sgd_step(model: keras.Model, loss_fn=None):
    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            y = model(x, training=True)
            loss = tf.reduce_mean(y * y) if loss_fn is None else loss_fn(y)
        grads = tape.gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads, strict=True):
            v.assign_sub(0.01 * g)
        return loss

    return step


def _two_matmuls():
    w1 = tf.Variable(tf.random.stateless_normal([WIDTH, WIDTH], seed=[1, 2], stddev=0.02))
    w2 = tf.Variable(tf.random.stateless_normal([WIDTH, WIDTH], seed=[3, 4], stddev=0.02))

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) ** 2)
        g1, g2 = tape.gradient(loss, [w1, w2])
        w1.assign_sub(0.01 * g1)
        w2.assign_sub(0.01 * g2)
        return loss

    return step


@pytest.fixture(scope="module")
def matmul_plans():
    step = _two_matmuls()
    x = tf.TensorSpec([BATCH, WIDTH], tf.float32)
    return {chip: memory.compiled_bytes(step, x, target=chip) for chip in ("v5e", "v4")}


@pytest.mark.tf_compat
@pytest.mark.parametrize("chip, hbm_gib", [("v5e", 16), ("v4", 32)])
def test_tpu_plan_counts_inputs_flops_and_the_chips_hbm(matmul_plans, chip, hbm_gib):
    plan = matmul_plans[chip]
    assert plan.compiler.startswith(f"TPU {chip} (libtpu ")
    assert plan.capacity_bytes == hbm_gib * 1024**3
    # The batch and two weight matrices, f32; the updated weights alias their inputs.
    assert plan.parameter_bytes == (BATCH * WIDTH + 2 * WIDTH * WIDTH) * 4
    assert plan.output_bytes < 4096
    # Two products forward, three backward (no gradient for x), 2 FLOPs per multiply-add;
    # the compiler also counts the elementwise ops, a few per value.
    products = 5 * 2 * BATCH * WIDTH * WIDTH
    assert products <= plan.flops <= products * 1.01
    # The forward pass keeps two activations of 64 MiB for the backward pass: on-chip memory
    # (VMEM: 128 MiB on v5e, more on v4) cannot hold both, so at least one lives in HBM.
    activation = BATCH * WIDTH * 4
    assert plan.temp_bytes >= activation
    assert plan.temp_bytes + plan.on_chip_bytes >= 2 * activation
    assert plan.generated_code_bytes > 0
    assert plan.peak_bytes == plan.total_bytes + plan.generated_code_bytes
    largest = plan.peak_buffers[0]
    assert largest.size_bytes == BATCH * WIDTH * 4 and largest.shape == f"f32[{BATCH},{WIDTH}]"
    assert f"of {hbm_gib}.00 GiB" in plan.summary()


def test_a_small_step_keeps_its_temporaries_on_chip():
    step = _two_matmuls()
    plan = memory.compiled_bytes(step, tf.TensorSpec([256, WIDTH], tf.float32), target="v5e")
    assert plan.temp_bytes == 0
    assert plan.on_chip_bytes >= 256 * WIDTH * 4


class ResidualMlp(keras.layers.Layer):
    """A block written the ordinary Keras way: sub-layers built in __init__, dropout inherits
    `training` from the call context."""

    def __init__(self, rate: float, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4 * WIDTH, activation="gelu")
        self.down = keras.layers.Dense(WIDTH)
        self.dropout = keras.layers.Dropout(rate, seed=5)

    def call(self, x):
        return x + self.dropout(self.down(self.dropout(self.up(x))))


def _mlp_stack(rate: float, depth: int = 2) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([ResidualMlp(rate) for _ in range(depth)])
    model.build((None, WIDTH))
    return model


def _padded_random_buffers(plan: memory.CompiledMemory) -> list[memory.Buffer]:
    """Buffers of random bits or masks in blocks of 4, the layout XLA:TPU pads 32-fold."""
    return [
        b
        for b in plan.peak_buffers
        if re.fullmatch(r"(u32|pred)\[\d+,4\]", b.shape) and b.size_bytes >= 1024**2
    ]


@pytest.mark.slow
def test_dropout_bits_are_dense_on_tpu_and_remat_lowers_the_temps():
    batch = 2048
    x = tf.TensorSpec([batch, WIDTH], tf.float32)
    model = _mlp_stack(0.1)
    plain = memory.compiled_bytes(_sgd_step(model), x, target="v5e")
    assert plain.temp_bytes > 0
    assert _padded_random_buffers(plain) == []
    # Each block keeps its 4x wider hidden activation without remat; with full remat only its
    # input, the hidden one recomputed in the backward pass (measured: 22.4 -> 2.8 MiB).
    remat.set_grad_checkpointing(model, policy="nothing_saveable")
    checkpointed = memory.compiled_bytes(_sgd_step(model), x, target="v5e")
    assert checkpointed.temp_bytes <= 0.25 * plain.temp_bytes
    # The compiler kept the recomputation: the blocks' products run again.
    assert checkpointed.flops >= plain.flops * 1.1
    assert _padded_random_buffers(checkpointed) == []


def test_an_explicit_philox_generator_stays_philox():
    """Only the device-chosen algorithm is re-lowered; `alg="philox"` is Philox on a TPU too."""

    @tf.function(jit_compile=True)
    def draw(seed):
        chosen = tf.random.stateless_uniform([64, 128], seed=seed)
        philox = tf.random.stateless_uniform([64, 128], seed=seed, alg="philox")
        return chosen + philox

    hlo = draw.experimental_get_compiler_ir(tf.TensorSpec([2], tf.int32))(stage="hlo_serialized")

    def algorithms(serialized: bytes) -> list[str]:
        module = hlo_pb2.HloModuleProto.FromString(serialized)
        return sorted(
            xla_data_pb2.RandomAlgorithm.Name(i.rng_algorithm)
            for c in module.computations
            for i in c.instructions
            if i.opcode == "rng-bit-generator"
        )

    # Explicit Philox scrambles its seed with one more Philox draw.
    assert algorithms(hlo) == ["RNG_PHILOX"] * 3
    assert algorithms(tpu.lower_random_for_tpu(hlo)) == ["RNG_DEFAULT"] + ["RNG_PHILOX"] * 2


def test_dropout_in_a_loop_body_is_lowered_for_the_tpu():
    """Random draws inside a `tf.while_loop` (a scanned stack's dropout): the re-lowered
    generators' new instructions are numbered within their loop body's computation."""
    w = tf.Variable(tf.ones([4, WIDTH, WIDTH]) / WIDTH)

    @tf.function(jit_compile=True)
    def step(x):
        def body(i, h):
            h = tf.nn.experimental.stateless_dropout(h @ tf.gather(w, i), 0.1, [1, i])
            return i + 1, h

        with tf.GradientTape() as tape:
            _, h = tf.while_loop(lambda i, _: i < 4, body, (0, x), maximum_iterations=4)
            loss = tf.reduce_sum(h)
        w.assign_sub(tape.gradient(loss, w))
        return loss

    plan = memory.compiled_bytes(step, tf.TensorSpec([256, WIDTH]), target="v5e")
    assert plan.compiler.startswith("TPU v5e") and plan.parameter_bytes > 0
    assert _padded_random_buffers(plan) == []


class _BuiltMlp(ResidualMlp):
    def build(self, input_shape):  # ScannedBlocks builds its template from the input shape
        self.up.build(input_shape)
        self.down.build((*input_shape[:-1], 4 * WIDTH))


@pytest.mark.parametrize("stack, draws", [("checkpointed", 8), ("scanned", 4)])
def test_recomputed_draws_are_lowered_for_the_tpu(stack, draws):
    """A recomputed draw reads the key kept from the forward pass (checkpointed blocks) or
    derives it in the backward loop's step (a scanned stack, whose loop state the re-lowering
    cannot see through): either way it is lowered as the forward pass's draws are."""
    if stack == "checkpointed":
        model = _mlp_stack(0.1)
        remat.set_grad_checkpointing(model, policy="nothing_saveable")
    else:
        keras.utils.set_random_seed(0)
        blocks = ScannedBlocks(lambda name: _BuiltMlp(0.1, name=name), 2, "nothing_saveable")
        model = keras.Sequential([blocks])
        model.build((None, WIDTH))
    spec = tf.TensorSpec([8, WIDTH], tf.float32)
    hlo = _sgd_step(model).experimental_get_compiler_ir(spec)(stage="hlo_serialized")
    module = hlo_pb2.HloModuleProto.FromString(tpu.lower_random_for_tpu(hlo))
    algorithms = [
        xla_data_pb2.RandomAlgorithm.Name(i.rng_algorithm)
        for c in module.computations
        for i in c.instructions
        if i.opcode == "rng-bit-generator"
    ]
    # Two dropout calls a block (one block a loop step), each drawn again in the recomputation.
    assert algorithms == ["RNG_DEFAULT"] * draws


@pytest.mark.tf_compat
@pytest.mark.parametrize(
    "rng_alg, padded", [(None, False), pytest.param("philox", True, marks=pytest.mark.slow)]
)
def test_philox_dropout_masks_are_padded_on_tpu(rng_alg, padded):
    """What the re-lowering avoids: Philox bits in blocks of 4, each padded to 128 lanes."""
    w = tf.Variable(tf.ones([WIDTH, WIDTH]) / WIDTH)

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            h = tf.nn.experimental.stateless_dropout(x @ w, 0.1, [1, 2], rng_alg=rng_alg)
            loss = tf.reduce_sum(h @ w)
        w.assign_sub(tape.gradient(loss, w))
        return loss

    plan = memory.compiled_bytes(step, tf.TensorSpec([BATCH, WIDTH]), target="v5e")
    assert bool(_padded_random_buffers(plan)) == padded


@pytest.mark.parametrize(
    "name, chip",
    [("v5e", "v5e"), ("v5litepod-16", "v5e"), ("V4-32", "v4"), ("v5p-8", "v5p"), ("v6e", "v6e")],
)
def test_chip_names_and_accelerator_types(name, chip):
    assert tpu.tpu_chip(name).name == chip


@pytest.mark.parametrize("name, devices", [("v5e", 1), ("v5litepod-16", 16), ("v4-32", 16)])
def test_a_slice_has_a_device_per_chip(name, devices):
    assert tpu.tpu_devices(name) == devices


@pytest.mark.parametrize("name", ["v5e-0", "v5e-3", "v4-3", "v4-12"])
def test_a_slice_size_no_slice_has_is_an_error(name):
    """They were planned as one chip, or as 3 chips of a slice that does not exist."""
    with pytest.raises(ValueError, match=f"'{name}' is not a TPU slice"):
        tpu.tpu_devices(name)


def test_an_unknown_chip_names_the_known_ones():
    with pytest.raises(ValueError, match=r"Unknown TPU chip 'v9'.*v5e \(v5litepod-N\)"):
        tpu.tpu_chip("v9")


def test_the_chips_are_the_generations_libtpu_compiles_for():
    """The shared generations (`framework.core.tpu_generations`) with a compile-only topology,
    compiled as a megacore where two TensorCores make one device; v2 and v3 have none."""
    configs = {name: (chip.topology, chip.chip_config) for name, chip in tpu.TPU_CHIPS.items()}
    assert configs == {
        "v4": ("v4:2x2x1", "megacore"),
        "v5e": ("v5e:1x1", "default"),
        "v5p": ("v5p:2x2x1", "megacore"),
        "v6e": ("v6e:1x1", "default"),
    }
    assert tpu.tpu_chip("v6e-8").peak() == 918e12 and tpu.tpu_chip("v5e").hbm_bytes == 16 * 2**30
    with pytest.raises(ValueError, match="Unknown TPU chip 'v3-8'"):
        tpu.tpu_chip("v3-8")


def test_the_installed_jax_and_libtpu_are_the_tested_pair():
    assert jax_internals.unsupported_versions_message() is None
    setup = (REPO_DIR / "setup.py").read_text()
    pins = re.search(r"TPU_COMPILER = \[(.*?)\]", setup)[1]
    (jax,) = jax_internals.SUPPORTED_JAX
    (libtpu,) = jax_internals.SUPPORTED_LIBTPU
    assert pins == f'"jax=={jax}", "jaxlib=={jax}", "libtpu=={libtpu}.*"'


def test_without_the_extra_one_line_says_how_to_install_it():
    result = run_python(
        """
        import json, sys
        sys.modules["jax"] = None  # as if the extra were not installed
        import tensorflow as tf
        from framework import memory

        step = tf.function(lambda x: x * 2, jit_compile=True)
        try:
            memory.compiled_bytes(step, tf.TensorSpec([2]), target="v5e")
        except ImportError as error:
            print(json.dumps({"type": type(error).__name__, "message": str(error)}))
        """
    )
    assert result["type"] == "MissingDependency"
    assert 'pip install -e ".[tpu]" (a TPU)' in result["message"]
    assert "\n" not in result["message"]
