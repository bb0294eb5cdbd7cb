"""Every private TensorFlow and Keras API the framework relies on, in one place.

Public TensorFlow has no way to see or replace the ops a function creates while it is traced, to
pause gradient recording, or to list a Keras layer's children; rematerialization needs all three.
Each wrapper here is small and named for what it does, so a TensorFlow release that moves one of
them breaks one function, and `SUPPORTED_TENSORFLOW` says which releases were checked.

Importing this module warns (`UnsupportedTensorFlowWarning`) when the installed TensorFlow is not
one of them. A warning, not an error: a release that moves one of these APIs fails at the wrapper
that uses it, with TensorFlow's own error, and users trying a new release (or a TPU image's own
build) should still be able to import the framework and run the tests that vouch for it
(`pytest -m tf_compat`). The one override that would fail silently (Keras' gradient all-reduce, see
`GradientsAlreadyReduced`) is checked where it is used, and raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator

import tensorflow as tf

# XLA's protocol buffers, re-exported: the compiler IR TensorFlow returns for memory measurement is
# an `hlo_pb2.HloProto`, but TensorFlow does not export these modules, so their path may move. The
# same for the profiler's `xplane_pb2.XSpace`, the format of a TensorBoard profile, and for the
# object graph a checkpoint stores (`trackable_object_graph_pb2`), read to warm start a model.
from tensorflow.compiler.xla import xla_data_pb2 as xla_data_pb2
from tensorflow.compiler.xla.service import hlo_pb2 as hlo_pb2
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import trackable_object_graph_pb2 as trackable_object_graph_pb2
from tensorflow.python import pywrap_tfe
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph_api
from tensorflow.python.eager import context, forwardprop_util, record
from tensorflow.python.framework import op_callbacks
from tensorflow.python.ops import control_flow_v2_func_graphs, gradients_util, resource_variable_ops
from tensorflow.python.training.py_checkpoint_reader import CheckpointReader as CheckpointReader
from tensorflow.tsl.profiler.protobuf import xplane_pb2 as xplane_pb2

# The releases are listed where code without TensorFlow reads them too (the TPU launcher).
from framework.core.releases import SUPPORTED_TENSORFLOW, is_supported_tensorflow


class UnsupportedTensorFlowWarning(UserWarning):
    """The installed TensorFlow is not one of `SUPPORTED_TENSORFLOW`."""


def unsupported_tensorflow_message(version: str) -> str | None:
    """What to tell a user of TensorFlow `version` (e.g. "2.22.0-dev20260101"), or None when it is
    a supported release."""
    if is_supported_tensorflow(version):
        return None
    supported = " and ".join(SUPPORTED_TENSORFLOW)
    return (
        f"TensorFlow {version} is installed, but this framework supports TensorFlow {supported} "
        "only: remat and memory measurement use private TensorFlow APIs "
        "(framework/core/tf_internals.py) that can move between releases. Install a supported "
        "pair, "
        f'e.g. pip install "tensorflow=={SUPPORTED_TENSORFLOW[-1]}.*" '
        f'"tensorflow-text=={SUPPORTED_TENSORFLOW[-1]}.*", or check this release with '
        "`python -m pytest -m tf_compat` and add it to SUPPORTED_TENSORFLOW "
        "(framework/core/releases.py)."
    )


def warn_if_unsupported(version: str = tf.__version__) -> None:
    """Warns (`UnsupportedTensorFlowWarning`) when TensorFlow `version` is not supported."""
    message = unsupported_tensorflow_message(version)
    if message:
        warnings.warn(message, UnsupportedTensorFlowWarning, stacklevel=2)


warn_if_unsupported()

OpCallback = Callable[..., object]


def add_op_callback(callback: OpCallback) -> None:
    """Calls `callback(op_type, inputs, attrs, outputs, op_name, graph)` for each op this thread
    creates; it may return replacement outputs (graph mode only)."""
    op_callbacks.add_op_callback(callback)


def remove_op_callback(callback: OpCallback) -> None:
    op_callbacks.remove_op_callback(callback)


def stop_recording() -> contextlib.AbstractContextManager:
    """Pauses every gradient tape of this thread."""
    return record.stop_recording()


def record_gradient(
    name: str, outputs: list[tf.Tensor], inputs: list[tf.Tensor], gradient: Callable
) -> None:
    """Records an op on every active gradient tape: `outputs` computed from `inputs`, with
    `gradient(*output_gradients)` returning one gradient (or None) per input. An input may be a
    variable's handle: its gradient is the variable's."""
    record.record_operation(name, outputs, inputs, gradient)


def mark_read(variable: tf.Variable) -> None:
    """Tells tapes that watch the variables a step reads that it read `variable` (as a read op
    would, when the read itself ran with the tapes paused)."""
    resource_variable_ops.variable_accessed(variable)


def untrainable_variables_watched(variables: list[tf.Variable]) -> list[tf.Variable]:
    """The floating-point non-trainable `variables` that a gradient tape of this thread watches
    (`tape.watch(variable)`: tapes, and `tf.custom_gradient`, find the trainable ones a step
    reads by themselves, never these)."""
    return [
        v
        for v in variables
        if not v.trainable and v.dtype.is_floating and record.should_record_backprop([v.handle])
    ]


def mark_read_for_custom_gradient(variable: tf.Variable) -> None:
    """Tells the enclosing `tf.custom_gradient` that its function read `variable`, trainable or
    not, so that its gradient function is asked for the variable's gradient; tapes themselves
    are not told (they watch what they were told to)."""
    pywrap_tfe.TFE_Py_VariableWatcherVariableAccessed(variable)


@contextlib.contextmanager
def watching_variables() -> Iterator[list[tf.Variable]]:
    """Yields a list that, once the block ends, holds the trainable variables read inside it
    (traced reads included), in creation order."""
    read: list[tf.Variable] = []
    with record.VariableWatcher() as watcher:
        yield read
    read.extend(watcher.watched_variables())


def tensor_id(tensor) -> int:
    """A tensor's id on the gradient tapes: unique for the process's lifetime (never reused, as
    `id()` is once a tensor is freed)."""
    return tensor._id


def is_eager_function(name: str) -> bool:
    """Whether an eager op named `name` calls a `tf.function` (else it is TensorFlow's own op)."""
    return context.context().has_function(name)


def eager_function_def(name: str):
    """The `FunctionDef` an eager op named `name` calls (a `tf.function`), or None when `name` is
    an op of TensorFlow's own."""
    return context.context().get_function_def(name) if is_eager_function(name) else None


def tf_variable(variable) -> tf.Variable:
    """The `tf.Variable` a Keras variable stores its value in (itself for a `tf.Variable`): its
    handle and dtype are the variable's own, not the autocast ones a Keras variable shows inside
    a mixed-precision layer call."""
    import keras

    return variable._value if isinstance(variable, keras.Variable) else variable


def keras_loss_lists(layers) -> list[list]:
    """The lists Keras' `add_loss` appends to while `layers` run (activity regularizers' losses
    included): the layers' and their sublayers' own, each once. Keras operations that are not
    layers have none."""
    lists: list[list] = []
    for layer in layers:
        if not hasattr(layer, "_flatten_layers"):
            continue
        for sublayer in layer._flatten_layers(include_self=True):
            losses = getattr(sublayer, "_losses", None)
            if isinstance(losses, list) and all(losses is not x for x in lists):
                lists.append(losses)
    return lists


def keras_stateless_losses() -> list | None:
    """The list `add_loss` appends to instead of the layers' own inside a stateless scope that
    collects losses (`stateless_call(..., return_losses=True)`), or None outside one."""
    from keras.src.backend.common import stateless_scope

    if not stateless_scope.in_stateless_scope():
        return None
    scope = stateless_scope.get_stateless_scope()
    return scope.losses if scope.collect_losses else None


def keras_forget_losses(layer) -> None:
    """Clears what `layer` and its sublayers remember of the losses they added: Keras does this
    at the start of a model's outermost call. A layer that a caller runs by `stateless_call`
    again and again outside any such call keeps the ids of earlier calls' losses, and a new
    tensor given a recycled id would be counted as one of its losses."""
    layer._clear_losses()


def create_keras_global_seed_generator() -> None:
    """Creates Keras' global seed generator (unseeded `keras.random` calls draw from it) if it
    does not exist yet, so that its variable is not created inside a call."""
    from keras.src.random.seed_generator import global_seed_generator

    global_seed_generator()


def forward_accumulator_active() -> bool:
    """Whether a `tf.autodiff.ForwardAccumulator` is active in this thread."""
    return bool(forwardprop_util.pack_tangents([]).indices)


def higher_order_gradient_possible(tensors: list[tf.Tensor]) -> bool:
    """Whether a gradient of a gradient of `tensors` could be taken: a persistent tape or
    several tapes watch them, or a forward accumulator does (TensorFlow's own test for giving a
    function call's gradient what a second-order gradient needs)."""
    return (
        gradients_util.PossibleTapeGradientTypes(tensors)
        == gradients_util.POSSIBLE_GRADIENT_TYPES_HIGHER_ORDER
    )


def tape_is_active() -> bool:
    """Whether a gradient tape of this thread could record the next op."""
    return record.could_possibly_record()


def executing_eagerly() -> bool:
    return context.executing_eagerly()


def current_device() -> str:
    """The device eager ops of this thread run on (a replica's, under a distribution strategy)."""
    return context.context().device_name


def runtime_started() -> bool:
    """Whether TensorFlow already created its devices (after that, device options are fixed)."""
    return context.context()._initialized


def device_memory_bytes(device_type: str) -> int | None:
    """The memory TensorFlow's allocator may use on the first local device of `device_type`
    (about the device's total, less what the runtime keeps), or None when there is none."""
    from tensorflow.python.client import device_lib

    for device in device_lib.list_local_devices():
        if device.device_type == device_type and device.memory_limit:
            return int(device.memory_limit)
    return None


def optimization_barrier(tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """`tensors`, unchanged, behind XLA's optimization barrier: the compiler may not move an op
    that reads them to before it, nor merge it with one on the other side. TensorFlow exports
    no wrapper for the op (`XlaOptimizationBarrier`), and registers no gradient for it."""
    from tensorflow.compiler.tf2xla.python import xla

    return list(xla.optimization_barrier(*tensors)) if tensors else []


# Sharded training state (`framework.shard`): collectives inside one XLA program, variables
# placed on the host under a strategy, and Keras variables read as other tensors.


def xla_all_reduce(value: tf.Tensor, replicas: int) -> tf.Tensor:
    """The sum of `value` over replicas 0..`replicas`-1 of the XLA program it is compiled in (an
    HLO all-reduce). TensorFlow lowers no all-gather or all-to-all into XLA on a CPU host; this
    op and `xla_reduce_scatter` lower everywhere, and TensorFlow exports neither."""
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    return gen_xla_ops.xla_all_reduce(
        value, group_assignment=[list(range(replicas))], reduce_op="Add", mode="CrossReplica"
    )


def xla_reduce_scatter(value: tf.Tensor, replicas: int) -> tf.Tensor:
    """Replica i's part of the sum of `value` ([replicas * k, ...]) over replicas 0..`replicas`-1
    of the XLA program: rows [i * k, (i + 1) * k) (an HLO reduce-scatter)."""
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    return gen_xla_ops.xla_reduce_scatter(
        value, group_assignment=[list(range(replicas))], scatter_dimension=0, reduce_op="Add"
    )


def xla_replica_id() -> tf.Tensor:
    """The replica an XLA program runs as (int32), inside the program."""
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    return gen_xla_ops.xla_replica_id()


def trainable_variables_on(device: str) -> contextlib.AbstractContextManager:
    """Inside a strategy's scope: trainable variables created in the block are one plain variable
    on `device` (the host's CPU), not a copy on every replica's device; the others are the
    strategy's as usual. Every strategy's variable creator takes a `SingleDevice` to colocate
    with (what `experimental_make_numpy_dataset` used), and none exports it."""
    from tensorflow.python.distribute import numpy_dataset

    def create(next_creator, **kwargs):
        if kwargs.get("trainable") is not False:  # (None: the default, trainable)
            kwargs["colocate_with"] = numpy_dataset.SingleDevice(device)
        return next_creator(**kwargs)

    return tf.variable_creator_scope(create)


@contextlib.contextmanager
def trainable_weights_without_storage() -> Iterator[None]:
    """Keras variables created in the block: trainable ones get a shape and a dtype but never
    storage (Keras' deferred initialization, left undone), the others their values at the end.
    For compile-only plans of a program that never reads the trainable weights themselves (at
    the "weights" shard level it reads their shards): a model larger than this host's memory can
    be planned. Reading such a weight computes its initializer anew, so nothing may train it."""
    import keras
    from keras.src.backend.common import global_state

    before = len(global_state.get_global_attribute("uninitialized_variables") or [])
    with keras.StatelessScope(initialize_variables=False):
        yield
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    global_state.set_global_attribute("uninitialized_variables", pending[:before])
    for variable in pending[before:]:
        if not variable.trainable:
            variable._deferred_initialize()


@contextlib.contextmanager
def keras_reads_redirected(value_of: Callable):
    """Reads of a Keras variable inside the block give `value_of(variable)` when that is not None
    (a tensor of the variable's shape): the layers compute with it, and gradients flow to it.
    Other variables read and assign as usual (dropout seeds advance); assigning a redirected
    variable raises. Keras' `StatelessScope` redirects reads, but keeps every assignment to
    itself; this one passes the others through. The losses the layers add (activity
    regularizers, `add_loss`) are collected, so that `model.losses` holds them."""
    import keras
    from keras.src.backend.common import global_state

    outer = global_state.get_global_attribute("stateless_scope")

    class Redirected(keras.StatelessScope):
        def __init__(self):
            super().__init__(collect_losses=True, initialize_variables=False)

        def get_current_value(self, variable):
            value = value_of(variable)
            if value is not None:
                return value
            if outer is not None:
                return outer.get_current_value(variable)
            # Its own value: Keras' weight regularizers ask the scope and take None for a value.
            global_state.set_global_attribute("stateless_scope", None)
            try:
                return variable.value
            finally:
                global_state.set_global_attribute("stateless_scope", scope)

        def add_update(self, update):
            variable, value = update
            if value_of(variable) is not None:
                raise ValueError(
                    f"{variable.path} is read as a gathered copy of its shards here, and cannot "
                    "be assigned: a layer that assigns its trainable weights in its call cannot "
                    "have them sharded (Trainer.shard_state)"
                )
            global_state.set_global_attribute("stateless_scope", outer)
            try:
                variable.assign(value)
            finally:
                global_state.set_global_attribute("stateless_scope", scope)

    with Redirected() as scope:
        yield


def called_as_is_by_autograph(cls: type) -> type:
    """Marks `cls`'s instances so that AutoGraph calls them unconverted, in the caller's AutoGraph
    status: code converted by a `tf.function` that calls one does not transpile the library's own
    code, and `autograph_like_caller` inside it still sees whether the caller converts. (Public
    `tf.autograph.experimental.do_not_convert` would switch AutoGraph off for everything the
    call runs, the user's code included.)"""
    return autograph_api.autograph_artifact(cls)


def autograph_like_caller(function: Callable) -> Callable:
    """`function`, converted by AutoGraph when the code calling us is (a `tf.function`'s with
    AutoGraph on, and eager code: AutoGraph's status is unset there and `tf.function` converts).

    For library code that calls a user's function where the caller would have called it directly
    (see `called_as_is_by_autograph`): the function gets the treatment it would get then.
    """
    status = tf.__internal__.autograph.control_status_ctx()
    return tf.__internal__.autograph.tf_convert(function, status)


def converted_by_autograph(function: Callable) -> Callable:
    """`function` as AutoGraph converts what a `tf.function` calls (Python `if` and `for` on
    tensors become graph control flow), wherever it is called from.

    For a user's function that library code calls from code it keeps unconverted: AutoGraph
    transpiles each function a converted one calls, seconds of a step's trace in the trainer's
    own code, which needs none of it.
    """
    enabled = ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED)
    return tf.__internal__.autograph.tf_convert(function, enabled)


def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    """Rewires input `index` of an op that already exists (graph mode)."""
    op._update_input(index, tensor)


def add_control_input(op: tf.Operation, before: tf.Operation) -> None:
    """Makes `op` run after `before` (graph mode), after the op was created."""
    op._add_control_input(before)


def creation_index(op: tf.Operation) -> int:
    """Ops of one graph are numbered in the order they were created."""
    return op._id


def set_string_attr(op: tf.Operation, key: str, value: str) -> None:
    """Attaches a string attribute to an op (read back with `op.get_attr(key)`)."""
    op._set_attr(key, attr_value_pb2.AttrValue(s=value.encode()))


def is_control_flow_graph(graph: tf.Graph) -> bool:
    """Whether `graph` is the body or condition of a `tf.cond`/`tf.while_loop`/`tf.case` being
    built (built afresh each time, never cached, unlike a `tf.function`'s graph)."""
    return isinstance(graph, control_flow_v2_func_graphs.ControlFlowFuncGraph)


def outer_graph(graph: tf.Graph) -> tf.Graph | None:
    """The graph a function graph is built inside, or None for an outermost graph."""
    return getattr(graph, "outer_graph", None)


def outermost(tensor):
    """The tensor a captured placeholder stands for, following captures out of nested functions.

    A function graph refers to a tensor of an enclosing graph (or an eager tensor, such as a
    variable's handle) through a placeholder of its own; this returns what is outside.
    """
    while True:
        graph = getattr(tensor, "graph", None)
        captures = getattr(graph, "captures", None)
        if not captures:
            return tensor
        for external, internal in captures:
            if internal is tensor:
                tensor = external
                break
        else:
            return tensor


def pass_eager_captures_through_control_flow(graph: tf.Graph) -> None:
    """Lets the gradient body of a `tf.while_loop`, or the gradient branch of a `tf.cond` or
    `tf.switch_case` (`graph`), use the eager tensors it captured.

    Code that reads a variable or an eager tensor directly (a recomputation does) captures the
    eager value by value, but these gradient graphs take only captures of graph tensors: a
    loop's body those it registered as loop invariants (else "... is in list of
    internal_captures but not in internal_capture_to_output"), a branch those of its enclosing
    graph or of the forward branch (else "Tensor.graph is undefined when eager execution is
    enabled"). This re-keys each such capture to the same value seen from the enclosing graph,
    and registers it as a loop body registers other outer tensors. No-op for any other graph.
    """
    if not _passes_captures_through(graph):
        return
    from tensorflow.python.framework import ops

    registered = getattr(graph, "internal_capture_to_output", None)
    captures = graph._function_captures
    for external, internal in list(graph.captures):
        if isinstance(external, ops.EagerTensor):
            outer = _seen_from(external, graph.outer_graph)
            captures.pop(id(external))
            captures.add_or_replace(key=id(outer), external=outer, internal=internal)
            if registered is not None:
                registered[ops.tensor_id(internal)] = internal


def _passes_captures_through(graph: tf.Graph) -> bool:
    """Whether `graph` is a loop's gradient body or a conditional's gradient branch."""
    from tensorflow.python.ops import cond_v2

    loop_body = getattr(graph, "internal_capture_to_output", None) is not None
    return loop_body or isinstance(graph, cond_v2._CondGradFuncGraph)


def _seen_from(tensor, graph: tf.Graph):
    """An eager tensor as `graph` sees it, through the gradient graphs of control flow around
    it."""
    if _passes_captures_through(graph) and getattr(graph, "outer_graph", None) is not None:
        return graph.capture(_seen_from(tensor, graph.outer_graph))
    return graph.capture(tensor) if hasattr(graph, "capture") else tensor


def trace_function(python_function: Callable, *tensors) -> tf.types.experimental.ConcreteFunction:
    """Traces `python_function(*tensors)` into a new concrete function, every time it is called.

    Tensors the function closes over become captured inputs (`captured_inputs`), visible to the
    caller. TensorFlow warns when one Python function is traced over and over; here that is by
    design (each trace records one call), so the warning is turned off for this function.
    """
    function = tf.function(python_function, autograph=False)
    function._omit_frequent_tracing_warning = True
    return function.get_concrete_function(*tensors)


def flatten_layers(layer, recursive: bool) -> list:
    """The sub-layers of a Keras layer (direct children, or all descendants)."""
    return list(layer._flatten_layers(include_self=False, recursive=recursive))


def attention_computation(layer) -> Callable:
    """The softmax-attention step of a `keras.layers.MultiHeadAttention` (and of keras-hub's
    attention layers, its subclasses): `_compute_attention(query, key, value, attention_mask,
    training, return_attention_scores, use_causal_mask)` on projected [batch, length, heads,
    dim] tensors, which Keras documents as the method to override for another attention."""
    return layer._compute_attention


def calls_attention_computation(layer) -> bool:
    """Whether the layer's `call` runs `attention_computation(layer)`: `MultiHeadAttention`'s own
    does, as do subclasses that call it or `super().call`; keras-hub's XLNet attention computes
    its own in its `call`, and a replaced one would never run."""
    import keras

    owner = next(cls for cls in type(layer).__mro__ if "call" in vars(cls))
    if owner is keras.layers.MultiHeadAttention:
        return True
    names = vars(owner)["call"].__code__.co_names
    return "_compute_attention" in names or "super" in names


def set_attention_computation(layer, compute: Callable) -> None:
    """Replaces `attention_computation(layer)` on this layer (an instance attribute)."""
    layer._compute_attention = compute


def attention_dropout_seed(layer) -> tf.Tensor:
    """The next stateless seed of a `keras.layers.MultiHeadAttention`'s attention dropout,
    from the seed state that layer's own dropout advances."""
    return layer._dropout_layer.seed_generator.next()


# Keras 3 keeps what a layer call hands down to the layers it calls in thread-local state that
# `Layer.__call__` sets up: the call context (`training` and any other call-context argument a
# layer registers), the autocast dtype of mixed precision, and the stack of name scopes of the
# layers being called. A recomputation runs a layer's `call` after that call has returned, so
# remat captures this state in the forward pass and puts it back around the recomputation.


@dataclasses.dataclass(frozen=True)
class KerasCallState:
    """Keras' call state at one moment: `context` holds the call-context arguments as sorted
    (name, value) pairs, or is None when no layer call is active; `autocast` is the dtype
    variables are read in (mixed precision), or None."""

    context: tuple | None
    autocast: str | None


def keras_call_state() -> KerasCallState:
    """The Keras call state of this thread, as the next op sees it."""
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    if context is not None:
        context = tuple(sorted((k, v) for k, v in vars(context).items() if k != "entry_layer"))
    autocast = global_state.get_global_attribute("autocast_scope")
    return KerasCallState(context, getattr(autocast, "dtype", None))


@contextlib.contextmanager
def keras_call_state_entered(state: KerasCallState):
    """Runs the block in `state`, as if inside the layer call it was captured in; the state
    before comes back afterwards. Layers called in the block take `training` from it, and none
    of them ends the call context (its entry layer is none of theirs)."""
    from keras.src.backend.common import global_state
    from keras.src.backend.common.variables import AutocastScope
    from keras.src.layers.layer import CallContext

    previous = {
        name: global_state.get_global_attribute(name)
        for name in ("current_call_ctx", "autocast_scope")
    }
    context = None
    if state.context is not None:
        context = CallContext(entry_layer=None)
        for name, value in state.context:
            context.set_value(name, value)
    global_state.set_global_attribute("current_call_ctx", context)
    autocast = None if state.autocast is None else AutocastScope(state.autocast)
    global_state.set_global_attribute("autocast_scope", autocast)
    try:
        yield
    finally:
        for name, value in previous.items():
            global_state.set_global_attribute(name, value)


def _keras_name_scopes() -> list:
    from keras.src.backend.common import global_state

    return list(global_state.get_global_attribute("name_scope_stack") or ())


def keras_layer_depth() -> int:
    """How many Keras layer calls (name scopes) are open in this thread."""
    return len(_keras_name_scopes())


def keras_current_layer():
    """The innermost Keras layer being called in this thread, or None."""
    scopes = _keras_name_scopes()
    return scopes[-1].caller if scopes else None


def keras_layer_path(start: int = 0, holder=None) -> tuple[str, ...]:
    """The Keras layers being called in this thread from the `start`-th on, outermost first, by
    name; a layer that the layer calling it does not hold (one made inside that call, as
    keras-hub's Flux blocks make their activations: it gets a new name at every call) by its
    class, as `<new Class>`. The first one's caller is `holder` when given (a recomputation runs
    outside the call that held it)."""
    scopes = _keras_name_scopes()
    parent = holder if holder is not None else (scopes[start - 1].caller if start else None)
    path = []
    for scope in scopes[start:]:
        caller = scope.caller
        held = not hasattr(parent, "_layers") or caller is None
        held = held or any(caller is x for x in parent._layers)
        path.append(scope.name if held else f"<new {type(caller).__name__}>")
        parent = caller
    return tuple(path)


def keras_mask(tensor):
    """The Keras mask attached to `tensor` (`Embedding(mask_zero=True)`, `Masking`), or None."""
    return getattr(tensor, "_keras_mask", None)


def set_keras_mask(tensor, mask) -> None:
    """Attaches `mask` to `tensor` as Keras layers attach and read it."""
    from keras.src.backend.common.masking import set_keras_mask as set_mask

    set_mask(tensor, mask)


# A Keras functional model (and a Sequential one, which holds one) runs its layer graph node by
# node in `_run_through_graph`; remat replaces that runner on the instance to run spans of the
# graph as checkpointed regions (`remat.segments`).


@dataclasses.dataclass
class FunctionalGraph:
    """What remat needs of a functional model's graph: its computing nodes in the order Keras
    runs them, its input and output Keras tensors, Keras' own runner and output packing."""

    model: object  # the keras.Functional that owns the graph
    nodes: list
    inputs: list
    outputs: list

    def run(self, inputs, operation_fn, call_fn=None):
        return type(self.model)._run_through_graph(self.model, inputs, operation_fn, call_fn)

    def pack_outputs(self, values: list):
        import keras

        return keras.tree.pack_sequence_as(self.model._outputs_struct, values)


def _functional(model):
    """The keras.Functional behind `model` (itself, or a Sequential's), or None."""
    from keras.src.models.functional import Functional

    if isinstance(model, Functional):
        return model
    inner = getattr(model, "_functional", None)
    return inner if isinstance(inner, Functional) else None


def is_functional(model) -> bool:
    """Whether `model` runs a graph of layers (functional, or a Sequential built on an Input)."""
    return _functional(model) is not None


def functional_graph(model) -> FunctionalGraph:
    functional = _functional(model)
    nodes = []
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
            if node.operation and not node.is_input:
                nodes.append(node)
    return FunctionalGraph(functional, nodes, list(functional.inputs), list(functional.outputs))


def run_node(node, values: dict, context: tuple = ()) -> None:
    """Calls the node's layer on its arguments taken from `values` (Keras tensor id -> value)
    and stores its outputs there. `context` holds the (name, value) call-context arguments of
    the model's call (`training`): as Keras' own runner does, they replace what the node
    recorded when the graph was built (`training=False`, the default then)."""
    import keras

    args, kwargs = node.arguments.fill_in(values)
    accepted = getattr(node.operation, "_call_context_args", ())
    kwargs.update((k, v) for k, v in context if k in accepted and v is not None)
    outputs = node.operation(*args, **kwargs)
    values.update(zip((id(t) for t in node.outputs), keras.tree.flatten(outputs)))


def is_functional_call_operation(operation_fn) -> bool:
    """Whether `operation_fn`, handed to a functional model's graph runner, is the one its own
    `call` passes (which adds `training` to each layer call), not another caller's
    (`clone_model`'s, `compute_output_spec`'s)."""
    return getattr(operation_fn, "__qualname__", "").startswith("Functional.call.")


def functional_runner(model):
    """The graph runner installed on `model` by `set_functional_runner`, or None."""
    return _functional(model).__dict__.get("_run_through_graph")


def set_functional_runner(model, runner) -> None:
    """Runs the model's graph with `runner(inputs, operation_fn, call_fn)`, or Keras' (None)."""
    functional = _functional(model)
    if runner is None:
        functional.__dict__.pop("_run_through_graph", None)
    else:
        object.__setattr__(functional, "_run_through_graph", runner)


def is_jit_compiled(function: Callable) -> bool:
    """Whether `function` is a `tf.function(jit_compile=True)` (no public accessor says so)."""
    return bool(getattr(function, "_jit_compile", False))


# Keras' TensorFlow optimizer sums gradients over replicas in this method before it applies them.
_KERAS_ALL_REDUCE = "_all_reduce_sum_gradients"


class GradientsAlreadyReduced:
    """Mixin, before a Keras optimizer class, for callers that sum gradients over replicas
    themselves (to clip by the norm of the sum): Keras would otherwise sum them a second time.

    If Keras renamed the method, the override would be ignored and gradients silently multiplied
    by the number of replicas (Adam hides it, SGD does not), so defining a subclass whose Keras
    base lacks the method raises instead.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        bases = cls.__mro__[cls.__mro__.index(GradientsAlreadyReduced) + 1 :]
        if not any(_KERAS_ALL_REDUCE in vars(base) for base in bases):
            import keras  # already imported: a Keras optimizer is among the bases

            raise TypeError(
                f"{cls.__name__}: no base class defines {_KERAS_ALL_REDUCE}, which "
                f"GradientsAlreadyReduced replaces: Keras {keras.__version__} sums gradients "
                "over replicas elsewhere. Update framework/core/tf_internals.py for it, or install "
                f"the Keras that TensorFlow {SUPPORTED_TENSORFLOW[-1]} installs."
            )

    def _all_reduce_sum_gradients(self, grads_and_vars: list) -> list:
        return grads_and_vars
