"""What a remat policy sees of one op recorded in a checkpointed region: `OpInfo`, a plain record
with no tie to a graph, so that policies, the cost model and the memory budget are functions of
values that tests can build by hand."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf

DOT_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})

# FLOPs per value of recomputing a value drawn from a full-size random draw (`costs.py` says why).
RANDOM_FLOPS_PER_VALUE = 1000


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

    @property
    def is_random_mask(self) -> bool:
        """Boolean values computed from random bits alone: the keep masks of dropout."""
        return self.random and bool(self.dtypes) and all(d == tf.bool for d in self.dtypes)

    @property
    def is_product(self) -> bool:
        """A matrix product or a convolution."""
        return self.op_type in DOT_OPS or self.op_type.startswith("Conv")

    def einsum_labels(self) -> tuple[list[str], str] | None:
        """An einsum's (operand labels, output labels), spaces removed; None for another op or an
        equation without an explicit output."""
        equation = self.attr("equation") if self.op_type == "Einsum" else None
        if equation is None:
            return None
        text = equation.s.decode() if hasattr(equation, "s") else str(equation)
        if "->" not in text:
            return None
        lhs, out = text.replace(" ", "").split("->")
        return lhs.split(","), out


Policy = Callable[[OpInfo], bool]
