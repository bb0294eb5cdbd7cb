"""What TensorFlow's gradient of each op reads of the forward pass: without remat the backward
pass holds exactly those values, so they are what a memory budget's whole is made of, and a value
no gradient reads needs no keeping."""

from __future__ import annotations

from framework.remat.costs import LAYOUT_OPS
from framework.remat.op_info import DOT_OPS

# Besides static shapes, a gradient reads nothing, its outputs, or (any other op) its inputs. An
# op missing here counts as reading its inputs and outputs, which may weigh a value needlessly
# but never drops one that is read.
GRADIENT_READS_NOTHING = frozenset(
    {
        *LAYOUT_OPS,
        "Add",
        "AddV2",
        "AddN",
        "Sub",
        "Neg",
        "BiasAdd",
        "Cast",
        "Sum",
        "Mean",
        "Transpose",
        "ConcatV2",
        "Split",
        "SplitV",
        "Unpack",
        "Pack",
        "StridedSlice",
        "Slice",
        "Pad",
        "BroadcastTo",
        "Tile",
        "ZerosLike",
        "OnesLike",
        "Fill",
        "Shape",
        # Comparisons and logic have no gradient.
        "Greater",
        "GreaterEqual",
        "Less",
        "LessEqual",
        "Equal",
        "NotEqual",
        "LogicalAnd",
        "LogicalOr",
        "LogicalNot",
    }
)
GRADIENT_READS_OUTPUT = frozenset(
    {"Softmax", "LogSoftmax", "Tanh", "Sigmoid", "Exp", "Relu", "Relu6", "Elu", "Rsqrt", "Sqrt"}
)
GRADIENT_READS_INPUTS = frozenset(
    {
        *DOT_OPS,
        "Mul",
        "RealDiv",
        "Div",
        "DivNoNan",
        "Square",
        "SquaredDifference",
        "Erf",
        "Erfc",
        "Log",
        "Log1p",
        "Sin",
        "Cos",
        "Abs",
        "Softplus",
        "Pow",
        "Maximum",
        "Minimum",
        "Conv2D",
        "Conv3D",
        "DepthwiseConv2dNative",
    }
)
# Ops whose gradient reads only some inputs: a select reads its condition, not its branches.
GRADIENT_READS_SOME_INPUTS = {"Select": (0,), "SelectV2": (0,)}


def gradient_reads(op_type: str, num_inputs: int) -> tuple[tuple[int, ...], bool]:
    """(positions of the inputs it reads, whether it reads its outputs) for the gradient of an
    op of `op_type`; an unknown op counts as reading all of them."""
    everything = tuple(range(num_inputs))
    if op_type in GRADIENT_READS_NOTHING:
        return (), False
    if op_type in GRADIENT_READS_OUTPUT:
        return (), True
    if op_type in GRADIENT_READS_INPUTS:
        return everything, False
    if op_type in GRADIENT_READS_SOME_INPUTS:
        return GRADIENT_READS_SOME_INPUTS[op_type], False
    return everything, True
