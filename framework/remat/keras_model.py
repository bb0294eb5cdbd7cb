"""`set_grad_checkpointing(model)`: remat on a Keras model that already exists, in one line.

Keras 3 `RematScope` must wrap layer construction; timm's `set_grad_checkpointing()` shows what a
user wants instead: switch it on (or off) for a built model. We wrap the `call` of the chosen layer
instances (see `checkpoint`), so functional, Sequential and subclassed models all route through the
wrapper, and weights, tracking and serialization stay as they were. A functional model whose blocks
are not layer objects (keras.applications) gets spans of its layer graph instead (`segments`).
"""

from __future__ import annotations

import collections
import difflib
import logging
import warnings
from collections.abc import Callable, Iterable

import keras

from framework.core import tf_internals
from framework.remat import segments
from framework.remat.checkpoint import (
    checkpoint,
    is_checkpointed,
    loops_over_steps,
    unwrap_layer,
)
from framework.remat.policies import Policy, get_policy, policy_name


class RematSavesNothingWarning(UserWarning):
    """A checkpointed region whose recomputation can save little or nothing."""


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

    A block class has weights, layers of its own and at least two instances in the model, or
    one instance called at least twice in a functional graph (ALBERT's shared layer); a class of
    which some instance sits inside another block class is a part of a block (the Dense layers
    of a transformer block), not a block. The top-most instances of the block classes are
    returned. One of Keras' or keras-hub's own layers without layers inside (Conv2D, Dense,
    keras-hub's PositionEmbedding, which BART has twice) is no block: checkpointed alone, it
    keeps its input and recomputes an op or two.
    """
    everything = [model, *_all_layers(model)]
    with_weights = [layer for layer in everything[1:] if layer.weights]
    calls = collections.Counter(
        id(node.operation)
        for functional in everything
        if tf_internals.is_functional(functional)
        for node in tf_internals.functional_graph(functional).nodes
    )
    counts = collections.Counter()
    for layer in with_weights:
        counts[type(layer)] += max(1, calls[id(layer)])
    repeated = {cls for cls, n in counts.items() if n >= 2}
    parts = set()
    for layer in with_weights:
        if type(layer) in repeated:
            for inner in _all_layers(layer):
                if type(inner) is not type(layer):
                    parts.add(type(inner))
    blocks = repeated - parts
    return _top_most(model, lambda layer: type(layer) in blocks and _is_block(layer))


# Libraries whose single layers (without layers inside) each run an op or two.
_LAYER_LIBRARIES = frozenset({"keras", "keras_hub"})


def _is_block(layer: keras.Layer) -> bool:
    """A layer with weights that runs more than one op of its own: one with layers of its own,
    or a class of the user's; Keras' and keras-hub's own single layers (Conv2D, Dense,
    BatchNormalization, the LayerScale of keras.applications, PositionEmbedding) are not."""
    own_class = type(layer).__module__.split(".")[0] not in _LAYER_LIBRARIES
    return bool(layer.weights) and (bool(_children(layer)) or own_class)


def _containers(chosen: list[keras.Layer]) -> bool:
    """Whether every chosen layer is a `Sequential` or functional model: a container whose
    repeats say nothing of where a model's blocks are."""
    return all(tf_internals.is_functional(layer) for layer in chosen)


def _select(model: keras.Layer, layers: LayerSelector) -> list[keras.Layer]:
    if layers is None:
        return repeated_blocks(model) + _top_most(model, loops_over_steps)
    if isinstance(layers, (str, type)):
        layers = [layers]
    if callable(layers):
        chosen = _top_most(model, layers)
        if not chosen:
            raise ValueError(
                f"The layers= predicate matches no layer of model {model.name!r}; it has "
                f"{_contents(model)}"
            )
        return chosen
    layers = list(layers)
    names = {x for x in layers if isinstance(x, str)}
    classes = tuple(x for x in layers if isinstance(x, type))
    known = {layer.name for layer in _all_layers(model)}
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(
            f"No layer named {unknown} in model {model.name!r}{_closest(unknown, known)}; it has "
            f"{len(known)} layers: {_contents(model)}"
        )
    chosen = _top_most(
        model, lambda layer: layer.name in names or (bool(classes) and isinstance(layer, classes))
    )
    if not chosen:
        raise ValueError(
            f"No layer of model {model.name!r} is an instance of {[c.__name__ for c in classes]}; "
            f"it has {_contents(model)}"
        )
    return chosen


def _closest(unknown: list[str], known: set[str]) -> str:
    """The known names most like the unknown ones, for an error message ("" if none is)."""
    close = sorted({m for name in unknown for m in difflib.get_close_matches(name, known, n=3)})
    return f" (closest: {', '.join(close)})" if close else ""


def _contents(model: keras.Layer) -> str:
    """The layer classes of a model with their counts, for error messages."""
    counts = collections.Counter(type(layer).__name__ for layer in _all_layers(model))
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def _warn_if_single_layers(chosen: list[keras.Layer]) -> None:
    lone = [layer.name for layer in chosen if not _is_block(layer) and not loops_over_steps(layer)]
    if lone:
        shown = ", ".join(lone[:5]) + (f" and {len(lone) - 5} more" if len(lone) > 5 else "")
        warnings.warn(
            f"Checkpointing single layers ({shown}) saves little or nothing: each keeps its "
            "input and recomputes one op. Choose blocks (layers with layers of their own), or "
            "leave layers= out on a functional model to checkpoint spans of its graph.",
            RematSavesNothingWarning,
            stacklevel=3,
        )


def checkpointed_layers(model: keras.Layer) -> list[keras.Layer]:
    """The layers of `model` whose `call` is currently checkpointed (segments of a functional
    graph are not layers: `checkpointed_regions` lists both)."""
    return [layer for layer in _all_layers(model) if is_checkpointed(layer)]


def checkpointed_regions(model: keras.Layer) -> list[keras.Layer | segments.Segment]:
    """Every region of `model` checkpointed now: its wrapped layers and the segments of its
    functional graphs (its own and those of functional layers inside it)."""
    found: list[keras.Layer | segments.Segment] = list(checkpointed_layers(model))
    for layer in [model, *_all_layers(model)]:
        if tf_internals.is_functional(layer):
            found += segments.installed(layer)
    return found


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
    every: int | None = None,
) -> list[keras.Layer | segments.Segment]:
    """Turns gradient checkpointing on (or off) for the blocks of an existing Keras model.

    Args:
      model: a built Keras model (functional, Sequential or subclassed; compiled or not).
      enable: False removes checkpointing from every layer of the model.
      policy: what each block keeps for the backward pass (see `remat.policies`).
      layers: which layers become checkpointed regions. Default: the model's repeated blocks, the
        top-most layers with layers of their own whose class has weights and appears at least
        twice (two instances, or one called twice in a functional graph), and the layers that
        loop over blocks themselves (`ScannedBlocks`: each step of the loop is a region); a
        functional model whose graph has more than twice as many segments as it has such blocks
        (keras.applications: its blocks are wired in the graph) gets segments of its layer graph
        instead - or of a backbone's, a functional model it runs as one layer, when that has
        more (see `every`). Otherwise layer names, layer classes, a list mixing both, or a
        predicate `layer -> bool`; the top-most matching layers are used (a match's own
        sublayers are inside its region already). A selection that matches nothing is a
        `ValueError`; single layers warn (`RematSavesNothingWarning`).
      every: checkpoint a functional model's graph in segments of `every` blocks (spans between
        tensors through which the whole graph passes, such as a residual block's output; see
        `remat.segments`), instead of layers. Default 1 when the model gets segments.

    Returns:
      The regions now checkpointed: layers, or `remat.segments.Segment`s of a functional graph
      (empty when `enable` is False).
    """
    if not enable:
        _remove(model)
        logging.info("remat: checkpointing removed from model %r", model.name)
        return []
    resolved = get_policy(policy)
    regions = _install(model, resolved, layers, every)
    if regions:  # (none: a warning said why)
        if isinstance(regions[0], segments.Segment):
            what = f"{len(regions)} segments of its layer graph"
        else:
            kinds = collections.Counter(type(layer).__name__ for layer in regions)
            what = ", ".join(f"{name} x{n}" for name, n in kinds.most_common())
        logging.info(
            "remat: model %r checkpointed in %d regions (%s), policy %s",
            model.name,
            len(regions),
            what,
            policy_name(resolved),
        )
    return regions


def _install(
    model: keras.Layer, resolved: Policy, layers: LayerSelector, every: int | None
) -> list[keras.Layer | segments.Segment]:
    """Checkpoints the regions `set_grad_checkpointing` chose; returns them."""
    if every is not None:
        if layers is not None:
            raise ValueError("Pass layers= or every=, not both: every= cuts the layer graph.")
        return _install_segments(model, resolved, _segments_every(model, every), asked=True)
    chosen = _select(model, layers)
    if layers is None and tf_internals.is_functional(model):
        graph, found = _most_segments(model)
        # Blocks wired in the graph; or, where the repeated "blocks" are only Keras' containers
        # (ConvNeXt's stem and downsampling `Sequential`s around blocks that are no layers),
        # whenever the graph has more places to cut.
        cuts_win = len(found) > (len(chosen) if _containers(chosen) else 2 * len(chosen))
        if not chosen or cuts_win:
            return _install_segments(model, resolved, found, asked=False, graph=graph)
    if not chosen and layers is None:
        raise ValueError(
            f"Model {model.name!r} has no repeated block (a layer class with weights and layers "
            f"of its own appearing at least twice; it has {_contents(model)}). Build the model "
            "first, or pass layers= (names, classes, predicate)."
        )
    if layers is not None:
        _warn_if_single_layers(chosen)
    _remove(model)
    for layer in chosen:
        checkpoint(layer, resolved)
    _reset_compiled_functions(model)
    return checkpointed_layers(model)


def _remove(model: keras.Layer) -> None:
    for layer in checkpointed_layers(model):
        unwrap_layer(layer)
    for layer in [model, *_all_layers(model)]:
        if tf_internals.is_functional(layer):
            segments.unsegment(layer)
    _reset_compiled_functions(model)


def _segments_every(model: keras.Layer, every: int) -> list[segments.Segment]:
    """The segments the user asked for with `every=`, after checking that they can be made."""
    if not tf_internals.is_functional(model):
        raise ValueError(
            f"every= cuts a functional model's layer graph; {model.name!r} is a subclassed "
            "model: pass layers= (names, classes, predicate) instead."
        )
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive integer, got {every!r}")
    return segments.segments(model, every)


def _most_segments(model: keras.Model) -> tuple[keras.Model, list[segments.Segment]]:
    """The functional graph to cut - the model's own, or that of a functional model it runs as
    one layer (a backbone under a task's head), whichever has more segments - and its
    segments."""
    candidates = [model] + [c for c in _children(model) if tf_internals.is_functional(c)]
    return max(((c, segments.segments(c)) for c in candidates), key=lambda x: len(x[1]))


def _install_segments(
    model, policy, found: list, asked: bool, graph: keras.Model | None = None
) -> list[segments.Segment]:
    """Checkpoints `found`, segments of the functional `graph` (default: the model's own)."""
    if len(found) < 2:
        message = (
            f"Model {model.name!r}'s layer graph has no place where one tensor carries "
            "everything the rest needs (every path from its input to its output crosses each "
            f"segment), so a segment would hold the whole graph and save nothing; found "
            f"{len(found)} segment(s). Pass layers= naming its blocks if it has block layers; "
            "if not (NASNet's cells each read two earlier tensors), train it without remat."
        )
        if asked:
            raise ValueError(message)
        warnings.warn(message, RematSavesNothingWarning, stacklevel=3)
        _remove(model)
        return []
    _remove(model)
    segments.install(model if graph is None else graph, found, policy)
    _reset_compiled_functions(model)
    return found
