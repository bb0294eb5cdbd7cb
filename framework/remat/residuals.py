"""What the backward pass keeps: `saved_residuals(fn, *args)` and `print_saved_residuals`.

Like `jax.ad_checkpoint.print_saved_residuals`: `fn` and its gradient (with respect to its
floating-point tensor arguments and the variables it reads) are traced into one graph; every
tensor of the forward part that an op of the backward part consumes is a residual, i.e. memory
held from the forward pass until the backward pass. This is the graph-level view: XLA may still fuse
or drop some of them, which only lowers the real figure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from framework.remat.names import TAG_ATTR
from framework.remat.replay import KEPT_ATTR


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor kept for the backward pass."""

    origin: str
    kind: str  # "argument", "weight" or "activation"
    shape: tuple[int | None, ...]
    dtype: str
    bytes: int


def _origin(tensor: tf.Tensor, arguments: dict) -> tuple[str, str]:
    op = tensor.op
    if tensor.ref() in arguments:
        return f"argument {arguments[tensor.ref()]}", "argument"
    if op.type == "ReadVariableOp":
        return f"weight {op.name.rsplit('/ReadVariableOp', 1)[0]}", "weight"
    for attr, template in ((KEPT_ATTR, "{}"), (TAG_ATTR, "checkpoint_name {!r}")):
        try:
            return template.format(op.get_attr(attr).decode()), "activation"
        except ValueError:
            pass
    return f"{op.type} ({op.name})", "activation"


def _size(shape: tuple[int | None, ...], dtype: tf.DType) -> int:
    if any(d is None for d in shape):
        return 0
    return int(np.prod(shape, dtype=np.int64)) * dtype.size


def saved_residuals(fn: Callable, *args, **kwargs) -> list[Residual]:
    """Lists the tensors kept from the forward pass of `fn(*args, **kwargs)` for its gradient."""
    flat = tf.nest.flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, (tf.Tensor, np.ndarray))]
    found: list[tf.Tensor] = []
    names: dict = {}

    def traced(*tensors):
        full = list(flat)
        for i, t in zip(positions, tensors, strict=False):
            full[i] = t
        a, kw = tf.nest.pack_sequence_as((args, kwargs), full)
        sources = [t for t in tensors if t.dtype.is_floating]
        for i, t in zip(positions, tensors, strict=False):
            names[t.ref()] = f"#{i}"
        with tf.GradientTape() as tape:
            tape.watch(sources)
            out = fn(*a, **kw)
        targets = [t for t in tf.nest.flatten(out) if t.dtype.is_floating]
        graph = tf.compat.v1.get_default_graph()
        forward_ops = set(graph.get_operations())
        tape.gradient(targets, sources + list(tape.watched_variables()))
        seen = set()
        for op in graph.get_operations():
            if op in forward_ops:
                continue
            for t in op.inputs:
                if t.op in forward_ops and t.ref() not in seen:
                    seen.add(t.ref())
                    found.append(t)
        return 0

    specs = [tf.TensorSpec.from_tensor(tf.convert_to_tensor(flat[i])) for i in positions]
    tf.function(traced, autograph=False).get_concrete_function(*specs)
    rows = []
    for t in found:
        if t.op.type == "Const" or t.dtype in (tf.resource, tf.variant):
            continue
        origin, kind = _origin(t, names)
        shape = tuple(t.shape.as_list()) if t.shape.rank is not None else ()
        rows.append(Residual(origin, kind, shape, t.dtype.name, _size(shape, t.dtype)))
    return rows


def print_saved_residuals(fn: Callable, *args, **kwargs) -> list[Residual]:
    """Prints `saved_residuals(fn, *args, **kwargs)` as a table with totals, and returns it."""
    rows = saved_residuals(fn, *args, **kwargs)
    width = max([len(r.origin) for r in rows] + [6])
    print(f"{'origin':<{width}}  {'kind':<10}  {'shape':<20}  {'dtype':<8}  {'bytes':>12}")
    for r in rows:
        shape = "[" + ",".join(str(d) for d in r.shape) + "]"
        print(f"{r.origin:<{width}}  {r.kind:<10}  {shape:<20}  {r.dtype:<8}  {r.bytes:>12,}")
    total = sum(r.bytes for r in rows)
    activations = sum(r.bytes for r in rows if r.kind == "activation")
    print(f"total: {len(rows)} tensors, {total:,} bytes ({activations:,} bytes of activations)")
    return rows
