"""What a traced region does besides computing: the variables it writes, its stateful random ops.

A recomputation must see the variables as the forward pass saw them: a Keras `Dropout` reads its
`SeedGenerator` state and advances it, so a recomputation that reads the state again draws another
mask. The region's traced graph is searched for writes - at its top level and inside every function
it calls (`tf.cond` and `tf.while_loop` bodies, `tf.function`s, nested checkpoints), following each
resource argument to the variable it is - so the checkpoint can take a snapshot before the forward
pass and put it back for the recomputation. Stateful random ops (`tf.random.uniform`, ...) cannot be
replayed at all and are reported.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from framework.core import tf_internals
from framework.core.errors import UnreplayableRandomOpError

# Ops that change a variable in place: their resource is input 0; their value's dtype is the attr
# "dtype" where they have one (the random-generator state of Rng* ops is int64).
WRITE_OPS = frozenset(
    {
        "AssignVariableOp",
        "AssignAddVariableOp",
        "AssignSubVariableOp",
        "AssignVariableXlaConcatND",
        "RngReadAndSkip",
        "RngSkip",
        "ResourceScatterUpdate",
        "ResourceScatterAdd",
        "ResourceScatterSub",
        "ResourceScatterMul",
        "ResourceScatterDiv",
        "ResourceScatterMin",
        "ResourceScatterMax",
        "ResourceScatterNdUpdate",
        "ResourceScatterNdAdd",
        "ResourceScatterNdSub",
    }
)
STATEFUL_RANDOM_OPS = frozenset(
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
_PASS_THROUGH = frozenset({"Identity", "IdentityN"})


@dataclasses.dataclass(frozen=True)
class Write:
    """A variable the region writes: its handle as the caller sees it, and its value dtype."""

    handle: tf.Tensor
    dtype: tf.DType


@dataclasses.dataclass
class Effects:
    writes: list[Write]
    stateful_random_ops: list[str]  # "OpType (node name)"


def _value_dtype(node) -> tf.DType:
    if "dtype" in node.attr:
        return tf.as_dtype(node.attr["dtype"].type)
    if "T" in node.attr:
        return tf.as_dtype(node.attr["T"].type)
    return tf.int64


def written_dtype(attrs: dict) -> tf.DType:
    """The dtype of the value a write op (`WRITE_OPS`) with these attributes writes."""
    for key in ("dtype", "T"):
        if key in attrs:
            return tf.as_dtype(attrs[key])
    return tf.int64


def _callees(node) -> list[str]:
    names = []
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        elif value.HasField("list"):
            names.extend(f.name for f in value.list.func)
    return names


class _Scanner:
    """Walks a graph's nodes and, recursively, the functions they call (memoized per function)."""

    def __init__(self, library: dict):
        self.library = library
        self.memo: dict[str, tuple[dict[int, tf.DType], list[str]]] = {}

    def scan(self, nodes, args: list[str]) -> tuple[dict[int, tf.DType], list[str]]:
        """Argument indices written (with dtypes) and stateful random ops found in `nodes`."""
        by_name = {n.name: n for n in nodes}
        arg_index = {name: i for i, name in enumerate(args)}
        written: dict[int, tf.DType] = {}
        random_ops: list[str] = []

        def source(ref: str) -> int | None:
            """The argument a (resource) input refers to, through identities; None if local."""
            for _ in range(len(by_name) + 1):
                name, _, rest = ref.partition(":")
                if name in arg_index and not rest:
                    return arg_index[name]
                node = by_name.get(name)
                if node is None:
                    return arg_index.get(name)
                if node.op not in _PASS_THROUGH:
                    return None
                data = [i for i in node.input if not i.startswith("^")]
                position = int(rest.rsplit(":", 1)[-1]) if rest else 0
                ref = data[min(position, len(data) - 1)]
            return None

        for node in nodes:
            if node.op in STATEFUL_RANDOM_OPS:
                random_ops.append(f"{node.op} ({node.name})")
            if node.op in WRITE_OPS and node.input:
                index = source(node.input[0])
                if index is not None:
                    written[index] = _value_dtype(node)
            data = [i for i in node.input if not i.startswith("^")]
            for callee in _callees(node):
                callee_written, callee_random = self.function(callee)
                random_ops.extend(callee_random)
                if not callee_written:  # also every function missing from the library
                    continue
                n_args = len(self.library[callee].signature.input_arg)
                offset = len(data) - n_args  # If/Case take the branch selector first
                for arg, dtype in callee_written.items():
                    if 0 <= offset + arg < len(data):
                        index = source(data[offset + arg])
                        if index is not None:
                            written[index] = dtype
        return written, random_ops

    def function(self, name: str) -> tuple[dict[int, tf.DType], list[str]]:
        if name not in self.memo:
            self.memo[name] = ({}, [])  # also the recursion guard
            fdef = self.library.get(name)
            if fdef is not None:
                args = [a.name for a in fdef.signature.input_arg]
                self.memo[name] = self.scan(fdef.node_def, args)
        return self.memo[name]


def find_effects(graph) -> Effects:
    """The variables `graph` (a traced region's `FuncGraph`) writes, found through its captured
    inputs, and the stateful random ops it contains, nested functions included."""
    graph_def = graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    placeholders = [t.op.name for t in graph.inputs]
    written, random_ops = _Scanner(library).scan(graph_def.node, placeholders)
    external = {internal.op.name: ext for ext, internal in graph.captures}
    writes = []
    for index, dtype in sorted(written.items()):
        handle = external.get(placeholders[index])
        if handle is not None and handle.dtype == tf.resource:
            writes.append(Write(handle, dtype))
    return Effects(writes, random_ops)


class _EagerLibrary:
    """The functions eager ops call, looked up in the eager context as the scan reaches them."""

    def __init__(self):
        self._defs: dict = {}

    def get(self, name: str):
        if name not in self._defs:
            self._defs[name] = tf_internals.eager_function_def(name)
        return self._defs[name]

    def __getitem__(self, name: str):
        return self.get(name)


def eager_function_effects(name: str) -> tuple[dict[int, tf.DType], list[str]] | None:
    """For an eager op that calls the `tf.function` `name`: the positions of the op's inputs
    (resources) the function writes, with their values' dtypes, and its stateful random ops;
    None when `name` is an op of TensorFlow's own."""
    if not tf_internals.is_eager_function(name):
        return None
    return _Scanner(_EagerLibrary()).function(name)


def stateful_random_error(label: str, ops: list[str]) -> UnreplayableRandomOpError:
    """The error for a region `label` that draws from the stateful random ops `ops`."""
    return UnreplayableRandomOpError(
        f"Remat region {label!r} contains stateful random ops ({', '.join(ops)}); their "
        "recomputation would draw different numbers and give wrong gradients. Use stateless "
        "randomness instead: keras.random / keras.layers.Dropout with a SeedGenerator, "
        "tf.random.stateless_*, or tf.random.Generator."
    )
