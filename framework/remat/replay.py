"""Record the forward pass of a checkpointed region, replay it in the recomputation.

TensorFlow lets an op callback (`op_callbacks.add_op_callback`) see every op created while a graph
is built, and return replacement outputs for it. A region uses that twice:

* recording (forward pass): for each op it notes type, shapes and dtypes, keeps the outputs the
  policy saves, the seeds fed to stateless random ops, and the values written to variables;
* replaying (recomputation): op number i must match recorded op number i (type, shapes, dtypes,
  else `RecomputationMismatchError`, the determinism check); saved outputs replace the recomputed
  ones so the recomputed op is pruned; random ops get the forward seeds back (same dropout mask);
  variable writes rewrite the forward value instead of advancing state a second time.

Substituted values are offset by a zero computed from the upstream gradient: without that data
dependency the recomputed elementwise work downstream of a saved value could be scheduled in the
forward pass (XLA ignores control dependencies), and nothing would be saved.

A region's state lives in its own object; callbacks are thread-local in TensorFlow and the callback
also checks the thread it was registered from, so replicas traced concurrently under
`MirroredStrategy` never see each other's regions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.framework import op_callbacks

from framework.remat.policies import OpInfo, Policy

_IGNORED_OPS = frozenset({"Placeholder", "Const", "NoOp"})
_CONTROL_FLOW_OPS = frozenset(
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
_NEVER_SAVED = _CONTROL_FLOW_OPS | {"ReadVariableOp", "VarHandleOp", "IdentityN"}
_SEED_ARGS = frozenset({"seed", "key", "counter", "alg"})
_STATEFUL_RANDOM_OPS = frozenset(
    {
        "RandomUniform",
        "RandomUniformInt",
        "RandomStandardNormal",
        "TruncatedNormal",
        "ParameterizedTruncatedNormal",
        "RandomShuffle",
        "RandomCrop",
        "Multinomial",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomBinomial",
        "StatefulRandomBinomial",
        "StatefulUniform",
        "StatefulUniformInt",
        "StatefulUniformFullInt",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "NonDeterministicInts",
    }
)
# Variable writes and the input that replay neutralises so state advances once per step: absolute
# writes get the value just read from the same variable in the recomputation (read-modify-write, as
# Keras' SeedGenerator and BatchNormalization do), relative writes and skips get zero.
_WRITE_OPS = {
    "AssignVariableOp": (1, True),
    "AssignAddVariableOp": (1, False),
    "AssignSubVariableOp": (1, False),
    "RngReadAndSkip": (2, False),
    "RngSkip": (2, False),
}


class RecomputationMismatchError(RuntimeError):
    """The recomputation of a region created different ops than its forward pass."""


class UnreplayableRandomOpError(RuntimeError):
    """A stateful random op inside a region: its recomputation would draw different numbers."""


_local = threading.local()


def _active_depth() -> int:
    return getattr(_local, "depth", 0)


def in_region() -> bool:
    """True while this thread records or replays a region (nested checkpoints must stay active)."""
    return _active_depth() > 0


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
    """Stateless random ops (`StatelessRandomUniformV2`, ...): the ones whose seeds are replayed."""
    return op_type.startswith("Stateless") and op_type not in _CONTROL_FLOW_OPS


def _shape(t: tf.Tensor) -> tuple[int | None, ...]:
    return tuple(t.shape.as_list()) if t.shape.rank is not None else ()


def _describe(info: OpInfo) -> str:
    outs = ", ".join(f"{d.name}{list(s)}" for s, d in zip(info.shapes, info.dtypes, strict=False))
    tag = f" tagged {info.name!r}" if info.name else ""
    return f"{info.op_type}{tag} -> ({outs})"


def _in_graph(t: tf.Tensor, graph: tf.Graph) -> tf.Tensor:
    if t.graph is graph:
        return t
    return graph.capture(t)


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


def _unpack_bits(packed: tf.Tensor, shape: tf.TensorShape) -> tf.Tensor:
    """Inverse of `_pack_bits` for a mask of static `shape`."""
    rows, columns = _as_rows(shape)
    values = tf.constant(_WORD_BIT_VALUES, tf.uint32)[:, None, None]
    bits = tf.bitwise.bitwise_and(packed[None], values) > 0
    return tf.reshape(tf.reshape(bits, [-1, columns])[:rows], shape)


@dataclasses.dataclass
class _Entry:
    info: OpInfo
    saved: tuple[tf.Tensor, ...] | None = None
    seeds: dict[int, tf.Tensor] | None = None
    written: tf.Tensor | None = None


class Region:
    """The recorded forward pass of one call of a checkpointed region."""

    def __init__(self, policy: Policy, label: str):
        self.policy = policy
        self.label = label
        self.entries: list[_Entry] = []
        self._mode: str | None = None
        self._cursor = 0
        self._dep: tf.Tensor | None = None
        self._last_read: dict = {}
        self._random: set = set()  # tensors computed from random bits and constants alone
        self._constant: set = set()  # tensors computed from constants alone
        self._thread = threading.get_ident()

    @contextlib.contextmanager
    def _active(self, mode: str) -> Iterator[None]:
        self._thread = threading.get_ident()
        self._mode = mode
        _local.depth = _active_depth() + 1
        op_callbacks.add_op_callback(self._callback)
        try:
            yield
        finally:
            op_callbacks.remove_op_callback(self._callback)
            _local.depth = _active_depth() - 1
            self._mode = None

    def recording(self, dep: tf.Tensor) -> contextlib.AbstractContextManager:
        """Context in which the forward pass is built; `dep` is a zero tied to the region's inputs.

        Random ops get their seeds offset by `dep`: with seeds known at the start of the step, XLA
        schedules every region's random bits first and keeps them all alive until their region
        runs (on ViT-B/16, 350 MiB of dropout bits in a full-remat step).
        """
        self.entries = []
        self._random, self._constant = set(), set()
        self._dep = dep
        return self._active("record")

    @contextlib.contextmanager
    def replaying(self, dep: tf.Tensor) -> Iterator[None]:
        """Context in which the recomputation is built; `dep` is a zero tied to the gradient."""
        self._cursor = 0
        self._dep = dep
        self._last_read = {}
        with self._active("replay"):
            yield
        if self._cursor != len(self.entries):
            missing = self.entries[self._cursor].info
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} stopped after {self._cursor} ops; "
                f"its forward pass went on with op #{self._cursor}: {_describe(missing)}. The "
                "region must build the same ops on every call (no Python state that changes "
                "between the forward pass and the recomputation)."
            )

    def _callback(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if (
            graph is None
            or self._mode is None
            or op_type in _IGNORED_OPS
            or threading.get_ident() != self._thread
        ):
            return None
        is_random_op = _is_random_op(op_type)
        info = OpInfo(
            op_type=op_type,
            shapes=tuple(_shape(t) for t in outputs),
            dtypes=tuple(t.dtype for t in outputs),
            name=pending_tag() if op_type == "Identity" else None,
            attrs=tuple(attrs) if attrs else (),
            input_shapes=tuple(_shape(t) for t in inputs),
            random=is_random_op or self._from_random_bits(inputs),
        )
        if info.op_type in _WRITE_OPS or is_random_op:
            # An enclosing region may have rewired this op's inputs already: read them back.
            inputs = tuple(graph.get_operation_by_name(op_name).inputs)
        if self._mode == "record":
            if info.random:
                self._random.update(t.ref() for t in outputs)
            elif inputs and all(self._is_constant(t) for t in inputs):
                self._constant.update(t.ref() for t in outputs)
            self._record(info, inputs, outputs, op_name, graph)
            return None
        return self._replay(info, inputs, outputs, op_name, graph)

    def _is_constant(self, t: tf.Tensor) -> bool:
        return t.op.type == "Const" or t.ref() in self._constant

    def _from_random_bits(self, inputs) -> bool:
        """Whether an op's inputs are random values and constants only (at least one random)."""
        if self._mode != "record":
            return False
        random = [t.ref() in self._random for t in inputs]
        return any(random) and all(
            r or self._is_constant(t) for r, t in zip(random, inputs, strict=True)
        )

    def _record(self, info, inputs, outputs, op_name, graph) -> None:
        if info.op_type in _STATEFUL_RANDOM_OPS:
            raise UnreplayableRandomOpError(
                f"Remat region {self.label!r} contains the stateful random op {info.op_type} "
                f"({op_name}); its recomputation would draw different numbers and give wrong "
                "gradients. Use stateless randomness instead: keras.random / keras.layers.Dropout "
                "with a SeedGenerator, tf.random.stateless_*, or tf.random.Generator."
            )
        entry = _Entry(info)
        if info.op_type in _WRITE_OPS:
            index, absolute = _WRITE_OPS[info.op_type]
            if absolute:
                entry.written = inputs[index]
        elif _is_random_op(info.op_type):
            names = [arg.name for arg in graph.get_operation_by_name(op_name).op_def.input_arg]
            entry.seeds = {i: inputs[i] for i, n in enumerate(names) if n in _SEED_ARGS}
            self._tie_seeds(op_name, graph, entry.seeds)
        elif (
            outputs
            and info.op_type not in _NEVER_SAVED
            and all(t.dtype not in (tf.resource, tf.variant) for t in outputs)
            and self.policy(info)
        ):
            entry.saved = tuple(_pack_bits(t) if _packable(t) else t for t in outputs)
        self.entries.append(entry)

    def _replay(self, info, inputs, outputs, op_name, graph):
        index = self._cursor
        if index >= len(self.entries):
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} created more ops than its forward "
                f"pass ({len(self.entries)}); first extra op #{index}: {_describe(info)}."
            )
        entry = self.entries[index]
        self._cursor += 1
        expected = entry.info
        if (expected.op_type, expected.shapes, expected.dtypes) != (
            info.op_type,
            info.shapes,
            info.dtypes,
        ):
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} differs from its forward pass at "
                f"op #{index}: forward built {_describe(expected)}, recomputation built "
                f"{_describe(info)}."
            )
        if info.op_type == "ReadVariableOp":
            self._last_read[inputs[0].ref()] = outputs[0]
        if info.op_type in _WRITE_OPS:
            op = graph.get_operation_by_name(op_name)
            position, absolute = _WRITE_OPS[info.op_type]
            with graph.as_default(), record.stop_recording():
                if not absolute:
                    value = tf.zeros_like(inputs[position])
                elif inputs[0].ref() in self._last_read:
                    value = self._last_read[inputs[0].ref()]
                else:
                    value = _in_graph(entry.written, graph)
            op._update_input(position, value)
            return None
        if entry.seeds:
            # The forward seeds, tied to the gradient like saved values: with the bare seeds, XLA
            # merges the recomputed random op with the forward one and keeps its bits alive.
            self._tie_seeds(op_name, graph, entry.seeds)
            return None
        if entry.saved is not None:
            with graph.as_default(), record.stop_recording():
                kept = [self._with_dep(_in_graph(saved, graph)) for saved in entry.saved]
                return tuple(
                    _unpack_bits(k, t.shape) if _packable(t) else k
                    for k, t in zip(kept, outputs, strict=True)
                )
        return None

    def _tie_seeds(self, op_name: str, graph: tf.Graph, seeds: dict[int, tf.Tensor]) -> None:
        """Feeds `seeds` to the random op `op_name`, offset by this pass's zero `self._dep`."""
        op = graph.get_operation_by_name(op_name)
        with graph.as_default(), record.stop_recording():
            for position, seed in seeds.items():
                seed = _in_graph(seed, graph)
                if op.op_def.input_arg[position].name != "alg":  # XLA needs alg constant
                    seed = self._with_dep(seed)
                op._update_input(position, seed)

    def _with_dep(self, t: tf.Tensor) -> tf.Tensor:
        if t.dtype == tf.bool:
            return tf.logical_or(t, tf.cast(self._dep, tf.bool))
        if t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_complex:
            return t + tf.cast(self._dep, t.dtype)
        return t
