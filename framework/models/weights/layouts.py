"""The two layouts of published ViT weights, as lists of our weights and the file's tensors that
make each.

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
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from framework.models.weights.files import WeightsError


@dataclasses.dataclass(frozen=True)
class Tensor:
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


def _timm(depth: int) -> list[Tensor]:
    """timm's VisionTransformer state dict, by its own names and PyTorch layouts."""

    def dense(name: str, key: str) -> list[Tensor]:
        return [
            Tensor(f"{name}/kernel", (f"{key}.weight",), _transposed),
            Tensor(f"{name}/bias", (f"{key}.bias",)),
        ]

    def norm(name: str, key: str) -> list[Tensor]:
        return [
            Tensor(f"{name}/gamma", (f"{key}.weight",)),
            Tensor(f"{name}/beta", (f"{key}.bias",)),
        ]

    tensors = [
        Tensor("patch_embed/kernel", ("patch_embed.proj.weight",), _conv_kernel),
        Tensor("patch_embed/bias", ("patch_embed.proj.bias",)),
        Tensor("class_token", ("cls_token",)),
        Tensor("positions", ("pos_embed",)),
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


def _vit(keys: set[str], depth: int, prefix: str) -> tuple[str, list[Tensor]]:
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

    def dense(name: str, key: str, index: int | None = None) -> list[Tensor]:
        return [
            Tensor(f"{name}/kernel", (f"{key}/kernel",), index=index),
            Tensor(f"{name}/bias", (f"{key}/bias",), index=index),
        ]

    def norm(name: str, key: str, index: int | None = None) -> list[Tensor]:
        return [
            Tensor(f"{name}/gamma", (f"{key}/scale",), index=index),
            Tensor(f"{name}/beta", (f"{key}/bias",), index=index),
        ]

    tensors = [
        Tensor("patch_embed/kernel", (f"{p}embedding/kernel",)),  # Flax's Conv is HWIO too
        Tensor("patch_embed/bias", (f"{p}embedding/bias",)),
        Tensor("class_token", (f"{p}cls",)),
        Tensor("positions", (positions,)),
        *norm("norm", f"{p}Transformer/encoder_norm"),
        *dense("head", f"{p}head"),
    ]
    for i in range(depth):
        block = f"block_{i}"
        key, index = (first[:-1], i) if stacked else (f"{p}Transformer/encoderblock_{i}", None)
        qkv = tuple(f"{key}/{mha[0]}/{name}" for name in ("query", "key", "value"))
        tensors += [
            *norm(f"{block}/norm1", f"{key}/{norms[0]}", index),
            Tensor(
                f"{block}/attention/qkv/kernel",
                tuple(f"{k}/kernel" for k in qkv),
                _flax_qkv_kernel,
                index,
            ),
            Tensor(
                f"{block}/attention/qkv/bias",
                tuple(f"{k}/bias" for k in qkv),
                _flax_qkv_bias,
                index,
            ),
            Tensor(
                f"{block}/attention/out/kernel",
                (f"{key}/{mha[0]}/out/kernel",),
                _flax_out_kernel,
                index,
            ),
            Tensor(f"{block}/attention/out/bias", (f"{key}/{mha[0]}/out/bias",), index=index),
            *norm(f"{block}/norm2", f"{key}/{norms[1]}", index),
            *dense(f"{block}/mlp/fc1", f"{key}/{mlp[0]}/Dense_0", index),
            *dense(f"{block}/mlp/fc2", f"{key}/{mlp[0]}/Dense_1", index),
        ]
    return layout, tensors


def find_layout(
    arrays: dict[str, np.ndarray], path: str, depth: int
) -> tuple[str, str, list[Tensor]]:
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
