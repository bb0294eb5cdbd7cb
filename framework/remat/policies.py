"""Remat policies: which values computed inside a checkpointed region the backward pass keeps.

A policy is a predicate over one op created inside the region (its type, output shapes and dtypes,
and the tag given by `checkpoint_name`). Outputs of ops it accepts are saved in the forward pass and
reused by the recomputation; everything else is recomputed. The names follow
`jax.checkpoint_policies` so a JAX user finds the same vocabulary, and strings select them so gin
configs can name a policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import tensorflow as tf

DOT_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})

# What recomputing a value costs, in FLOPs per value, where it is not a product. A FLOP here is
# one of a matrix unit's, and vector work is slower per operation than that on every backend: a
# random op's draw (Philox rounds, a conversion, ~50-100 vector operations) took 11 ns per value
# on XLA:CPU here, as long as ~1200 FLOPs of a matrix product at the 108 GFLOP/s the same machine
# reached; matrix units outrun vector units by 10-30x on GPUs and TPUs too. A value computed from
# random bits costs its draw's share (`OpInfo.random_flops`): a mask compared from a full-size draw
# about 1000, one hashed from a few random key words (`framework.models.Dropout`) a few dozen.
# Other ops count one per value: XLA fuses them into the op that reads them, so recomputing them
# costs about what reading them would.
RANDOM_FLOPS_PER_VALUE = 1000
ELEMENTWISE_FLOPS_PER_VALUE = 1


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What a policy sees of one op: enough to decide, nothing that ties it to a graph."""

    op_type: str
    shapes: tuple[tuple[int | None, ...], ...]
    dtypes: tuple[tf.DType, ...]
    name: str | None = None
    attrs: tuple = ()
    input_shapes: tuple[tuple[int | None, ...], ...] = ()
    random: bool = False  # computed from random bits and constants alone (a dropout keep mask)
    # FLOPs per value of recomputing a random value: its draw and the ops after it
    random_flops: float = RANDOM_FLOPS_PER_VALUE

    def attr(self, key: str):
        """Returns the attribute `key` (an `AttrValue` proto) or None."""
        for k, v in zip(self.attrs[::2], self.attrs[1::2], strict=False):
            if k == key:
                return v
        return None


Policy = Callable[[OpInfo], bool]


def everything_saveable(op: OpInfo) -> bool:
    """Saves every value: no recomputation at all (the region runs as if not checkpointed)."""
    return True


def nothing_saveable(op: OpInfo) -> bool:
    """Saves nothing but the region's inputs: full recomputation, the least memory."""
    return False


def dots_saveable(op: OpInfo) -> bool:
    """Saves the outputs of matrix multiplications (MatMul, BatchMatMul*, Einsum).

    The expensive FLOPs are kept; the cheap elementwise work (norms, activations, dropout, softmax)
    around them is recomputed.
    """
    return op.op_type in DOT_OPS


def random_masks_saveable(op: OpInfo) -> bool:
    """Saves boolean values computed from random bits alone: the keep masks of dropout.

    Kept masks are stored as bits (one per value) instead of rerunning the random number generator
    in the recomputation, which on XLA:CPU costs more than the rest of the dropout layer (about
    11 ns per element here).
    Combine it with another policy: `"dots_saveable+random_masks_saveable"`.
    """
    return op.random and bool(op.dtypes) and all(d == tf.bool for d in op.dtypes)


def save_from_both_policies(first: Policy, second: Policy) -> Policy:
    """Saves what either policy saves (as `jax.checkpoint_policies.save_from_both_policies`).

    Not for a `MemoryBudget`, which decides per region: its budget already ranks every value.
    """
    if any(isinstance(p, MemoryBudget) for p in (first, second)):
        raise ValueError(
            "a memory budget policy cannot be joined with another policy: it already weighs "
            "every value (dropout masks and products first); use 'budget:F' alone"
        )

    def policy(op: OpInfo) -> bool:
        return first(op) or second(op)

    policy.__name__ = f"{policy_name(first)}+{policy_name(second)}"
    return policy


def policy_name(policy: Policy) -> str:
    """A policy's name for messages and reports (its `__name__`, or its repr)."""
    return getattr(policy, "__name__", repr(policy))


def _einsum_labels(op: OpInfo) -> tuple[list[str], str] | None:
    """An einsum's (operand labels, output labels), spaces removed; None without an explicit
    output."""
    equation = op.attr("equation")
    if equation is None:
        return None
    text = equation.s.decode() if hasattr(equation, "s") else str(equation)
    if "->" not in text:
        return None
    lhs, out = text.replace(" ", "").split("->")
    return lhs.split(","), out


def _einsum_has_batch_dims(op: OpInfo) -> bool:
    labels = _einsum_labels(op)
    if labels is None or len(labels[0]) != 2:
        return True
    (a, b), out = [x.replace("...", "") for x in labels[0]], labels[1].replace("...", "")
    return bool(set(a) & set(b) & set(out))


def dots_with_no_batch_dims_saveable(op: OpInfo) -> bool:
    """Saves matrix multiplications without batch dimensions (weight matmuls, not attention).

    A batch dimension is one both operands and the output share: `BatchMatMul` of two rank>2
    operands, or an einsum label present in both inputs and the output (`bhqd,bhkd->bhqk`).
    Projections such as `bsd,df->bsf` or a rank-3 x rank-2 matmul have none and are saved.
    """
    if op.op_type == "MatMul":
        return True
    if op.op_type.startswith("BatchMatMul"):
        ranks = [len(s) for s in op.input_shapes[:2]]
        return len(ranks) == 2 and min(ranks) <= 2
    if op.op_type == "Einsum":
        return not _einsum_has_batch_dims(op)
    return False


def save_only_these_names(*names: str) -> Policy:
    """Saves exactly the values tagged with `checkpoint_name(x, name)` for a name in `names`."""
    wanted = frozenset(names)

    def policy(op: OpInfo) -> bool:
        return op.name is not None and op.name in wanted

    policy.__name__ = f"save_only_these_names{tuple(sorted(wanted))}"
    return policy


def save_any_names_but_these(*names: str) -> Policy:
    """Saves every tagged value except those tagged with a name in `names`."""
    excluded = frozenset(names)

    def policy(op: OpInfo) -> bool:
        return op.name is not None and op.name not in excluded

    policy.__name__ = f"save_any_names_but_these{tuple(sorted(excluded))}"
    return policy


# Ops that compute nothing (a new view of their input): keeping their output saves no work.
LAYOUT_OPS = frozenset({"Reshape", "ExpandDims", "Squeeze", "Identity", "StopGradient"})


def _elements(shape: tuple[int | None, ...]) -> int:
    return 0 if any(d is None for d in shape) else math.prod(shape)


# Bits a kept boolean value (a dropout mask) takes in each compiler's plan: remat packs kept masks
# into 32-bit words, which XLA:CPU and XLA:GPU store as they are; libtpu undoes the packing and
# stores a `pred` per value (ViT-B/16 at batch 64 with `random_masks_saveable`: 1.3 GiB over full
# remat on TPU v5e, 0.04 GiB on a P100).
MASK_BITS = {"CPU": 1, "GPU": 1, "TPU": 8}


def kept_bytes(op: OpInfo, mask_bits: int = 1) -> int:
    """What keeping `op`'s outputs costs: their bytes, a boolean as `mask_bits` bits (packed:
    1; see `MASK_BITS`)."""
    total = 0
    for shape, dtype in zip(op.shapes, op.dtypes, strict=False):
        values = _elements(shape)
        total += -(-values * mask_bits // 8) if dtype == tf.bool else values * dtype.size
    return total


def _contracted(op: OpInfo) -> int:
    """The size of the dimensions a product sums over (1 when the shapes do not say)."""
    a = op.input_shapes[0] if op.input_shapes else ()
    if op.op_type == "MatMul" and len(a) == 2:
        transposed = op.attr("transpose_a")
        return a[0] if transposed is not None and transposed.b else a[1]
    if op.op_type.startswith("BatchMatMul") and len(a) >= 2:
        adjoint = op.attr("adj_x")
        return a[-2] if adjoint is not None and adjoint.b else a[-1]
    labels = _einsum_labels(op) if op.op_type == "Einsum" else None
    if labels is not None and "." not in "".join(labels[0]):
        operands, out = labels
        sizes = {
            label: size
            for letters, shape in zip(operands, op.input_shapes, strict=False)
            for label, size in zip(letters, shape, strict=False)
        }
        summed = [sizes[label] for label in set("".join(operands)) - set(out)]
        return math.prod(summed) if all(summed) else 1
    if op.op_type.startswith("Conv") and len(op.input_shapes) > 1:
        kernel = op.input_shapes[1]  # [spatial..., in, out]
        return math.prod(kernel[:-1]) if all(kernel[:-1]) else 1
    return 1


def _is_product(op: OpInfo) -> bool:
    """A matrix product or a convolution."""
    return op.op_type in DOT_OPS or op.op_type.startswith("Conv")


def recompute_flops(op: OpInfo) -> int:
    """What recomputing `op` costs, roughly: 2 x values x contracted size for a matrix product or
    convolution (exact), a random mask's draw (`OpInfo.random_flops`), one FLOP per value
    otherwise; nothing for a layout op, and nothing for integer outputs (shapes and indices:
    cheap, and a kept shape would hide its static value from the recomputation)."""
    if op.op_type in LAYOUT_OPS or not all(d.is_floating or d == tf.bool for d in op.dtypes):
        return 0
    values = sum(_elements(shape) for shape in op.shapes)
    if _is_product(op):
        return 2 * values * _contracted(op)
    if random_masks_saveable(op):
        return round(op.random_flops * values)
    return ELEMENTWISE_FLOPS_PER_VALUE * values


# What TensorFlow's gradient of an op reads of the forward pass, besides static shapes: nothing,
# its outputs, or (any other op) its inputs. Without remat the backward pass holds exactly these
# values; a value nothing reads needs no keeping. An op missing here counts as reading its inputs
# and outputs, which may weigh a value needlessly but never drops one that is read.
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


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """Keeps the values worth keeping within `fraction` of what the region holds without remat.

    PyTorch's `activation_memory_budget` for TensorFlow, per region. Without remat the backward
    pass holds the values its gradients read (a product's inputs, a softmax's output, ...: see
    `gradient_reads`); their bytes are the budget's whole. Of those values, of the dropout masks
    compared from a full-size draw (kept as bits, sparing the draw; see `_weighed` for masks
    hashed from a few random words, which it never keeps) and of the products (read or not: a
    product's output usually feeds a bias add or a reshape, which the gradient reads, and
    recomputing those from a kept product is cheap), the ones whose recomputation costs the most
    FLOPs per byte kept (masks first, at a bit a value, then matrix products, then elementwise
    work) are kept in that order while their bytes stay within `fraction` of the whole; a value
    that does not fit is passed over for smaller ones after it. A value whose recomputation
    costs nothing (a reshape, an integer shape) is never kept. 0 keeps nothing (as
    `nothing_saveable`); 1 keeps what the whole pays for. The pick depends on the region's ops
    alone (ties go to the earlier op), so the same model always keeps the same values, and
    `print_saved_residuals` names each kept value with its FLOPs per byte. The FLOP count is per
    op: it ignores that keeping a value can also spare recomputing what only it needed.

    Unlike the other policies it decides per region, not per op: a region calls `select` once
    its forward pass is recorded. `mask_bits` prices a kept mask value as the target compiler
    stores it (`MASK_BITS`: a bit on XLA:CPU and GPUs, a byte on TPUs), which the trainer sets
    from the device the run trains on (`get_policy(name, mask_bits=...)`).
    """

    fraction: float
    mask_bits: int = 1

    def __post_init__(self) -> None:
        fraction = self.fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not (0.0 <= fraction <= 1.0)
        ):
            raise ValueError(f"memory budget fraction must be in [0, 1], got {self.fraction!r}")

    @property
    def __name__(self) -> str:
        return f"budget:{self.fraction:g}"

    def __call__(self, op: OpInfo) -> bool:
        """Every value is a candidate; `select` decides."""
        return True

    def select(self, ops: list[OpInfo], read: list[bool]) -> dict[int, float]:
        """The positions in `ops` of the values to keep, each with its FLOPs per byte; `read[i]`
        says whether the backward pass reads `ops[i]`'s outputs (`gradient_reads`)."""
        costs = [kept_bytes(op, self.mask_bits) for op in ops]
        budget = self.fraction * sum(cost for cost, r in zip(costs, read, strict=True) if r)
        ratios = [
            recompute_flops(op) / max(cost, 1) if _weighed(op, r) else 0.0
            for op, cost, r in zip(ops, costs, read, strict=True)
        ]
        kept: dict[int, float] = {}
        spent = 0
        for i in sorted(range(len(ops)), key=lambda i: (-ratios[i], i)):
            if ratios[i] > 0 and spent + costs[i] <= budget:
                kept[i] = ratios[i]
                spent += costs[i]
        return kept


def _weighed(op: OpInfo, read: bool) -> bool:
    """Whether the budget weighs keeping `op`'s outputs: a value the gradient reads; a product
    even if none does (the recomputation then skips it: the elementwise op after a matmul, e.g.
    a bias add, is what the gradient reads, and recomputing it from the kept product costs next
    to nothing, as `dots_saveable` does); a dropout mask only if it is compared from a full-size
    draw. A mask hashed from a few random words (`framework.models.Dropout`, whose redraw is a
    few dozen integer operations per value) is never kept: XLA fuses that redraw into every
    consumer, so a compiled step without remat holds no such mask, and keeping one costs its
    bits (a byte per value in libtpu's plans, which store masks as `pred`) and, measured on
    XLA:CPU with ViT-B/16, more step time than the redraw it spares."""
    if random_masks_saveable(op):
        return op.random_flops >= RANDOM_FLOPS_PER_VALUE
    return read or _is_product(op)


def memory_budget(fraction: float, mask_bits: int = 1) -> MemoryBudget:
    """A `MemoryBudget` policy: keep at most `fraction` of the bytes everything would keep."""
    return MemoryBudget(fraction, mask_bits)


BUDGET_PREFIX = "budget:"

_NAMED: dict[str, Policy] = {
    "everything_saveable": everything_saveable,
    "nothing_saveable": nothing_saveable,
    "dots_saveable": dots_saveable,
    "dots_with_no_batch_dims_saveable": dots_with_no_batch_dims_saveable,
    "random_masks_saveable": random_masks_saveable,
    "full": nothing_saveable,
    "dots": dots_saveable,
}
_NO_REMAT = ("none",)


def policy_names() -> list[str]:
    """All strings `get_policy` accepts (`budget:<fraction>` for any fraction in [0, 1])."""
    return sorted(_NAMED) + list(_NO_REMAT) + [f"{BUDGET_PREFIX}<fraction>"]


def get_policy(policy: str | Policy | None, mask_bits: int = 1) -> Policy:
    """Resolves a policy given by name or as a callable.

    `None` and `"none"` mean no remat and resolve to `everything_saveable`, which `checkpoint`
    treats as a plain call of the wrapped function (no recomputation, no overhead). An unknown name
    raises ValueError listing the choices. `mask_bits` is what a memory budget ("budget:F")
    prices a kept mask value at (`MASK_BITS` of the compiler the step is planned for).
    """
    if policy is None:
        return everything_saveable
    if callable(policy):
        return policy
    if isinstance(policy, str):
        key = policy.strip().lower()
        if key in _NO_REMAT:
            return everything_saveable
        if key in _NAMED:
            return _NAMED[key]
        parts = [part.strip() for part in key.split("+")]
        if len(parts) > 1 and all(p in _NAMED or p.startswith(BUDGET_PREFIX) for p in parts):
            combined = get_policy(parts[0], mask_bits)
            for part in parts[1:]:
                combined = save_from_both_policies(combined, get_policy(part, mask_bits))
            return combined
        if key.startswith(BUDGET_PREFIX):
            try:
                fraction = float(key.removeprefix(BUDGET_PREFIX))
            except ValueError:
                fraction = None
            if fraction is not None and 0.0 <= fraction <= 1.0:
                return MemoryBudget(fraction, mask_bits)
            raise ValueError(
                f"Remat policy {policy!r}: a memory budget is 'budget:F' with F a fraction in "
                "[0, 1] of the bytes keeping everything would cost, e.g. 'budget:0.3'."
            )
    raise ValueError(
        f"Unknown remat policy {policy!r}. Choose one of {policy_names()} or join them with '+' "
        "(saves what any of them saves), or pass a callable taking an OpInfo, e.g. "
        "save_only_these_names('attn_out')."
    )
