"""Remat policies: which values computed inside a checkpointed region the backward pass keeps.

A policy is a predicate over one op created inside the region (its type, output shapes and dtypes,
and the tag given by `checkpoint_name`). Outputs of ops it accepts are saved in the forward pass and
reused by the recomputation; everything else is recomputed. The names follow
`jax.checkpoint_policies` so a JAX user finds the same vocabulary, and strings select them so gin
configs can name a policy.
"""

from __future__ import annotations

from framework.remat.budget import BUDGET_PREFIX, MemoryBudget, memory_budget
from framework.remat.costs import (
    ELEMENTWISE_FLOPS_PER_VALUE,
    MASK_BITS,
    RANDOM_FLOPS_PER_VALUE,
    kept_bytes,
    recompute_flops,
)
from framework.remat.gradient_reads import gradient_reads
from framework.remat.op_info import DOT_OPS, OpInfo, Policy

# The cost model's and the budget's names, for code that reaches them through the policies.
__all__ = [
    "BUDGET_PREFIX",
    "DOT_OPS",
    "ELEMENTWISE_FLOPS_PER_VALUE",
    "MASK_BITS",
    "RANDOM_FLOPS_PER_VALUE",
    "MemoryBudget",
    "OpInfo",
    "Policy",
    "UnmatchedNameWarning",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "get_policy",
    "gradient_reads",
    "kept_bytes",
    "memory_budget",
    "nothing_saveable",
    "policy_name",
    "policy_names",
    "policy_tag_names",
    "random_masks_saveable",
    "recompute_flops",
    "save_any_names_but_these",
    "save_from_both_policies",
    "save_only_these_names",
]


class UnmatchedNameWarning(UserWarning):
    """A name-based policy names a tag that no `checkpoint_name` at a region's top level gives:
    a misspelt name would otherwise keep (or exclude) nothing, silently."""


def policy_tag_names(policy: Policy) -> frozenset[str]:
    """The `checkpoint_name` tags a name-based policy selects or excludes (none for others)."""
    return getattr(policy, "tag_names", frozenset())


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
    return op.is_random_mask


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
    policy.tag_names = policy_tag_names(first) | policy_tag_names(second)
    return policy


def policy_name(policy: Policy) -> str:
    """A policy's name for messages and reports (its `__name__`, or its repr)."""
    return getattr(policy, "__name__", repr(policy))


def _einsum_has_batch_dims(op: OpInfo) -> bool:
    labels = op.einsum_labels()
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
    policy.tag_names = wanted
    return policy


def save_any_names_but_these(*names: str) -> Policy:
    """Saves every tagged value except those tagged with a name in `names`."""
    excluded = frozenset(names)

    def policy(op: OpInfo) -> bool:
        return op.name is not None and op.name not in excluded

    policy.__name__ = f"save_any_names_but_these{tuple(sorted(excluded))}"
    policy.tag_names = excluded
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
