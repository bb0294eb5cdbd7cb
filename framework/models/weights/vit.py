"""Published ViT weights into a `VisionTransformer`: each of the model's weights found in the file
(`layouts`), converted, checked and assigned.

A head for another number of classes (or none in the file) keeps its fresh initialisation and
is listed; position embeddings for another image size are resized on their 2-D grid (bilinear by
default, or bicubic), the class token's position kept. Any other tensor that is missing, of
another shape, or left over in the file is an error naming it: the file is of another model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import keras
import numpy as np
import tensorflow as tf

from framework.models.vit import VisionTransformer
from framework.models.weights.files import WeightsError, read_arrays
from framework.models.weights.layouts import Tensor, find_layout
from framework.models.weights.positions import INTERPOLATIONS, grid_side, resize_positions

# Published files may carry a pre-logits layer (a dense + tanh the original ViT trained on
# ImageNet-21k with): fine-tuning drops it, as the ViT paper and timm do.
DROPPED = re.compile(r"(^|[/.])pre_logits[/.]")
# The weights of one block, by their names under `block_N/` (their attribute paths in the block).
BLOCK_WEIGHTS = (
    "norm1/gamma",
    "norm1/beta",
    "attention/qkv/kernel",
    "attention/qkv/bias",
    "attention/out/kernel",
    "attention/out/bias",
    "norm2/gamma",
    "norm2/beta",
    "mlp/fc1/kernel",
    "mlp/fc1/bias",
    "mlp/fc2/kernel",
    "mlp/fc2/bias",
)
HEAD = ("head/kernel", "head/bias")


@dataclasses.dataclass(frozen=True)
class Imported:
    """What `load_weights` did. Weights are named as in the model (`block_0/attention/qkv/kernel`);
    `reinitialized` holds (name, shape in the file or None when absent, shape here)."""

    source: str
    layout: str
    taken: tuple[str, ...]
    reinitialized: tuple[tuple[str, tuple[int, ...] | None, tuple[int, ...]], ...]
    resized: tuple[int, int] | None  # the position grid's side: (the file's, the model's)
    dropped: tuple[str, ...]  # the file's tensors fine-tuning does not use (pre-logits)
    notes: tuple[str, ...]

    def summary(self) -> str:
        """A few lines for the log: counts, what was re-initialised, resized or dropped."""
        lines = [
            f"{self.source} ({self.layout} layout): {len(self.taken)} weights taken, "
            f"{len(self.reinitialized)} re-initialised"
        ]
        for name, theirs, ours in self.reinitialized:
            where = "absent from the file" if theirs is None else f"{theirs} in the file"
            lines.append(f"  {name}: {where}, {ours} here")
        if self.resized:
            (a, b) = self.resized
            lines.append(f"  positions resized from a {a}x{a} grid to {b}x{b}")
        if self.dropped:
            lines.append(f"  not used: {', '.join(self.dropped)}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _block_weights(block: keras.layers.Layer) -> dict[str, keras.Variable]:
    """The block's weights by name: each name is its path of attributes (`norm1/gamma` is
    `block.norm1.gamma`)."""
    return {name: functools.reduce(getattr, name.split("/"), block) for name in BLOCK_WEIGHTS}


def _targets(model: VisionTransformer) -> dict[str, tuple[keras.Variable, int | None]]:
    """Each of the model's weights by name: its variable, and its index on the stacked axis of
    a scanned model's blocks (None when the variable is the weight itself)."""
    targets = {
        "patch_embed/kernel": (model.patch_embed.kernel, None),
        "patch_embed/bias": (model.patch_embed.bias, None),
        "class_token": (model.class_token, None),
        "positions": (model.positions, None),
        "norm/gamma": (model.norm.gamma, None),
        "norm/beta": (model.norm.beta, None),
        "head/kernel": (model.head.kernel, None),
        "head/bias": (model.head.bias, None),
    }
    if model.blocks:
        for i, block in enumerate(model.blocks):
            for name, variable in _block_weights(block).items():
                targets[f"block_{i}/{name}"] = (variable, None)
    else:
        scanned = model.scanned_blocks
        stacked = {id(v): s for v, s in zip(scanned.template.variables, scanned.stacked)}
        for i in range(scanned.depth):
            for name, variable in _block_weights(scanned.template).items():
                targets[f"block_{i}/{name}"] = (stacked[id(variable)], i)
    covered = {id(variable) for variable, _ in targets.values()}
    left = [v.path for v in model.trainable_variables if id(v) not in covered]
    if left:
        raise RuntimeError(f"the importer does not know where these weights come from: {left}")
    return targets


def _shown(items: list[str], limit: int = 6) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def load_weights(
    model: VisionTransformer, path: str, *, interpolation: str = "bilinear"
) -> Imported:
    """Initialises `model` from the published ViT weights in `path` (files as `layouts` says).

    Everything is checked before any variable is written, so an error leaves the model as it
    was. `interpolation` ("bilinear" or "bicubic") resizes position embeddings to another image
    size.
    """
    if not isinstance(model, VisionTransformer):
        raise WeightsError(
            f"{path}: published ViT weights (.npz, .safetensors) initialise a VisionTransformer; "
            f"this model is a {type(model).__name__}"
        )
    if interpolation not in INTERPOLATIONS:
        raise WeightsError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    arrays = read_arrays(path)
    targets = _targets(model)
    layout, prefix, tensors = find_layout(arrays, path, model.depth)
    _check_heads(model, layout, tensors, arrays, path)
    missing = [k for t in tensors if t.name not in HEAD for k in t.keys if k not in arrays]
    if missing:
        raise WeightsError(
            f"{path} ({layout} layout) lacks {len(missing)} of the model's tensors: "
            f"{_shown(missing)}: is it a ViT of this kind (class token, learned positions)?"
        )
    used = {key for t in tensors for key in t.keys}
    unused = sorted(k for k in arrays if k.startswith(prefix) and k not in used)
    dropped = [k for k in unused if DROPPED.search(k)]
    extra = [k for k in unused if k not in dropped]
    if extra:
        raise WeightsError(
            f"{path} ({layout} layout) has {len(extra)} tensors this model has no place for: "
            f"{_shown(extra)}: is it a ViT of this kind (no registers, layer scale or other "
            "pooling)?"
        )

    values, mismatched = {}, []
    for t in tensors:
        if not all(key in arrays for key in t.keys):
            continue  # an absent head: re-initialised below
        variable, index = targets[t.name]
        ours = tuple(variable.shape if index is None else variable.shape[1:])
        inputs = [arrays[key] if t.index is None else arrays[key][t.index] for key in t.keys]
        value = t.convert(*(_float(x, key, path) for x, key in zip(inputs, t.keys)))
        if t.name == "positions" and value.ndim == 3 and value.shape[-1] == ours[-1]:
            value = resize_positions(value, math.isqrt(model.num_patches), interpolation)
        values[t.name] = value
        if tuple(value.shape) != ours and t.name not in HEAD:
            mismatched.append(
                f"{t.described()} gives {t.name} {list(value.shape)}, {list(ours)} here"
            )
    if mismatched:
        raise WeightsError(
            f"{path} ({layout} layout): {len(mismatched)} tensors differ in shape from the "
            f"model's: {_shown(mismatched, 3)}: is it the weights of this model size (dim, "
            "mlp_dim, patch_size, channels)?"
        )
    # The head is taken whole or re-initialised whole.
    head = {name: tuple(targets[name][0].shape) for name in HEAD}
    reinitialized = []
    if any(name not in values or values[name].shape != head[name] for name in HEAD):
        for name in HEAD:
            value = values.pop(name, None)
            reinitialized.append((name, None if value is None else value.shape, head[name]))
    _assign(targets, values)
    positions = next(t.keys[0] for t in tensors if t.name == "positions")
    file_grid, model_grid = grid_side(arrays[positions].shape[1]), math.isqrt(model.num_patches)
    return Imported(
        source=path,
        layout=layout,
        taken=tuple(values),
        reinitialized=tuple(reinitialized),
        resized=None if file_grid == model_grid else (file_grid, model_grid),
        dropped=tuple(dropped),
        notes=_gelu_note(model, layout),
    )


def _check_heads(
    model: VisionTransformer,
    layout: str,
    tensors: list[Tensor],
    arrays: dict[str, np.ndarray],
    path: str,
) -> None:
    """Flax's per-head kernels say how many heads the file's model had (timm's fused matrix
    cannot): another number would reshape without an error and compute something else."""
    if layout == "timm":
        return
    query = next(t for t in tensors if t.name == "block_0/attention/qkv/kernel").keys[0]
    if query not in arrays:
        return  # reported as missing
    heads, head_dim = arrays[query].shape[-2:]
    ours = (model.blocks or [model.scanned_blocks.template])[0].num_heads
    if heads != ours:
        raise WeightsError(
            f"{path}: {query} has {heads} heads of {head_dim}, the model {ours}: is it the "
            "weights of this model size?"
        )


def _float(value: np.ndarray, key: str, path: str) -> np.ndarray:
    """A weight as float32: NumPy stores JAX's bfloat16 as 2-byte void, widened here."""
    if value.dtype.kind == "V" and value.dtype.itemsize == 2:
        value = (value.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if value.dtype.kind != "f":
        raise WeightsError(f"{path}: tensor {key} is of dtype {value.dtype}, not a float")
    return value.astype(np.float32)


def _assign(
    targets: dict[str, tuple[keras.Variable, int | None]], values: dict[str, np.ndarray]
) -> None:
    """Writes each value to its variable; a stacked variable's slices are written at once."""
    stacks: dict[int, tuple[keras.Variable, np.ndarray]] = {}
    for name, value in values.items():
        variable, index = targets[name]
        if index is None:
            variable.assign(tf.cast(value, variable.dtype))
            continue
        if id(variable) not in stacks:
            stacks[id(variable)] = (variable, np.array(variable.numpy(), np.float32))
        stacks[id(variable)][1][index] = value
    for variable, stack in stacks.values():
        variable.assign(tf.cast(stack, variable.dtype))


def _gelu_note(model: VisionTransformer, layout: str) -> tuple[str, ...]:
    trained_approximate = layout != "timm"
    if model.approximate_gelu == trained_approximate:
        return ()
    if trained_approximate:
        return (
            "these weights were trained with GELU's tanh approximation and this model computes "
            "the exact GELU (VisionTransformer.approximate_gelu=True gives their outputs)",
        )
    return (
        "these weights were trained with the exact GELU and this model computes its tanh "
        "approximation (VisionTransformer.approximate_gelu=False gives their outputs)",
    )
