"""Remat policies: which values computed inside a checkpointed region the backward pass keeps.

A policy is a predicate over one op created inside the region (its type, output shapes and dtypes,
and the tag given by `checkpoint_name`). Outputs of ops it accepts are saved in the forward pass and
reused by the recomputation; everything else is recomputed. The names follow
`jax.checkpoint_policies` so a JAX user finds the same vocabulary, and strings select them so gin
configs can name a policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf

DOT_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})


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
    """Saves what either policy saves (as `jax.checkpoint_policies.save_from_both_policies`)."""

    def policy(op: OpInfo) -> bool:
        return first(op) or second(op)

    policy.__name__ = f"{_name(first)}+{_name(second)}"
    return policy


def _name(policy: Policy) -> str:
    return getattr(policy, "__name__", repr(policy))


def _einsum_has_batch_dims(op: OpInfo) -> bool:
    equation = op.attr("equation")
    if equation is None:
        return True
    text = equation.s.decode() if hasattr(equation, "s") else str(equation)
    text = text.replace(" ", "").replace("...", "")
    if "->" not in text:
        return True
    lhs, out = text.split("->")
    operands = lhs.split(",")
    if len(operands) != 2:
        return True
    return bool(set(operands[0]) & set(operands[1]) & set(out))


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
    """All strings `get_policy` accepts."""
    return sorted(_NAMED) + list(_NO_REMAT)


def get_policy(policy: str | Policy | None) -> Policy:
    """Resolves a policy given by name or as a callable.

    `None` and `"none"` mean no remat and resolve to `everything_saveable`, which `checkpoint`
    treats as a plain call of the wrapped function (no recomputation, no overhead). An unknown name
    raises ValueError listing the choices.
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
        if len(parts) > 1 and all(part in _NAMED for part in parts):
            combined = _NAMED[parts[0]]
            for part in parts[1:]:
                combined = save_from_both_policies(combined, _NAMED[part])
            return combined
    raise ValueError(
        f"Unknown remat policy {policy!r}. Choose one of {policy_names()} or join them with '+' "
        "(saves what any of them saves), or pass a callable taking an OpInfo, e.g. "
        "save_only_these_names('attn_out')."
    )
