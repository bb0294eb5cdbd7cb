"""XLA's GPU compiler's plan of a step, compiled on this CPU by jax's CUDA plugin's compile-only
client for a card named.

Each compilation here is a small step (seconds); whole models belong in benchmarks/gpu_plans.py.
The `gpu` extra is part of the test install, so nothing skips.
"""

import re

import keras
import pytest
import tensorflow as tf

from framework import memory, remat
from framework.core import jax_internals
from framework.memory import gpu, targets
from framework.runtime import flops
from tests.subprocesses import REPO_DIR, run_python

BATCH, WIDTH, DEPTH = 1024, 512, 4


def _mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input([WIDTH])
    x = inputs
    for i in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="gelu", name=f"dense_{i}")(x)
        x = keras.layers.Dropout(0.1, name=f"dropout_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def _sgd_step(model: keras.Model):
    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads, strict=True):
            v.assign_sub(0.01 * g)
        return loss

    return step


def _weight_bytes(model: keras.Model) -> int:
    return sum(v.numpy().nbytes for v in model.variables)  # dropout's seeds too


X = tf.TensorSpec([BATCH, WIDTH], tf.float32)


@pytest.fixture(scope="module")
def plans():
    """card -> (no remat's plan, nothing_saveable's), and the bytes of the model's variables."""
    model = _mlp()
    found = {}
    for card in ("p100", "a100-40gb"):
        remat.set_grad_checkpointing(model, enable=False)
        plain = memory.compiled_bytes(_sgd_step(model), X, target=card)
        remat.set_grad_checkpointing(model, policy="nothing_saveable")
        found[card] = plain, memory.compiled_bytes(_sgd_step(model), X, target=card)
    return found, _weight_bytes(model)


@pytest.mark.tf_compat
@pytest.mark.parametrize("card", ["p100", "a100-40gb"])
def test_a_step_planned_for_a_card_makes_sense(plans, card):
    found, weights = plans
    plain, _ = found[card]
    assert plain.compiler.startswith(f"XLA:GPU {card} sm_")
    # The program takes the weights and the batch, updates the weights in place.
    assert plain.parameter_bytes == weights + BATCH * WIDTH * 4
    assert plain.output_bytes < 1024  # the loss; the updates alias the weights
    assert plain.capacity_bytes == gpu.gpu_card(card).memory_bytes
    # Four layers' activations of BATCH x WIDTH float32 (and their dropout masks) are kept for
    # the backward pass.
    assert plain.temp_bytes > DEPTH * BATCH * WIDTH * 4
    assert plain.peak_bytes == plain.total_bytes
    assert any(b.kind == "temp" and b.op_name for b in plain.peak_buffers)


@pytest.mark.parametrize("card", ["p100", "a100-40gb"])
def test_remat_lowers_the_temporaries_and_adds_its_recomputation(plans, card):
    found, _ = plans
    plain, checkpointed = found[card]
    assert checkpointed.temp_bytes < 0.8 * plain.temp_bytes
    # The forward products are computed again in the backward pass (the compiler's cuBLAS
    # calls, counted): 3 products per layer become 4.
    forward = 2 * BATCH * WIDTH * WIDTH * DEPTH
    assert checkpointed.flops - plain.flops == pytest.approx(forward, rel=0.01)


def test_a_smaller_memory_makes_the_gpu_compiler_rematerialize():
    """XLA:GPU rematerializes towards the card's memory by itself: described with less memory
    than the step's plan needs, the same card's plan is smaller (here by recomputing GELU and
    dropout, not the products: the dot FLOPs stay)."""
    model = _mlp()
    hlo = _sgd_step(model).experimental_get_compiler_ir(X)(stage="hlo_serialized")
    card = gpu.gpu_card("v100")
    full = gpu.compile_for_card(hlo, card)
    small = gpu.compile_for_card(hlo, card, memory_bytes=full.total_bytes // 2)
    assert small.capacity_bytes == full.total_bytes // 2
    assert small.temp_bytes < full.temp_bytes
    assert small.flops == full.flops


def test_flops_of_cudnn_and_strided_convolutions_are_counted_once():
    """A strided convolution's gradient step: cuDNN's forward, input-gradient and
    filter-gradient calls on the GPU, XLA:CPU's dilated convolutions, each 3 x the forward
    pass's multiply-adds exactly (ResNet50's step agrees the same way between the two)."""
    kernel = tf.Variable(tf.random.stateless_normal([3, 3, 32, 64], seed=[1, 2]))

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.conv2d(x, kernel, strides=2, padding="SAME")
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, kernel])

    x = tf.TensorSpec([8, 32, 32, 32])
    forward = 2 * (8 * 16 * 16 * 64) * (3 * 3 * 32)
    assert memory.compiled_bytes(step, x, target="v100").flops == 3 * forward
    assert flops.compiled_plan_and_flops(step, x)[1] == 3 * forward


@pytest.mark.parametrize(
    "name, card, gib",
    [
        ("p100", "p100", 15.9),
        ("Tesla P100-SXM2-16GB", "p100", 15.9),
        ("Tesla V100-SXM2-32GB", "v100-32gb", 31.5),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 39.4),
        ("NVIDIA A100 80GB PCIe", "a100-80gb", 79.3),
        ("NVIDIA H100 PCIe", "h100", 79.1),
        ("Tesla T4", "t4", 15.0),
        ("NVIDIA L4", "l4", 22.5),
    ],
)
def test_card_names_and_the_names_cuda_reports(name, card, gib):
    found = gpu.gpu_card(name)
    assert found.name == card
    assert found.memory_bytes / 2**30 == pytest.approx(gib, abs=0.1)


def test_an_unknown_card_names_the_known_ones():
    with pytest.raises(ValueError, match=r"Unknown GPU 'rtx9090'; known: p100, v100, .*h100"):
        gpu.gpu_card("rtx9090")
    with pytest.raises(ValueError, match=r"Unknown target 'x1'; TPU chips: v4 .*GPUs: p100, "):
        targets.target_device("x1")


def test_float32_peaks_are_tensor_float_32_where_the_card_has_it():
    assert gpu.gpu_card("p100").peak("float32") == gpu.gpu_card("p100").peak("bfloat16")
    assert gpu.gpu_card("a100-40gb").peak("float32") == 156e12
    assert gpu.gpu_card("h100").peak("bfloat16") == 989.4e12


def test_the_installed_cuda_plugin_is_the_tested_release():
    assert jax_internals.unsupported_versions_message("gpu") is None
    setup = (REPO_DIR / "setup.py").read_text()
    pins = re.search(r"GPU_COMPILER = \[(.*?)\]", setup, re.S)[1]
    (jax,) = jax_internals.SUPPORTED_JAX
    assert f'"jax-cuda12-plugin=={jax}"' in pins and f'"jax-cuda12-pjrt=={jax}"' in pins


def test_without_the_extra_one_line_says_how_to_install_it():
    result = run_python(
        """
        import json, sys
        from importlib import metadata

        real = metadata.version
        def version(name):  # as if the extra were not installed
            if name == "jax-cuda12-plugin":
                raise metadata.PackageNotFoundError(name)
            return real(name)
        metadata.version = version
        import tensorflow as tf
        from framework import memory

        step = tf.function(lambda x: x * 2, jit_compile=True)
        try:
            memory.compiled_bytes(step, tf.TensorSpec([2]), target="p100")
        except ImportError as error:
            print(json.dumps({"type": type(error).__name__, "message": str(error)}))
        """
    )
    assert result["type"] == "MissingDependency"
    assert result["message"] == (
        'planning for a GPU needs jax-cuda12-plugin: pip install -e ".[gpu]"'
    )
