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

Random values and the seeds of random ops: `random_values.py`; the callback that hands ops to
the active region: `op_callbacks.py`; kept masks as bits: `bit_packing.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import warnings
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

from framework.core import tf_internals
from framework.core.errors import RecomputationMismatchError
from framework.remat import op_callbacks
from framework.remat.bit_packing import as_kept, packable, unpack_bits
from framework.remat.costs import RANDOM_FLOPS_PER_VALUE
from framework.remat.dependencies import in_graph, with_dep
from framework.remat.gradient_reads import gradient_reads
from framework.remat.op_info import OpInfo, Policy
from framework.remat.policies import UnmatchedNameWarning, policy_name, policy_tag_names
from framework.remat.random_values import RandomValues, is_random_op, tie_seeds
from framework.remat.state_order import StateOrder

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
# The key and counter TensorFlow derives from a random op's seed: three words, which XLA
# expands into about 500 scalar ops per derivation (half of a Keras-dropout ViT's program).
_KEY_OPS = frozenset({"StatelessRandomGetKeyCounter"})


class Pass(enum.Enum):
    """Which pass of a region is being built."""

    RECORD = "record"  # the forward pass, traced into a function of its own
    REPLAY = "replay"  # the recomputation, built inline under the backward pass's tape


def _shape(t: tf.Tensor) -> tuple[int | None, ...]:
    return tuple(t.shape.as_list()) if t.shape.rank is not None else ()


def _describe(info: OpInfo) -> str:
    outs = ", ".join(f"{d.name}{list(s)}" for s, d in zip(info.shapes, info.dtypes, strict=False))
    tag = f" tagged {info.name!r}" if info.name else ""
    return f"{info.op_type}{tag} -> ({outs})"


def _constant(value) -> str:
    """A constant's value (an `AttrValue` proto) as an error shows it."""
    array = tf.make_ndarray(value.tensor)
    return str(array.tolist()) if array.size <= 8 else np.array2string(array, threshold=8)


def _priced(infos: list[OpInfo], static: list[OpInfo]) -> list[OpInfo]:
    """`infos`, each op that the trace at static shapes built too (matched in order, by type
    and dtypes) replaced by that trace's, whose shapes are known. An op that trace lacks (code
    that builds more ops when shapes are unknown, such as a transpose before a flattening
    reshape) is given no size, so a policy that prices values keeps it never."""
    key = [(i.op_type, i.dtypes) for i in infos]
    static_key = [(i.op_type, i.dtypes) for i in static]
    matcher = difflib.SequenceMatcher(a=key, b=static_key, autojunk=False)
    priced = [dataclasses.replace(i, shapes=tuple((0,) for _ in i.shapes)) for i in infos]
    for block in matcher.get_matching_blocks():
        priced[block.a : block.a + block.size] = static[block.b : block.b + block.size]
    return priced


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
    replayed: tuple[tf.Tensor, ...] | None = None  # what the recomputation reads instead


class Region:
    """The recorded forward pass of one call of a checkpointed region."""

    def __init__(self, policy: Policy, label: str, keep_random_keys: bool = True):
        """`keep_random_keys`: keep the random ops' keys whatever the policy, so the
        recomputation does not derive them again; a loop's step, compiled once whatever the
        loop's length, has little to gain from it."""
        self.policy = policy
        self.label = label
        self.keep_random_keys = keep_random_keys
        self.entries: list[_Entry] = []
        self.graph: tf.Graph | None = None  # top level of the pass being built
        self.dep: tf.Tensor | None = None  # the zero tied to the pass being built
        self._pass: Pass | None = None
        self._cursor = 0
        self._random_values = RandomValues()
        self._producers: dict = {}  # recorded tensor -> its op's entry (`_Entry.read`)
        self._constants: list = []  # the values of the pass's top-level constants, in order
        self._replayed_constants: list = []
        self._holder = None  # the Keras layer the forward pass ran in
        self.layers_run: dict[int, object] = {}  # the Keras layers its top-level ops ran in, by id

    @contextlib.contextmanager
    def _active(self, built: Pass, dep: tf.Tensor) -> Iterator[None]:
        self.graph = tf.compat.v1.get_default_graph()
        self._pass, self.dep = built, dep
        self._depth = tf_internals.keras_layer_depth()
        if built is Pass.RECORD:  # the layer the region runs in; the recomputation runs outside it
            self._holder = tf_internals.keras_current_layer()
        try:
            with op_callbacks.active(self):
                yield
        finally:
            self._pass = None

    def recording(self, dep: tf.Tensor) -> contextlib.AbstractContextManager:
        """Context in which the forward pass is traced; `dep` is a zero tied to the inputs."""
        self.entries, self._constants = [], []
        self._random_values, self._producers, self.layers_run = RandomValues(), {}, {}
        return self._active(Pass.RECORD, dep)

    def saved(self, pricing: list[OpInfo] | None = None) -> list[tf.Tensor]:
        """The values the policy keeps, in op order (call inside the forward function, once
        its pass is recorded: a policy deciding per region, as `MemoryBudget`, decides here).
        `pricing`: the candidates' ops at static shapes, for such a policy when the pass left
        some unknown (`backward.trace_forward`)."""
        self._warn_of_unmatched_names()
        select = getattr(self.policy, "select", None)
        if select is not None:
            candidates = [e for e in self.entries if e.candidate is not None]
            infos = [e.info for e in candidates]
            if pricing is not None:
                infos = _priced(infos, pricing)
            chosen = select(infos, [e.read for e in candidates])
            name = policy_name(self.policy)
            for position, flops_per_byte in chosen.items():
                entry = candidates[position]
                entry.origin += f", kept by {name}: {flops_per_byte:.3g} FLOPs/byte"
                entry.saved = as_kept(entry.candidate)
        return [t for e in self.entries if e.saved is not None for t in e.saved]

    def _warn_of_unmatched_names(self) -> None:
        tags = {e.info.name for e in self.entries if e.info.name}
        missing = policy_tag_names(self.policy) - tags
        if missing:
            warnings.warn(
                f"remat region {self.label!r}: {policy_name(self.policy)} names "
                f"{sorted(missing)}, which no checkpoint_name at the region's top level gives "
                f"(it tags {sorted(tags) or 'nothing'}), so the policy keeps or excludes nothing "
                "by that name here: check the spelling, or give this region a policy of its own.",
                UnmatchedNameWarning,
                stacklevel=2,
            )

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

    def replayed_kept(self) -> list[tf.Tensor]:
        """The kept values as the last recomputation read them, in `saved()` order. The tape
        records each as an output of its recomputed op, so a gradient given to one reaches that
        op's inputs: the path a second-order gradient takes through a kept value."""
        return [t for e in self.entries if e.saved is not None for t in e.replayed]

    @contextlib.contextmanager
    def replaying(self, dep: tf.Tensor, state: list[tf.Tensor]) -> Iterator[None]:
        """Context in which the recomputation is built inline.

        Args:
          dep: a zero tied to the upstream gradient.
          state: handles (as the replay graph sees them) of the variables the region writes;
            ops using them are ordered after the snapshot restore (`StateOrder`).
        """
        self._cursor, self._replayed_constants = 0, []
        graph = tf.compat.v1.get_default_graph()
        start = len(graph.get_operations()) if state else 0
        before = {h.ref(): StateOrder.last(graph, h) for h in state}
        with self._active(Pass.REPLAY, dep):
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
        self._check_constants()

    def constant(self, value) -> None:
        """Notes the value (an `AttrValue` proto) of a constant built at the region's top level.
        Constants are not numbered with the ops (code may cache one between passes), but a
        Python value that changed between the passes builds the same ops around another
        constant: `_check_constants` compares them."""
        (self._constants if self._pass is Pass.RECORD else self._replayed_constants).append(value)

    def _check_constants(self) -> None:
        """Raises if the recomputation built as many constants as the forward pass but one
        holds another value (a count that differs is left to the ops' check)."""
        if len(self._replayed_constants) != len(self._constants):
            return
        for index, (old, new) in enumerate(zip(self._constants, self._replayed_constants)):
            if old != new:
                raise RecomputationMismatchError(
                    f"Recomputation of remat region {self.label!r} built constant #{index} as "
                    f"{_constant(new)} where its forward pass built {_constant(old)}: the "
                    "region must build the same ops on every call (no Python state that "
                    "changes between the forward pass and the recomputation)."
                )

    def owns(self, graph: tf.Graph) -> bool:
        """Whether `graph` is a control-flow body built inside this region's top level."""
        while tf_internals.is_control_flow_graph(graph):
            graph = tf_internals.outer_graph(graph)
            if graph is self.graph:
                return True
        return False

    def top_level_op(self, op: tf.Operation, attrs, outputs):
        """Records or replays `op`, created at this region's top level; returns the outputs
        that replace its own (kept values in the recomputation), or None."""
        tag = op_callbacks.pending_tag() if op.type == "Identity" else None
        if (
            op.type in _CALL_OPS
            or (op.type == "Identity" and tag is None)
            or (outputs and all(t.dtype == tf.variant for t in outputs))
        ):
            if self._pass is Pass.RECORD and op.type == "Identity":
                self._alias(op.inputs[0], outputs)
            elif self._pass is Pass.RECORD:  # a call's gradient may read any of its inputs
                self._mark_read(op.inputs)
            return None
        recording = self._pass is Pass.RECORD
        random_flops = self._random_values.flops(op, outputs) if recording else None
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
        if is_random_op(op.type):
            tie_seeds(op, self.dep)
        state = tf_internals.keras_call_state()
        context = None if state.context is None else tuple((k, _plain(v)) for k, v in state.context)
        site = _Site(
            tf_internals.keras_layer_path(self._depth, self._holder), context, state.autocast
        )
        if recording:
            layer = tf_internals.keras_current_layer()
            if layer is not None:
                self.layers_run[id(layer)] = layer
            self._record(info, site, op, outputs)
            return None
        return self._replay(info, site, op, outputs)

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
        self._random_values.note(op, outputs, info.random_flops if info.random else None)
        origin = f"checkpoint_name {info.name!r}" if info.name else f"{op.type} ({op.name})"
        entry = _Entry(info, site, origin, read=reads_outputs)
        for t in (*outputs, *op.outputs):
            self._producers[t.ref()] = entry
        if self.keep_random_keys and info.op_type in _KEY_OPS:
            entry.saved = tuple(outputs)
        elif (
            outputs
            and info.op_type not in _NEVER_SAVED
            and not is_random_op(info.op_type)
            and all(t.dtype not in (tf.resource, tf.variant) for t in outputs)
        ):
            entry.candidate = tuple(outputs)
            if not hasattr(self.policy, "select") and self.policy(info):
                entry.saved = as_kept(entry.candidate)
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
            kept = [in_graph(k, graph) for k in entry.kept]
            if expected.op_type not in _KEY_OPS:  # a draw ties the key it reads to the pass
                dep = in_graph(self.dep, graph)
                kept = [with_dep(k, dep) for k in kept]
            entry.replayed = tuple(
                unpack_bits(k, t.shape) if packable(t) else k
                for k, t in zip(kept, outputs, strict=True)
            )
            return entry.replayed
