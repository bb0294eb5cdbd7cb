"""`set_grad_checkpointing(model)`: remat on a Keras model that already exists, in one line.

Keras 3 `RematScope` must wrap layer construction; timm's `set_grad_checkpointing()` shows what a
user wants instead: switch it on (or off) for a built model. We wrap the `call` of the chosen layer
instances (see `checkpoint`), so functional, Sequential and subclassed models all route through the
wrapper, and weights, tracking and serialization stay as they were.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import keras

from framework import tf_internals
from framework.remat.checkpoint import (
    checkpoint,
    is_checkpointed,
    loops_over_steps,
    unwrap_layer,
)
from framework.remat.policies import Policy, get_policy

LayerSelector = None | str | type | Iterable[str | type] | Callable[[keras.Layer], bool]


def _children(layer: keras.Layer) -> list[keras.Layer]:
    return tf_internals.flatten_layers(layer, recursive=False)


def _all_layers(model: keras.Layer) -> list[keras.Layer]:
    return tf_internals.flatten_layers(model, recursive=True)


def _top_most(model: keras.Layer, chosen: Callable[[keras.Layer], bool]) -> list[keras.Layer]:
    """Layers for which `chosen` holds, not descending into a chosen layer; each once."""
    found: dict[int, keras.Layer] = {}

    def visit(layer: keras.Layer) -> None:
        for child in _children(layer):
            if chosen(child):
                found.setdefault(id(child), child)
            else:
                visit(child)

    visit(model)
    return list(found.values())


def repeated_blocks(model: keras.Layer) -> list[keras.Layer]:
    """The default choice: the model's repeated blocks.

    A block class has weights and at least two instances in the model; a class of which some
    instance sits inside another block class is a part of a block (the Dense layers of a
    transformer block), not a block. The top-most instances of the block classes are returned.
    """
    with_weights = [layer for layer in _all_layers(model) if layer.weights]
    counts = collections.Counter(type(layer) for layer in with_weights)
    repeated = {cls for cls, n in counts.items() if n >= 2}
    parts = set()
    for layer in with_weights:
        if type(layer) in repeated:
            for inner in _all_layers(layer):
                if type(inner) is not type(layer):
                    parts.add(type(inner))
    blocks = repeated - parts
    return _top_most(model, lambda layer: type(layer) in blocks and bool(layer.weights))


def _select(model: keras.Layer, layers: LayerSelector) -> list[keras.Layer]:
    if layers is None:
        return repeated_blocks(model) + _top_most(model, loops_over_steps)
    if isinstance(layers, (str, type)):
        layers = [layers]
    if callable(layers):
        return _top_most(model, layers)
    layers = list(layers)
    names = {x for x in layers if isinstance(x, str)}
    classes = tuple(x for x in layers if isinstance(x, type))
    known = {layer.name for layer in _all_layers(model)}
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(
            f"No layer named {unknown} in model {model.name!r}; it has {sorted(known)}"
        )
    return _top_most(
        model, lambda layer: layer.name in names or (bool(classes) and isinstance(layer, classes))
    )


def checkpointed_layers(model: keras.Layer) -> list[keras.Layer]:
    """The layers of `model` whose `call` is currently checkpointed."""
    return [layer for layer in _all_layers(model) if is_checkpointed(layer)]


def _reset_compiled_functions(model: keras.Layer) -> None:
    """Drops Keras' cached train/test/predict functions so the next fit traces the new calls."""
    for attr in ("train_function", "test_function", "predict_function"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)


def set_grad_checkpointing(
    model: keras.Layer,
    enable: bool = True,
    policy: str | Policy | None = "nothing_saveable",
    layers: LayerSelector = None,
) -> list[keras.Layer]:
    """Turns gradient checkpointing on (or off) for the blocks of an existing Keras model.

    Args:
      model: a built Keras model (functional, Sequential or subclassed; compiled or not).
      enable: False removes checkpointing from every layer of the model.
      policy: what each block keeps for the backward pass (see `remat.policies`).
      layers: which layers become checkpointed regions. Default: the model's repeated blocks, the
        top-most layers whose class has weights and appears at least twice, and the layers that
        loop over blocks themselves (`ScannedBlocks`: each step of the loop is a region).
        Otherwise layer names, layer classes, a list mixing both, or a predicate
        `layer -> bool`; the top-most matching layers are used (a match's own sublayers are
        inside its region already).

    Returns:
      The layers now checkpointed (empty when `enable` is False).
    """
    if not enable:
        for layer in checkpointed_layers(model):
            unwrap_layer(layer)
        _reset_compiled_functions(model)
        return []
    resolved = get_policy(policy)
    chosen = _select(model, layers)
    if not chosen and layers is None:
        raise ValueError(
            f"Model {model.name!r} has no repeated block (a layer class with weights appearing "
            "at least twice). Build the model first, or pass layers= (names, classes, predicate)."
        )
    for layer in checkpointed_layers(model):
        unwrap_layer(layer)
    for layer in chosen:
        checkpoint(layer, resolved)
    _reset_compiled_functions(model)
    return checkpointed_layers(model)
