"""Checkpointed spans of a functional model's layer graph (keras.applications and the like).

A functional model's blocks are often not layer objects: a ResNet's bottleneck block is eight
Conv2D, BatchNormalization, Activation and Add layers wired in the graph. Wrapping those layers one
by one saves nothing (a lone convolution keeps its input either way), so `set_grad_checkpointing`
cuts the graph instead, as `torch.utils.checkpoint.checkpoint_sequential` cuts a chain:

* a *cut* is a place in the model's execution order where one tensor alone (besides the model's
  inputs, which are held anyway) carries everything the rest of the graph needs - a residual
  stage's output;
* a *span* is the run of layers between two cuts: a residual block, or a single layer of a stem;
* a *segment* is the unit of remat: `every` consecutive spans of two or more layers, with the
  single-layer spans between them, run as one checkpointed region.

The model keeps its layers, weights and serialization; only the way its graph is run changes
(`SegmentedGraph` takes the place of the model's own graph runner), and `unsegment` undoes it.
"""

from __future__ import annotations

import dataclasses
import math

import keras

from framework.core import tf_internals
from framework.remat.checkpoint import Checkpointed
from framework.remat.policies import Policy, get_policy


@dataclasses.dataclass
class Segment:
    """A checkpointed run of nodes of a functional model's graph."""

    nodes: list
    inputs: list  # Keras tensors the segment reads from before it
    outputs: list  # Keras tensors it produces that are read after it (or are model outputs)
    policy: Policy | None = None  # what it is checkpointed with, once installed

    @property
    def layers(self) -> list[keras.Layer]:
        """The layers its nodes call. A node may call a Keras operation that is no layer (`x + y`
        on Keras tensors, ConvNeXt's residual adds): it holds no weights, losses or layers."""
        return [node.operation for node in self.nodes if isinstance(node.operation, keras.Layer)]

    @property
    def name(self) -> str:
        names = [node.operation.name for node in self.nodes]
        return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {len(self.nodes)} layers)"


def spans(model: keras.Model) -> list[list]:
    """The model's computing nodes in execution order, split at every cut."""
    graph = tf_internals.functional_graph(model)
    nodes = graph.nodes
    # Held anyway: the inputs, and the outputs once computed (a multi-output backbone).
    held = {id(t) for t in graph.inputs} | {id(t) for t in graph.outputs}
    last_use: dict[int, int] = {}
    for index, node in enumerate(nodes):
        for t in node.input_tensors:
            last_use[id(t)] = index
    result, current, live = [], [], set()
    for index, node in enumerate(nodes):
        current.append(node)
        live.update(id(t) for t in node.outputs)
        live = {t for t in live if last_use.get(t, -1) > index and t not in held}
        if len(live) <= 1:
            result.append(current)
            current = []
    if current:
        result.append(current)
    return result


def segments(model: keras.Model, every: int | None = None) -> list[Segment]:
    """The checkpointed segments `set_grad_checkpointing` makes of a functional model.

    Args:
      model: a built functional model.
      every: spans of two or more layers per segment (default 1: one residual block each). A
        graph without such spans (a chain of single layers) is cut into segments of `every`
        layers (at least 2), by default the square root of its length, as
        `checkpoint_sequential` does.
    """
    found = spans(model)
    blocks = [s for s in found if len(s) >= 2]
    if not blocks:
        size = max(2, every or round(math.sqrt(len(found))))
        groups = [sum(found[i : i + size], []) for i in range(0, len(found), size)]
    else:  # single layers join the block before them (a stem: the first block)
        groups, current, count = [], [], 0
        for span in found:
            if len(span) >= 2 and count == (every or 1):
                groups.append(current)
                current, count = [], 0
            current += span
            count += len(span) >= 2
        groups.append(current)
    graph = tf_internals.functional_graph(model)
    return [_segment(graph, g) for g in groups if len(g) >= 2]


def _segment(graph: tf_internals.FunctionalGraph, nodes: list) -> Segment:
    inside = {id(t) for node in nodes for t in node.outputs}
    inputs, seen = [], set()
    for node in nodes:
        for t in node.input_tensors:
            if id(t) not in inside and id(t) not in seen:
                seen.add(id(t))
                inputs.append(t)
    position = graph.nodes.index(nodes[-1])
    later = {id(t) for node in graph.nodes[position + 1 :] for t in node.input_tensors}
    later |= {id(t) for t in graph.outputs}
    outputs = [t for node in nodes for t in node.outputs if id(t) in later]
    return Segment(nodes, inputs, outputs)


class SegmentedGraph:
    """Runs a functional model's graph with each segment as one checkpointed region.

    Installed in place of the model's graph runner. Only the model's own call under a gradient
    tape runs in segments; everything else goes through Keras' runner unchanged: symbolic runs
    (shape inference), `clone_model` and other callers that pass their own operation function,
    inference, and `model.call` made outside the model's `__call__` (no call context).
    """

    def __init__(self, model: keras.Model, found: list[Segment], policy: str | Policy):
        self.segments = found
        resolved = get_policy(policy)
        for segment in found:
            segment.policy = resolved
        self.graph = tf_internals.functional_graph(model)
        starts = {id(s.nodes[0]): s for s in found}
        members = {id(node) for s in found for node in s.nodes}
        self._plan: list = []
        for node in self.graph.nodes:
            if id(node) in starts:
                segment = starts[id(node)]
                runner = Checkpointed(_Runner(segment), resolved, layers=lambda s=segment: s.layers)
                self._plan.append((segment, runner))
            elif id(node) not in members:
                self._plan.append((node, None))

    def __call__(self, inputs, operation_fn=None, call_fn=None):
        if call_fn is not None or not _segmented_run(inputs, operation_fn):
            return self.graph.run(inputs, operation_fn, call_fn)
        graph = self.graph
        values = dict(zip((id(x) for x in graph.inputs), keras.tree.flatten(inputs)))
        # The model's call-context arguments (`training`), as the model's call resolved them.
        context = tf_internals.keras_call_state().context or ()
        for step, region in self._plan:
            if region is None:
                tf_internals.run_node(step, values, context)
                continue
            results = region([values[id(t)] for t in step.inputs], context=context)
            values.update(zip((id(t) for t in step.outputs), results))
        return graph.pack_outputs([values[id(x)] for x in graph.outputs])


def _segmented_run(inputs, operation_fn) -> bool:
    return (
        tf_internals.tape_is_active()
        and tf_internals.keras_call_state().context is not None
        and tf_internals.is_functional_call_operation(operation_fn)
        and not any(isinstance(x, keras.KerasTensor) for x in keras.tree.flatten(inputs))
    )


class _Runner:
    """The nodes of one segment as a function of the tensors entering it."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.__name__ = self.__qualname__ = segment.name

    def __call__(self, entering: list, context: tuple = ()) -> list:
        values = dict(zip((id(t) for t in self.segment.inputs), entering))
        for node in self.segment.nodes:
            tf_internals.run_node(node, values, context)
        return [values[id(t)] for t in self.segment.outputs]


def install(model: keras.Model, found: list[Segment], policy: str | Policy) -> None:
    tf_internals.set_functional_runner(model, SegmentedGraph(model, found, policy))


def installed(model: keras.Model) -> list[Segment]:
    """The segments currently checkpointed in `model` (empty when none)."""
    runner = tf_internals.functional_runner(model)
    return list(runner.segments) if isinstance(runner, SegmentedGraph) else []


def unsegment(model: keras.Model) -> None:
    """Runs the model's graph as Keras does again."""
    if isinstance(tf_internals.functional_runner(model), SegmentedGraph):
        tf_internals.set_functional_runner(model, None)
