"""`remat.summary(model, inputs)`: what `set_grad_checkpointing` wrapped and what it saves.

The saving is the graph-level view of `saved_residuals`: the activations the backward pass of
`model(inputs, training=True)` keeps, with the model's regions as they are and with every region
run as a plain call. XLA may fuse or drop some of them on either side; what a compiled step holds
is `framework.memory.compiled_bytes` (or the planner) to measure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras

from framework.memory.units import format_bytes
from framework.remat import segments
from framework.remat.checkpoint import layer_policy, plain_calls
from framework.remat.keras_model import checkpointed_regions
from framework.remat.policies import policy_name
from framework.remat.residuals import saved_residuals


@dataclasses.dataclass(frozen=True)
class RegionSummary:
    """One checkpointed region: its name, what it is (a layer class or a graph segment) and the
    policy it recomputes with."""

    name: str
    kind: str
    policy: str


@dataclasses.dataclass(frozen=True)
class RematSummary:
    """What is checkpointed in a model and, when measured on inputs, the activations the backward
    pass keeps without remat and with it (graph level, bytes)."""

    model: str
    regions: tuple[RegionSummary, ...]
    kept_without_remat: int | None = None
    kept_with_remat: int | None = None

    @property
    def ratio(self) -> float | None:
        """Activations kept with remat over without (None when not measured or nothing kept)."""
        if not self.kept_with_remat or not self.kept_without_remat:
            return None
        return self.kept_with_remat / self.kept_without_remat

    def __str__(self) -> str:
        if not self.regions:
            return f"remat: model {self.model!r} has no checkpointed region"
        width = max(len(r.name) for r in self.regions)
        kind_width = max(len(r.kind) for r in self.regions)
        lines = [f"remat: model {self.model!r}, {len(self.regions)} checkpointed regions"]
        lines += [f"  {r.name:<{width}}  {r.kind:<{kind_width}}  {r.policy}" for r in self.regions]
        if self.kept_without_remat is not None and self.kept_with_remat is not None:
            ratio = f" ({self.ratio:.2f}x)" if self.ratio is not None else ""
            lines.append(
                "activations the backward pass keeps (graph level, before XLA): "
                f"{format_bytes(self.kept_without_remat)} without remat, "
                f"{format_bytes(self.kept_with_remat)} with it{ratio}"
            )
        return "\n".join(lines)


def _regions(model: keras.Layer) -> tuple[RegionSummary, ...]:
    found = []
    for region in checkpointed_regions(model):
        if isinstance(region, segments.Segment):
            kind = f"segment of {len(region.nodes)} layers"
            policy = region.policy
        else:
            kind = type(region).__name__
            policy = layer_policy(region)
        found.append(RegionSummary(region.name, kind, policy_name(policy)))
    return tuple(found)


def _kept_activations(call: Callable, inputs) -> int:
    rows = saved_residuals(call, inputs)
    return sum(r.bytes for r in rows if r.kind == "activation")


def summary(
    model: keras.Layer, inputs=None, print_fn: Callable[[str], None] | None = print
) -> RematSummary:
    """Says which regions of `model` are checkpointed and with which policy, and - given a batch
    of `inputs` (what `model(inputs, training=True)` takes) - the activations its backward pass
    keeps with remat and without (graph level: see `saved_residuals`).

    Prints the summary with `print_fn` (None: no printing) and returns it as a `RematSummary`.
    """
    regions = _regions(model)
    kept_without = kept_with = None
    if inputs is not None:

        def call(batch):
            return model(batch, training=True)

        kept_with = _kept_activations(call, inputs)
        with plain_calls():
            kept_without = _kept_activations(call, inputs)
    result = RematSummary(model.name, regions, kept_without, kept_with)
    if print_fn is not None:
        print_fn(str(result))
    return result
