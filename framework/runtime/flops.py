"""Model FLOPs of a step, counted in XLA's own program, and the peak they are measured against.

`model_flops_per_step` counts the multiply-adds of every dot and convolution in the compiled
forward pass (2 FLOPs each), times the trip count of the loops they sit in (scan over layers),
and takes three times that for a training step: the backward pass of a matrix product costs two
more of the same size. Elementwise ops, softmax and normalisation are left out, as MFU figures
usually do; remat's recomputation is left out too, so the utilisation is of *model* FLOPs (MFU),
not of the hardware's (HFU): recomputing does not make a model learn faster.

Counting in XLA's program rather than from layer formulas covers any Keras model (attention's
einsums included) without knowing its layers. The program is read before XLA optimises it for a
device: there every matrix product is still a `dot` (GPU compilers turn them into library calls),
and loop bounds are still constants the count can read.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import tensorflow as tf

from framework import memory
from framework.core.tf_internals import hlo_pb2
from framework.memory.hlo_flops import hlo_matmul_flops

FORWARD_AND_BACKWARD = 3  # a matmul's backward pass is two matmuls of the same size


def forward_flops(forward: Callable, *args) -> tuple[int, bool]:
    """FLOPs of `forward(*args)` (a `tf.function(jit_compile=True)`) in XLA's program; and
    whether the count is exact (see `hlo_matmul_flops`). Nothing is compiled for a device."""
    ir = forward.experimental_get_compiler_ir(*args)
    return hlo_matmul_flops(hlo_pb2.HloModuleProto.FromString(ir(stage="hlo_serialized")))


def compiled_plan_and_flops(
    fn: Callable, *args, device: str | None = None
) -> tuple[memory.CompiledMemory, int]:
    """XLA's plan of `fn(*args)` on this host's device (`memory.compiled_bytes`'s figures) and
    the dot and convolution FLOPs of the same optimised program, from one compilation.

    The count is read after XLA's optimisation, unlike `forward_flops`: before it, a remat
    region's recomputation is still whole in the program, including the products whose kept
    outputs replace them (XLA removes those), so only the optimised count tells the policies'
    recomputation apart.
    """
    ir = fn.experimental_get_compiler_ir(*args)
    proto = hlo_pb2.HloProto.FromString(ir(stage="optimized_hlo_proto_serialized"))
    plan = memory.memory_from_hlo_proto(proto, compiler=memory.xla_compiler(device))
    return plan, hlo_matmul_flops(proto.hlo_module)[0]


def model_flops_per_step(model: tf.keras.Model, inputs) -> tuple[int, bool]:
    """Model FLOPs of one training step of `model` on `inputs` (one replica's batch): three
    times its forward pass's dot and convolution FLOPs."""
    forward = tf.function(lambda x: model(x, training=False), jit_compile=True)
    flops, exact = forward_flops(forward, inputs)
    return FORWARD_AND_BACKWARD * flops, exact


def count_step(
    model: tf.keras.Model, inputs, replicas: int, peak_per_device: float | None, peak_source: str
) -> tuple[float, float | None]:
    """Model FLOPs of a step over `replicas` replicas (each on `inputs`) and the peak FLOP/s of
    their devices (None if unknown), logged with where the peak comes from."""
    per_replica, exact = model_flops_per_step(model, inputs)
    logging.info(
        "model FLOPs per step: %.3g%s (3 x the forward pass's matmuls, counted in XLA's "
        "program); peak %s per device (%s)",
        per_replica * replicas,
        "" if exact else " or more (a loop's trip count is unknown)",
        f"{peak_per_device / 1e12:.3g} TFLOP/s" if peak_per_device else "unknown",
        peak_source,
    )
    return per_replica * replicas, peak_per_device and peak_per_device * replicas


@functools.cache
def measure_cpu_flops(size: int = 2048, seconds: float = 0.5) -> float:
    """FLOP/s of float32 matrix products on this machine's CPU: the peak MFU is measured
    against on CPUs, which have no datasheet figure for TensorFlow's kernels. The best of
    repeated `size`-square products over about `seconds`, after two to warm up (the first
    ones run slower while the thread pool starts), measured once per process. At 1024 the
    figure came out 5-50% low and moved between processes; at 2048 within 3% of 4096's."""
    with tf.device("/cpu:0"):
        a = tf.random.stateless_normal([size, size], seed=[0, 1])
        product = tf.function(lambda x: tf.matmul(x, a))
        for _ in range(2):
            product(a).numpy()
        best, start = 0.0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            began = time.perf_counter()
            product(a).numpy()
            best = max(best, 2 * size**3 / (time.perf_counter() - began))
    return best
