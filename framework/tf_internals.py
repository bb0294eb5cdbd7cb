"""Every private TensorFlow and Keras API the framework relies on, in one place.

Public TensorFlow has no way to see or replace the ops a function creates while it is traced, to
pause gradient recording, or to list a Keras layer's children; rematerialization needs all three.
Each wrapper here is small and named for what it does, so a TensorFlow release that moves one of
them breaks one function, and `SUPPORTED_TENSORFLOW` says which releases were checked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import context, record
from tensorflow.python.framework import op_callbacks
from tensorflow.python.ops import control_flow_v2_func_graphs

SUPPORTED_TENSORFLOW = ("2.20", "2.21")

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


def tape_is_active() -> bool:
    """Whether a gradient tape of this thread could record the next op."""
    return record.could_possibly_record()


def executing_eagerly() -> bool:
    return context.executing_eagerly()


def runtime_started() -> bool:
    """Whether TensorFlow already created its devices (after that, device options are fixed)."""
    return context.context()._initialized


def autograph_like_caller(function: Callable) -> Callable:
    """`function`, converted by AutoGraph if the code calling us is (as inside a `tf.function`).

    Library code that calls user code is marked `do_not_convert`; this gives the user's code the
    treatment it would get if called directly.
    """
    status = tf.__internal__.autograph.control_status_ctx()
    return tf.__internal__.autograph.tf_convert(function, status)


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
