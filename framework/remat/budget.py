"""`MemoryBudget`: the policy that decides per region which values to keep, the dearest to
recompute per byte first, within a fraction of what the region holds without remat."""

from __future__ import annotations

import dataclasses

from framework.remat.costs import RANDOM_FLOPS_PER_VALUE, kept_bytes, recompute_flops
from framework.remat.op_info import OpInfo

BUDGET_PREFIX = "budget:"


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
    if op.is_random_mask:
        return op.random_flops >= RANDOM_FLOPS_PER_VALUE
    return read or op.is_product


def memory_budget(fraction: float, mask_bits: int = 1) -> MemoryBudget:
    """A `MemoryBudget` policy: keep at most `fraction` of the bytes everything would keep."""
    return MemoryBudget(fraction, mask_bits)
