"""The dot and convolution FLOPs an XLA program executes, read from its HLO.

Counted for any compiler's program: before optimisation every matrix product is a `dot`; after
a GPU compiler's, most are calls of cuBLAS (GEMMs) and cuDNN (convolutions), counted the same
way from the dimension numbers they keep. Loops count as many times as they run. Elementwise
work is left out, as model FLOP figures usually do.
"""

from __future__ import annotations

import json
import math

from framework.core.tf_internals import hlo_pb2, xla_data_pb2


def _dimensions(shape) -> list[int]:
    return list(shape.dimensions)


def _library_call(instruction) -> str | None:
    """The operation a GPU compiler's call of cuBLAS ("dot") or cuDNN ("convolution") stands
    for, or None for any other instruction."""
    target = instruction.custom_call_target
    if instruction.opcode != "custom-call":
        return None
    if target.startswith("__cublas$") and "gemm" in instruction.backend_config.decode():
        return "dot"
    return "convolution" if target.startswith("__cudnn$conv") else None


def _convolution_shapes(instruction, by_id: dict) -> tuple[list[int], list[int]]:
    """(the forward convolution's output, its kernel) of a convolution. A cuDNN call keeps the
    forward convolution's dimension numbers whatever it computes: its result is the output
    (forward), the input's gradient (then the output is operand 0) or the kernel's gradient
    (then the output is operand 1 and the kernel the result); the result comes first, beside
    a workspace."""
    operands = [_dimensions(by_id[i].shape) for i in instruction.operand_ids]
    if instruction.opcode == "convolution":
        return _dimensions(instruction.shape), operands[1]
    result = _dimensions(instruction.shape.tuple_shapes[0])
    if instruction.custom_call_target.endswith("BackwardInput"):
        return operands[0], operands[1]
    if instruction.custom_call_target.endswith("BackwardFilter"):
        return operands[1], result
    return result, operands[1]


def _instruction_flops(instruction, by_id: dict) -> int:
    """2 FLOPs per multiply-add of a dot or convolution, or of the library call in its place."""
    kind = _library_call(instruction) or instruction.opcode
    if kind == "dot":
        shape = instruction.shape
        if instruction.opcode == "dot":
            contracting = list(instruction.dot_dimension_numbers.lhs_contracting_dimensions)
        else:  # a GEMM keeps its dimension numbers in its config, its result beside a workspace
            shape = shape.tuple_shapes[0]
            config = json.loads(instruction.backend_config)["gemm_backend_config"]
            contracting = config["dot_dimension_numbers"]["lhs_contracting_dimensions"]
        lhs = _dimensions(by_id[instruction.operand_ids[0]].shape)
        return 2 * math.prod(_dimensions(shape)) * math.prod(lhs[int(d)] for d in contracting)
    if kind == "convolution":
        output, kernel = _convolution_shapes(instruction, by_id)
        numbers = instruction.convolution_dimension_numbers
        window = math.prod(kernel[d] for d in numbers.kernel_spatial_dimensions)
        # A strided convolution's input gradient is a convolution of the gradient spread out
        # with zeros (its input dilated): only one input position in `dilated` is not a zero.
        dilated = math.prod(max(1, d.base_dilation) for d in instruction.window.dimensions)
        macs = math.prod(output) * window * kernel[numbers.kernel_input_feature_dimension]
        return 2 * macs // dilated
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
