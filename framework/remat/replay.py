"""Record a region's forward pass, replay it in the recomputation.

TensorFlow calls an op callback for every op created while a graph is built, and lets it return
replacement outputs. One callback per thread dispatches each op to the active regions:

* recording (the forward pass, traced into a function graph of its own): each op of the region's
  top level is noted (type, shapes, dtypes, `checkpoint_name` tag); the outputs the policy keeps
  become extra outputs of the function;
* replaying (the recomputation, built inline under a gradient tape): op number i of the top level
  must match recorded op number i (else `RecomputationMismatchError`, the determinism check); kept
  outputs replace the recomputed ones, so the recomputed op loses its consumers and is pruned
  while the tape still differentiates it.

Only the computing ops of the top level are numbered. Ops inside `tf.cond`/`tf.while_loop` bodies
and `tf.function`s the region calls belong to their control-flow or call op, which is recomputed
as one unit and never kept. Untagged identities, ops with only variant outputs and the call ops
themselves are not numbered either: TensorFlow adds such plumbing around control flow when more
than one tape watches it (as in a second-order gradient), so the forward pass and the
recomputation differ there without computing anything different. Ops of a nested checkpoint
belong to that checkpoint.

Stateless random ops - at the top level and in control-flow bodies - get their seeds offset by a
zero tied to the pass: to the region's inputs in the forward pass (else XLA draws every region's
random bits at the start of the step and keeps them alive), to the upstream gradient in the
recomputation (else XLA merges the recomputed draw with the forward one). The values of the seeds
themselves come back through the variable snapshots taken by `checkpoint` (see effects.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import tensorflow as tf

from framework.core import tf_internals
from framework.core.errors import RematError
from framework.remat.policies import (
    ELEMENTWISE_FLOPS_PER_VALUE,
    RANDOM_FLOPS_PER_VALUE,
    OpInfo,
    Policy,
    gradient_reads,
    policy_name,
)

_IGNORED_OPS = frozenset({"Placeholder", "Const", "NoOp"})
_CALL_OPS = frozenset(
    {
        "If",
        "StatelessIf",
        "While",
        "StatelessWhile",
        "Case",
        "StatelessCase",
        "PartitionedCall",
        "StatefulPartitionedCall",
    }
)
_NEVER_SAVED = frozenset({"ReadVariableOp", "VarHandleOp", "IdentityN"})
_SEED_ARGS = frozenset({"seed", "key", "counter"})
# Ops whose outputs depend on their inputs' shapes alone: constants as far as the values go (a
# dropout mask drawn over `tf.shape(x)` is still computed from random bits and constants alone).
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


class RecomputationMismatchError(RematError):
    """The recomputation of a region created different ops than its forward pass."""


class UnreplayableRandomOpError(RematError):
    """A stateful random op inside a region: its recomputation would draw different numbers."""


_local = threading.local()


def _stack() -> list[Region]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def in_region() -> bool:
    """True while this thread records or replays a region (nested checkpoints must stay active)."""
    return bool(_stack())


def tied_to_pass(t: tf.Tensor) -> tf.Tensor:
    """`t`, not computable before the innermost checkpointed region's pass starts: plus its zero
    (the inputs' in the forward pass, the upstream gradient's in the recomputation); outside
    checkpointed regions, `t` itself.

    For a value computed from a variable alone, such as a weight gathered from the shards of the
    other replicas: XLA would otherwise hoist it to the start of the step, merge the
    recomputation's with the forward pass's, and keep it for the whole step.
    """
    stack = _stack()
    if not stack or stack[-1]._mode is None:
        return t
    return with_dep(t, in_graph(stack[-1]._dep, tf.compat.v1.get_default_graph()))


def pending_tag() -> str | None:
    return getattr(_local, "tag", None)


@contextlib.contextmanager
def tagging(name: str) -> Iterator[None]:
    """Marks the next op created in this thread as `checkpoint_name(..., name)`."""
    previous = pending_tag()
    _local.tag = name
    try:
        yield
    finally:
        _local.tag = previous


def _is_random_op(op_type: str) -> bool:
    """Stateless random ops (`StatelessRandomUniformV2`, ...): their seeds are tied to the pass."""
    return op_type.startswith("Stateless") and op_type not in _CALL_OPS


def _shape(t: tf.Tensor) -> tuple[int | None, ...]:
    return tuple(t.shape.as_list()) if t.shape.rank is not None else ()


def _values(t: tf.Tensor) -> int | None:
    """The number of values of `t`, or None when its shape is not static."""
    return t.shape.num_elements()


def _describe(info: OpInfo) -> str:
    outs = ", ".join(f"{d.name}{list(s)}" for s, d in zip(info.shapes, info.dtypes, strict=False))
    tag = f" tagged {info.name!r}" if info.name else ""
    return f"{info.op_type}{tag} -> ({outs})"


def in_graph(t: tf.Tensor, graph: tf.Graph) -> tf.Tensor:
    """`t` as seen from `graph`: itself, or the placeholder through which `graph` captures it."""
    if getattr(t, "graph", None) is graph:
        return t
    return graph.capture(t)


def with_dep(t: tf.Tensor, dep: tf.Tensor) -> tf.Tensor:
    """`t` plus a zero: the same value, but not computable before `dep` exists."""
    if t.dtype == tf.bool:
        return tf.logical_or(t, tf.cast(dep, tf.bool))
    if t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_complex:
        return t + tf.cast(dep, t.dtype)
    return t


_WORD_BITS = 32
_WORD_BIT_VALUES = tuple(1 << i for i in range(_WORD_BITS))


def _packable(t: tf.Tensor) -> bool:
    return t.dtype == tf.bool and t.shape.is_fully_defined() and t.shape.num_elements() > 0


def _as_rows(shape: tf.TensorShape) -> tuple[int, int]:
    """A non-empty `shape` seen as a matrix (rows, columns) for `_pack_bits`.

    The columns are the last dimension, unless that leaves fewer rows than a word has bits: then
    padding to 32 rows would cost more than the values, and one column is used instead.
    """
    columns = shape[-1] if shape.rank >= 2 else 1
    rows = shape.num_elements() // columns
    return (rows, columns) if rows >= _WORD_BITS else (shape.num_elements(), 1)


def _pack_bits(mask: tf.Tensor) -> tf.Tensor:
    """A boolean tensor as uint32 words, one bit per value, for saving (e.g. a dropout mask).

    Saved as is, XLA fuses the comparison that made the mask into each consumer and keeps the
    4-byte random bits it compared instead; the reduction here is not fused into two places, so
    one bit per value is all that stays alive until the backward pass. A word holds the values
    of 32 rows at one column (rows: all dimensions but the last), so that unpacking, fused into
    each consumer, is a broadcast along contiguous columns. With 8 consecutive values per byte
    instead, ViT-B/16's GELU-gradient fusions ran 3.7x slower than without remat (2.5x faster
    now; `benchmarks/profile_step.py`).
    """
    rows, columns = _as_rows(mask.shape)
    matrix = tf.reshape(tf.cast(mask, tf.uint32), [rows, columns])
    matrix = tf.pad(matrix, [[0, -rows % _WORD_BITS], [0, 0]])
    bits = tf.reshape(matrix, [_WORD_BITS, -1, columns])
    return tf.reduce_sum(bits * tf.constant(_WORD_BIT_VALUES, tf.uint32)[:, None, None], axis=0)


def _saveable(outputs: tuple[tf.Tensor, ...]) -> tuple[tf.Tensor, ...]:
    """Outputs as they are kept: booleans packed as bits (`_pack_bits`)."""
    with outputs[0].graph.as_default(), tf_internals.stop_recording():
        return tuple(_pack_bits(t) if _packable(t) else t for t in outputs)


def _unpack_bits(packed: tf.Tensor, shape: tf.TensorShape) -> tf.Tensor:
    """Inverse of `_pack_bits` for a mask of static `shape`."""
    rows, columns = _as_rows(shape)
    values = tf.constant(_WORD_BIT_VALUES, tf.uint32)[:, None, None]
    bits = tf.bitwise.bitwise_and(packed[None], values) > 0
    return tf.reshape(tf.reshape(bits, [-1, columns])[:rows], shape)


class StateOrder:
    """Runs the ops that touch one variable in the order they were created, in any graph.

    `tf.function` graphs order such ops by themselves; the backward graphs TensorFlow builds for
    an eager call do not, and there a region's snapshot restore, its recomputation's reads and
    writes and the final restore must not interleave with a nested region's. Edges only ever go
    from an earlier-created op to a later one, as `tf.function`'s own, so they cannot make a cycle.
    """

    # Kept on the graph itself: a table outside it would hold its ops, hence the graph, forever.
    _ATTR = "_remat_last_state_ops"

    @classmethod
    def _table(cls, graph: tf.Graph) -> dict:
        if not hasattr(graph, cls._ATTR):
            setattr(graph, cls._ATTR, {})
        return getattr(graph, cls._ATTR)

    @classmethod
    def last(cls, graph: tf.Graph, handle: tf.Tensor) -> tf.Operation | None:
        return cls._table(graph).get(handle.ref())

    @classmethod
    def chain(
        cls, graph: tf.Graph, handle: tf.Tensor, ops: list, after: tf.Operation | None = None
    ) -> None:
        """Orders `ops` (in creation order) one after the other, the first after `after` (by
        default the last op ordered so far)."""
        previous = cls.last(graph, handle) if after is None else after
        for op in ops:
            if previous is not None and previous is not op:
                tf_internals.add_control_input(op, previous)
            previous = op
        if previous is not None:
            current = cls.last(graph, handle)
            if current is None or (
                tf_internals.creation_index(current) <= tf_internals.creation_index(previous)
            ):
                cls._table(graph)[handle.ref()] = previous


KEPT_ATTR = "_remat_kept"  # on the identity of each kept value: what it was (for the report)


def _plain(value):
    """A call-context value as compared between the passes (a tensor by its type alone)."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__


@dataclasses.dataclass(frozen=True)
class _Site:
    """Where an op was built: inside which Keras layer calls (names from the region's own level
    down) and with which call-context arguments (`training`, ...) and autocast dtype. Two passes
    that build the same ops through another branch of a layer's Python code differ here."""

    layers: tuple[str, ...]
    context: tuple | None
    autocast: str | None

    def __str__(self) -> str:
        where = "/".join(self.layers) or "the region's own code"
        context = ", ".join(f"{k}={v}" for k, v in self.context or ()) or "no layer call"
        autocast = f", autocast {self.autocast}" if self.autocast else ""
        return f"in {where} ({context}{autocast})"


@dataclasses.dataclass
class _Entry:
    info: OpInfo
    site: _Site | None = None
    origin: str = ""
    read: bool = False  # a gradient reads its outputs (without remat, they would be held)
    candidate: tuple[tf.Tensor, ...] | None = None  # outputs a policy may keep
    saved: tuple[tf.Tensor, ...] | None = None  # inside the forward function
    kept: tuple[tf.Tensor, ...] | None = None  # the same values, outputs of the forward call


def _dispatch(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    stack = _stack()
    if not stack or graph is None or op_type in _IGNORED_OPS:
        return None
    op = graph.get_operation_by_name(op_name)
    if outputs is None:  # a callback registered before ours returned nothing
        outputs = op.outputs
    for region in reversed(stack):
        if graph is region.graph:
            return region.top_level_op(op, attrs, outputs)
    if stack[-1].owns(graph) and _is_random_op(op_type):
        stack[-1].tie_seeds(op)
    return None


class Region:
    """The recorded forward pass of one call of a checkpointed region."""

    def __init__(self, policy: Policy, label: str):
        self.policy = policy
        self.label = label
        self.entries: list[_Entry] = []
        self.graph: tf.Graph | None = None  # top level of the pass being built
        self._mode: str | None = None
        self._cursor = 0
        self._dep: tf.Tensor | None = None
        self._random: dict = {}  # tensors from random bits and constants alone -> random_flops
        self._constant: set = set()  # tensors computed from constants alone
        self._producers: dict = {}  # recorded tensor -> its op's entry (`_Entry.read`)

    @contextlib.contextmanager
    def _active(self, mode: str, dep: tf.Tensor) -> Iterator[None]:
        stack = _stack()
        self.graph = tf.compat.v1.get_default_graph()
        self._mode, self._dep = mode, dep
        self._depth = len(tf_internals.keras_layer_path())
        if not stack:
            tf_internals.add_op_callback(_dispatch)
        stack.append(self)
        try:
            yield
        finally:
            stack.remove(self)
            if not stack:
                tf_internals.remove_op_callback(_dispatch)
            self._mode = None

    def recording(self, dep: tf.Tensor) -> contextlib.AbstractContextManager:
        """Context in which the forward pass is traced; `dep` is a zero tied to the inputs."""
        self.entries = []
        self._random, self._constant, self._producers = {}, set(), {}
        return self._active("record", dep)

    def saved(self) -> list[tf.Tensor]:
        """The values the policy keeps, in op order (call inside the forward function, once
        its pass is recorded: a policy deciding per region, as `MemoryBudget`, decides here)."""
        select = getattr(self.policy, "select", None)
        if select is not None:
            candidates = [e for e in self.entries if e.candidate is not None]
            chosen = select([e.info for e in candidates], [e.read for e in candidates])
            name = policy_name(self.policy)
            for position, flops_per_byte in chosen.items():
                entry = candidates[position]
                entry.origin += f", kept by {name}: {flops_per_byte:.3g} FLOPs/byte"
                entry.saved = _saveable(entry.candidate)
        return [t for e in self.entries if e.saved is not None for t in e.saved]

    def keep(self, values: list[tf.Tensor]) -> None:
        """Binds the forward call's outputs for `saved()` back to their ops (in the caller's
        graph), each through an identity that says what it is for `saved_residuals`."""
        values = iter(values)
        for entry in self.entries:
            if entry.saved is not None:
                kept = [tf.identity(next(values)) for _ in entry.saved]
                for k in kept:
                    tf_internals.set_string_attr(k.op, KEPT_ATTR, entry.origin)
                entry.kept = tuple(kept)

    @contextlib.contextmanager
    def replaying(self, dep: tf.Tensor, state: list[tf.Tensor]) -> Iterator[None]:
        """Context in which the recomputation is built inline.

        Args:
          dep: a zero tied to the upstream gradient.
          state: handles (as the replay graph sees them) of the variables the region writes;
            ops using them are ordered after the snapshot restore (`StateOrder`).
        """
        self._cursor = 0
        graph = tf.compat.v1.get_default_graph()
        start = len(graph.get_operations()) if state else 0
        before = {h.ref(): StateOrder.last(graph, h) for h in state}
        with self._active("replay", dep):
            yield
        # Every op of the recomputation that uses a written variable, in creation order: call ops
        # that reach no op callback and a nested region's snapshot reads included.
        created = graph.get_operations()[start:] if state else []
        for h in state:
            users = [op for op in created if any(t is h for t in op.inputs)]
            StateOrder.chain(graph, h, users, after=before[h.ref()])
        if self._cursor != len(self.entries):
            missing = self.entries[self._cursor].info
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} stopped after {self._cursor} ops; "
                f"its forward pass went on with op #{self._cursor}: {_describe(missing)}. The "
                "region must build the same ops on every call (no Python state that changes "
                "between the forward pass and the recomputation)."
            )

    def owns(self, graph: tf.Graph) -> bool:
        """Whether `graph` is a control-flow body built inside this region's top level."""
        while tf_internals.is_control_flow_graph(graph):
            graph = tf_internals.outer_graph(graph)
            if graph is self.graph:
                return True
        return False

    def tie_seeds(self, op: tf.Operation) -> None:
        """Offsets the seed inputs of the stateless random op `op` by this pass's zero."""
        with op.graph.as_default(), tf_internals.stop_recording():
            dep = in_graph(self._dep, op.graph)
            for position, arg in enumerate(op.op_def.input_arg):
                if arg.name in _SEED_ARGS:  # not "alg": XLA needs it constant
                    tf_internals.update_input(op, position, with_dep(op.inputs[position], dep))

    def top_level_op(self, op: tf.Operation, attrs, outputs):
        tag = pending_tag() if op.type == "Identity" else None
        if (
            op.type in _CALL_OPS
            or (op.type == "Identity" and tag is None)
            or (outputs and all(t.dtype == tf.variant for t in outputs))
        ):
            if self._mode == "record" and op.type == "Identity":
                self._alias(op.inputs[0], outputs)
            elif self._mode == "record":  # a call's gradient may read any of its inputs
                self._mark_read(op.inputs)
            return None
        is_random_op = _is_random_op(op.type)
        random_flops = self._random_flops(op, outputs, is_random_op)
        info = OpInfo(
            op_type=op.type,
            shapes=tuple(_shape(t) for t in outputs),
            dtypes=tuple(t.dtype for t in outputs),
            name=tag,
            attrs=tuple(attrs) if attrs else (),
            input_shapes=tuple(_shape(t) for t in op.inputs),
            random=random_flops is not None,
            random_flops=RANDOM_FLOPS_PER_VALUE if random_flops is None else random_flops,
        )
        if is_random_op:
            self.tie_seeds(op)
        state = tf_internals.keras_call_state()
        context = None if state.context is None else tuple((k, _plain(v)) for k, v in state.context)
        site = _Site(tf_internals.keras_layer_path()[self._depth :], context, state.autocast)
        if self._mode == "record":
            self._record(info, site, op, outputs)
            return None
        return self._replay(info, site, op, outputs)

    def _is_constant(self, t: tf.Tensor) -> bool:
        return t.op.type == "Const" or t.ref() in self._constant

    def _random_flops(self, op: tf.Operation, outputs, is_random_op: bool) -> float | None:
        """What recomputing each output value of `op` costs if it is computed from random bits
        and constants alone (at least one random input), else None: a random op's draw; after
        it, one FLOP per op along the dearest input's path, an input's cost shared over the
        output's values (a key of two words drawn for a hash over N values costs each of them
        almost nothing). The dearest path, not the sum: inputs share their ancestors."""
        if is_random_op:
            return RANDOM_FLOPS_PER_VALUE
        if self._mode != "record" or not outputs:
            return None
        random = [t.ref() in self._random for t in op.inputs]
        if not any(random) or not all(
            r or self._is_constant(t) for r, t in zip(random, op.inputs, strict=True)
        ):
            return None
        values = _values(outputs[0])
        dearest = max(
            self._random[t.ref()] * (_values(t) / values if _values(t) and values else 1)
            for r, t in zip(random, op.inputs, strict=True)
            if r
        )
        return ELEMENTWISE_FLOPS_PER_VALUE + dearest

    def _mark_read(self, tensors) -> None:
        for t in tensors:
            if t.ref() in self._producers:
                self._producers[t.ref()].read = True

    def _alias(self, source: tf.Tensor, outputs) -> None:
        if source.ref() in self._producers:
            for t in outputs:
                self._producers[t.ref()] = self._producers[source.ref()]

    def _record(self, info: OpInfo, site: _Site, op: tf.Operation, outputs) -> None:
        read_inputs, reads_outputs = gradient_reads(op.type, len(op.inputs))
        self._mark_read([op.inputs[i] for i in read_inputs])
        if info.random:
            self._random.update((t.ref(), info.random_flops) for t in outputs)
        elif op.type in _SHAPE_OPS or (op.inputs and all(self._is_constant(t) for t in op.inputs)):
            self._constant.update(t.ref() for t in outputs)
        origin = f"checkpoint_name {info.name!r}" if info.name else f"{op.type} ({op.name})"
        entry = _Entry(info, site, origin, read=reads_outputs)
        for t in (*outputs, *op.outputs):
            self._producers[t.ref()] = entry
        if (
            outputs
            and info.op_type not in _NEVER_SAVED
            and not _is_random_op(info.op_type)
            and all(t.dtype not in (tf.resource, tf.variant) for t in outputs)
        ):
            entry.candidate = tuple(outputs)
            if not hasattr(self.policy, "select") and self.policy(info):
                entry.saved = _saveable(entry.candidate)
        self.entries.append(entry)

    def _replay(self, info: OpInfo, site: _Site, op: tf.Operation, outputs):
        index = self._cursor
        if index >= len(self.entries):
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} created more ops than its forward "
                f"pass ({len(self.entries)}); first extra op #{index}: {_describe(info)}."
            )
        entry = self.entries[index]
        self._cursor += 1
        expected = entry.info
        if (expected.op_type, expected.shapes, expected.dtypes, entry.site) != (
            info.op_type,
            info.shapes,
            info.dtypes,
            site,
        ):
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} differs from its forward pass at "
                f"op #{index}: forward built {_describe(expected)} {entry.site}, recomputation "
                f"built {_describe(info)} {site}."
            )
        if entry.kept is None:
            return None
        graph = op.graph
        with graph.as_default(), tf_internals.stop_recording():
            dep = in_graph(self._dep, graph)
            kept = [with_dep(in_graph(k, graph), dep) for k in entry.kept]
            return tuple(
                _unpack_bits(k, t.shape) if _packable(t) else k
                for k, t in zip(kept, outputs, strict=True)
            )
