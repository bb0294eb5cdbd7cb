"""Published ViT weights into a `VisionTransformer`, from a file the user passes in.

Two layouts are read (nothing is downloaded):

- The original ViT's and big_vision's `.npz` (Flax names): `embedding/kernel` (a conv kernel,
  HWIO), `cls`, `Transformer/posembed_input/pos_embedding` (big_vision: `pos_embedding`, with
  no position for the class token, which is then given position 0), and per block
  `Transformer/encoderblock_N/` `LayerNorm_0`, `MultiHeadDotProductAttention_1` (`query`, `key`,
  `value` kernels [dim, heads, head_dim], `out` [heads, head_dim, dim]), `LayerNorm_2`,
  `MlpBlock_3/Dense_0|1` (big_vision numbers them `_0`, `_0`, `_1`, `_0`, and a scanned model
  stacks all blocks under `Transformer/encoderblock/` on a leading axis); then
  `Transformer/encoder_norm` and `head`. A prefix (`opt/target/`, `params/`) is found and kept
  to; tensors outside it (an optimizer's state) are skipped.
- timm's state dict (PyTorch layouts), as `.safetensors` or `.npz`: `patch_embed.proj.weight`
  (a conv kernel, OIHW), `cls_token`, `pos_embed`, `blocks.N.norm1`, `blocks.N.attn.qkv.weight`
  (one fused [3 * dim, dim] matrix, [out, in]), `attn.proj`, `norm2`, `mlp.fc1`, `mlp.fc2`,
  `norm` and `head`.

Our attention fuses q, k and v in one [dim, 3 * dim] kernel whose output columns are ordered
(q|k|v, head, head_dim), as timm's rows are, so timm's matrices are transposed and Flax's
per-head kernels are flattened and concatenated. Layer norms use epsilon 1e-6 as both do.
GELU differs: Flax's `nn.gelu` is the tanh approximation, so the original ViT and big_vision
weights match a model built with `approximate_gelu=True`; timm's use the exact form (the
default). The importer says so when the model computes the other one.

A head for another number of classes (or none in the file) keeps its fresh initialisation and
is listed; position embeddings for another image size are resized on their 2-D grid (bilinear by
default, or bicubic), the class token's position kept. Any other tensor that is missing, of
another shape, or left over in the file is an error naming it: the file is of another model.

`.safetensors` is read by the small reader here (8-byte little-endian header length, a JSON
header, raw little-endian buffers) rather than the `safetensors` package: its NumPy API has no
bfloat16, in which many checkpoints are published, it reads local files only where this reads
`gs://` too through `tf.io.gfile`, and the format is a page long.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import re
import struct
import zipfile
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from framework.models.vit import VisionTransformer

SUFFIXES = (".npz", ".safetensors")
INTERPOLATIONS = ("bilinear", "bicubic")
# Published files may carry a pre-logits layer (a dense + tanh the original ViT trained on
# ImageNet-21k with): fine-tuning drops it, as the ViT paper and timm do.
DROPPED = re.compile(r"(^|[/.])pre_logits[/.]")
# safetensors dtypes, as NumPy little-endian dtypes; BF16 is widened to float32 by hand.
SAFETENSORS_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}
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


class WeightsError(ValueError):
    """The file cannot initialise this model: what is wrong, naming the tensors, in one line."""


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


def is_weights_file(path: str) -> bool:
    """Whether `path` names a published weights file (by its suffix), not a TF checkpoint."""
    return path.lower().endswith(SUFFIXES)


def read_safetensors(data: bytes, name: str = "safetensors data") -> dict[str, np.ndarray]:
    """The tensors of a `.safetensors` file's bytes; floating ones (F16, BF16, F64) as float32."""
    if len(data) < 8:
        raise WeightsError(f"{name} is not a safetensors file: {len(data)} bytes")
    (header_size,) = struct.unpack("<Q", data[:8])
    if 8 + header_size > len(data):
        raise WeightsError(
            f"{name} is not a safetensors file: its header would take {header_size} bytes "
            f"of {len(data)}"
        )
    try:
        header = json.loads(data[8 : 8 + header_size])
    except ValueError as error:
        raise WeightsError(f"{name} is not a safetensors file: bad header ({error})") from None
    start = 8 + header_size
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{name}: bad header entry for {key!r}: {info!r}") from None
        if dtype == "BF16":
            numpy_dtype = np.dtype("<u2")
        elif dtype in SAFETENSORS_DTYPES:
            numpy_dtype = np.dtype(SAFETENSORS_DTYPES[dtype])
        else:
            raise WeightsError(f"{name}: tensor {key!r} is of dtype {dtype}, which is not read")
        count = math.prod(shape)
        if end - begin != count * numpy_dtype.itemsize or start + end > len(data):
            raise WeightsError(
                f"{name}: tensor {key!r} ({dtype} {list(shape)}) has {end - begin} bytes at "
                f"{begin}: the file is truncated or corrupt"
            )
        value = np.frombuffer(data, numpy_dtype, count, start + begin).reshape(shape)
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            value = (value.astype(np.uint32) << 16).view(np.float32)
        tensors[key] = value.astype(np.float32) if value.dtype.kind == "f" else value
    return tensors


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """The tensors of a `.npz` or `.safetensors` file (any filesystem `tf.io.gfile` reads)."""
    if not tf.io.gfile.exists(path):
        raise WeightsError(f"no weights file at {path}")
    with tf.io.gfile.GFile(path, "rb") as f:
        data = f.read()
    if path.lower().endswith(".safetensors"):
        return read_safetensors(data, path)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile) as error:
        raise WeightsError(f"{path} is not a readable .npz file ({error})") from None


def grid_side(tokens: int) -> int:
    """The side of the square patch grid of `tokens` position embeddings, with or without a
    class token's first."""
    for grid_tokens in (tokens, tokens - 1):
        if grid_tokens > 0 and math.isqrt(grid_tokens) ** 2 == grid_tokens:
            return math.isqrt(grid_tokens)
    raise WeightsError(
        f"position embeddings for {tokens} tokens are neither a square grid nor a class token "
        "and a square grid"
    )


def resize_positions(
    positions: np.ndarray, grid: int, interpolation: str = "bilinear"
) -> np.ndarray:
    """Position embeddings [1, 1 + g * g, dim] for a `grid` x `grid` patch grid.

    `positions` is [1, 1 + g0 * g0, dim] (the class token's first) or [1, g0 * g0, dim] (none
    for the class token, as big_vision's: it gets zeros, which is the same model). The grid part
    is resized as an image (half-pixel centres, as PyTorch's `align_corners=False`), the class
    token's row kept; an equal grid is returned unchanged.
    """
    if interpolation not in INTERPOLATIONS:
        raise WeightsError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    if positions.ndim != 3 or positions.shape[0] != 1:
        raise WeightsError(f"position embeddings must be [1, tokens, dim], got {positions.shape}")
    tokens, dim = positions.shape[1:]
    side = grid_side(tokens)
    if tokens == side**2:
        positions = np.concatenate([np.zeros((1, 1, dim), positions.dtype), positions], axis=1)
    if side == grid:
        return positions
    table = positions[:, 1:].reshape(1, side, side, dim).astype(np.float32)
    resized = tf.image.resize(table, (grid, grid), method=interpolation, antialias=False)
    resized = tf.reshape(resized, (1, grid * grid, dim)).numpy().astype(positions.dtype)
    return np.concatenate([positions[:, :1], resized], axis=1)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One of the model's weights as the file holds it: the file's tensors (`keys`, each at
    `index` on a stacked leading axis when given) and how they become our layout."""

    name: str
    keys: tuple[str, ...]
    convert: Callable[..., np.ndarray] = lambda value: value
    index: int | None = None

    def described(self) -> str:
        at = "" if self.index is None else f"[{self.index}]"
        return "+".join(f"{key}{at}" for key in self.keys)


def _conv_kernel(value: np.ndarray) -> np.ndarray:
    """A PyTorch Conv2d weight [out, in, height, width] as a Keras Conv2D kernel [h, w, in, out]."""
    return value.transpose(2, 3, 1, 0)


def _transposed(value: np.ndarray) -> np.ndarray:
    """A PyTorch Linear weight [out, in] as a Keras Dense kernel [in, out]."""
    return value.T


def _timm(depth: int) -> list[_Tensor]:
    """timm's VisionTransformer state dict, by its own names and PyTorch layouts."""

    def dense(name: str, key: str) -> list[_Tensor]:
        return [
            _Tensor(f"{name}/kernel", (f"{key}.weight",), _transposed),
            _Tensor(f"{name}/bias", (f"{key}.bias",)),
        ]

    def norm(name: str, key: str) -> list[_Tensor]:
        return [
            _Tensor(f"{name}/gamma", (f"{key}.weight",)),
            _Tensor(f"{name}/beta", (f"{key}.bias",)),
        ]

    tensors = [
        _Tensor("patch_embed/kernel", ("patch_embed.proj.weight",), _conv_kernel),
        _Tensor("patch_embed/bias", ("patch_embed.proj.bias",)),
        _Tensor("class_token", ("cls_token",)),
        _Tensor("positions", ("pos_embed",)),
        *norm("norm", "norm"),
        *dense("head", "head"),
    ]
    for i in range(depth):
        block, key = f"block_{i}", f"blocks.{i}"
        tensors += [
            *norm(f"{block}/norm1", f"{key}.norm1"),
            *dense(f"{block}/attention/qkv", f"{key}.attn.qkv"),
            *dense(f"{block}/attention/out", f"{key}.attn.proj"),
            *norm(f"{block}/norm2", f"{key}.norm2"),
            *dense(f"{block}/mlp/fc1", f"{key}.mlp.fc1"),
            *dense(f"{block}/mlp/fc2", f"{key}.mlp.fc2"),
        ]
    return tensors


def _flax_qkv_kernel(*kernels: np.ndarray) -> np.ndarray:
    """Flax's query, key and value kernels [dim, heads, head_dim] as one [dim, 3 * dim]."""
    return np.concatenate([k.reshape(k.shape[0], -1) for k in kernels], axis=1)


def _flax_qkv_bias(*biases: np.ndarray) -> np.ndarray:
    return np.concatenate([b.reshape(-1) for b in biases])


def _flax_out_kernel(kernel: np.ndarray) -> np.ndarray:
    """Flax's attention output kernel [heads, head_dim, dim] as [dim, dim]."""
    return kernel.reshape(-1, kernel.shape[-1])


def _vit(keys: set[str], depth: int, prefix: str) -> tuple[str, list[_Tensor]]:
    """The original ViT's or big_vision's parameters, by their Flax names and layouts."""
    p = prefix
    stacked = f"{p}Transformer/encoderblock/LayerNorm_0/scale" in keys
    first = f"{p}Transformer/encoderblock{'' if stacked else '_0'}/"
    modules = sorted({k[len(first) :].split("/")[0] for k in keys if k.startswith(first)})
    # Flax numbers submodules in creation order, which differs between the two code bases.
    norms = [name for name in modules if name.startswith("LayerNorm_")]
    mha = [name for name in modules if name.startswith("MultiHeadDotProductAttention_")]
    mlp = [name for name in modules if name.startswith("MlpBlock_")]
    if len(norms) != 2 or len(mha) != 1 or len(mlp) != 1:
        raise WeightsError(
            f"the file's first block ({first}) has {modules}, not the two LayerNorms, one "
            "attention and one MlpBlock of a ViT block"
        )
    positions = f"{p}Transformer/posembed_input/pos_embedding"
    layout = "vit"
    if positions not in keys and f"{p}pos_embedding" in keys:
        positions, layout = f"{p}pos_embedding", "big_vision"
    if stacked or mha[0].endswith("_0"):
        layout = "big_vision"

    def dense(name: str, key: str, index: int | None = None) -> list[_Tensor]:
        return [
            _Tensor(f"{name}/kernel", (f"{key}/kernel",), index=index),
            _Tensor(f"{name}/bias", (f"{key}/bias",), index=index),
        ]

    def norm(name: str, key: str, index: int | None = None) -> list[_Tensor]:
        return [
            _Tensor(f"{name}/gamma", (f"{key}/scale",), index=index),
            _Tensor(f"{name}/beta", (f"{key}/bias",), index=index),
        ]

    tensors = [
        _Tensor("patch_embed/kernel", (f"{p}embedding/kernel",)),  # Flax's Conv is HWIO too
        _Tensor("patch_embed/bias", (f"{p}embedding/bias",)),
        _Tensor("class_token", (f"{p}cls",)),
        _Tensor("positions", (positions,)),
        *norm("norm", f"{p}Transformer/encoder_norm"),
        *dense("head", f"{p}head"),
    ]
    for i in range(depth):
        block = f"block_{i}"
        key, index = (first[:-1], i) if stacked else (f"{p}Transformer/encoderblock_{i}", None)
        qkv = tuple(f"{key}/{mha[0]}/{name}" for name in ("query", "key", "value"))
        tensors += [
            *norm(f"{block}/norm1", f"{key}/{norms[0]}", index),
            _Tensor(
                f"{block}/attention/qkv/kernel",
                tuple(f"{k}/kernel" for k in qkv),
                _flax_qkv_kernel,
                index,
            ),
            _Tensor(
                f"{block}/attention/qkv/bias",
                tuple(f"{k}/bias" for k in qkv),
                _flax_qkv_bias,
                index,
            ),
            _Tensor(
                f"{block}/attention/out/kernel",
                (f"{key}/{mha[0]}/out/kernel",),
                _flax_out_kernel,
                index,
            ),
            _Tensor(f"{block}/attention/out/bias", (f"{key}/{mha[0]}/out/bias",), index=index),
            *norm(f"{block}/norm2", f"{key}/{norms[1]}", index),
            *dense(f"{block}/mlp/fc1", f"{key}/{mlp[0]}/Dense_0", index),
            *dense(f"{block}/mlp/fc2", f"{key}/{mlp[0]}/Dense_1", index),
        ]
    return layout, tensors


def _layout(arrays: dict[str, np.ndarray], path: str, depth: int) -> tuple[str, str, list[_Tensor]]:
    """(layout, prefix of the model's tensors, tensors) for the file's names, checking its
    number of blocks first (a missing or extra block is another model size, said so)."""
    keys = set(arrays)
    if "patch_embed.proj.weight" in keys:
        prefix, layout, tensors = "", "timm", _timm(depth)
        found = len({m.group(1) for k in keys if (m := re.match(r"blocks\.(\d+)\.", k))})
    else:
        embedding = sorted(
            (k for k in keys if k == "embedding/kernel" or k.endswith("/embedding/kernel")),
            key=len,
        )
        if not embedding:
            raise WeightsError(
                f"{path} has neither timm's names (patch_embed.proj.weight) nor the ViT / "
                f"big_vision ones (embedding/kernel); its first tensors: {sorted(keys)[:5]}"
            )
        prefix = embedding[0].removesuffix("embedding/kernel")
        layout, tensors = _vit(keys, depth, prefix)
        stacked = f"{prefix}Transformer/encoderblock/LayerNorm_0/scale"
        pattern = re.escape(prefix) + r"Transformer/encoderblock_(\d+)/"
        found = (
            arrays[stacked].shape[0]
            if stacked in arrays
            else len({m.group(1) for k in keys if (m := re.match(pattern, k))})
        )
    if found != depth:
        raise WeightsError(
            f"{path} holds a ViT of {found} blocks, the model has {depth}: is it the weights "
            "of this model size?"
        )
    return layout, prefix, tensors


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
        raise RuntimeError(f"vit_weights does not know where these weights come from: {left}")
    return targets


def _shown(items: list[str], limit: int = 6) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def load_weights(
    model: VisionTransformer, path: str, *, interpolation: str = "bilinear"
) -> Imported:
    """Initialises `model` from the published ViT weights in `path` (see the module docstring).

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
    layout, prefix, tensors = _layout(arrays, path, model.depth)
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
    tensors: list[_Tensor],
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
