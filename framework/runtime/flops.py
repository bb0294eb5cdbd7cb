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
import json
import logging
import math
import time
from collections.abc import Callable

import tensorflow as tf

from framework import memory
from framework.core.tf_internals import hlo_pb2, xla_data_pb2

FORWARD_AND_BACKWARD = 3  # a matmul's backward pass is two matmuls of the same size


def _dimensions(shape) -> list[int]:
    return list(shape.dimensions)


def _instruction_flops(instruction, by_id: dict) -> int:
    out = math.prod(_dimensions(instruction.shape))
    if instruction.opcode == "dot":
        lhs = _dimensions(by_id[instruction.operand_ids[0]].shape)
        numbers = instruction.dot_dimension_numbers
        return 2 * out * math.prod(lhs[d] for d in numbers.lhs_contracting_dimensions)
    if instruction.opcode == "convolution":
        kernel = _dimensions(by_id[instruction.operand_ids[1]].shape)
        numbers = instruction.convolution_dimension_numbers
        window = math.prod(kernel[d] for d in numbers.kernel_spatial_dimensions)
        return 2 * out * window * kernel[numbers.kernel_input_feature_dimension]
    return 0


def _is_condition(computation, by_id: dict) -> bool:
    """Whether a loop's called computation is its condition (a scalar predicate)."""
    root = by_id[computation.root_id]
    return root.shape.element_type == xla_data_pb2.PRED and not root.shape.dimensions


def _trip_count(instruction, computations: dict, by_id: dict) -> int | None:
    """The loop's trip count: XLA's own when it found it, else the smallest constant bound
    of a `counter < constant` test in its condition (TensorFlow's loops count from 0; a
    `maximum_iterations` adds a second such test, which hides the count from XLA)."""
    try:
        config = json.loads(instruction.backend_config or b"{}")
        return int(config["known_trip_count"]["n"])
    except (ValueError, KeyError, TypeError):
        pass
    bounds = []

    def instructions(computation_id: int) -> list:  # with those of the fusions it calls
        found = []
        for inner in computations[computation_id].instructions:
            found.append(inner)
            for called in inner.called_computation_ids:
                found += instructions(called)
        return found

    tests = [
        test
        for called in instruction.called_computation_ids
        if _is_condition(computations[called], by_id)
        for test in instructions(called)
    ]
    for test in tests:
        if test.opcode == "compare" and test.comparison_direction == "LT":
            bound = by_id[test.operand_ids[1]]
            values = [*bound.literal.s32s, *bound.literal.s64s]
            if bound.opcode == "constant" and len(values) == 1:
                bounds.append(values[0])
    return min(bounds) if bounds else None


def hlo_matmul_flops(module: hlo_pb2.HloModuleProto) -> tuple[int, bool]:
    """FLOPs of the dots and convolutions a module executes; and whether the count is exact
    (False when a loop's trip count is unknown: its body is then counted once)."""
    computations = {c.id: c for c in module.computations}
    by_id = {i.id: i for c in module.computations for i in c.instructions}
    flops, exact = 0, True

    def visit(computation_id: int, times: int) -> None:
        nonlocal flops, exact
        for instruction in computations[computation_id].instructions:
            flops += times * _instruction_flops(instruction, by_id)
            repeat = 1
            if instruction.opcode == "while":
                trips = _trip_count(instruction, computations, by_id)
                exact = exact and trips is not None
                repeat = trips or 1
            for called in instruction.called_computation_ids:
                visit(called, times * repeat)

    visit(module.entry_computation_id, 1)
    return flops, exact


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
