"""Published ViT weights into VisionTransformer: timm's and Flax's layouts, heads, positions.

Each file is written here by its layout's own conventions (timm's PyTorch state dict; the Flax
parameter trees of the original ViT and big_vision), and a NumPy forward pass written by the same
conventions gives the logits our model must reproduce: names, shapes and transposes are right
only if they match.
"""

from __future__ import annotations

import json
import logging
import math
import struct

import keras
import ml_dtypes
import numpy as np
import pytest

from framework.models import VisionTransformer, weights
from framework.trainer import Trainer, warm_start
from tests import tiny

# Three heads of four: a mix-up of heads and head_dim changes the outputs.
DIM, HEADS, MLP, DEPTH, PATCH, CLASSES = 12, 3, 16, 2, 4, 3
MODEL = dict(
    image_size=8,
    patch_size=PATCH,
    num_classes=CLASSES,
    dim=DIM,
    depth=DEPTH,
    num_heads=HEADS,
    mlp_dim=MLP,
)
EPS = 1e-6


def normal(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * scale + bias


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def gelu_exact(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


# timm: a PyTorch state dict ([out, in] Linear weights, OIHW conv, NCHW images).


def timm_state_dict(seed: int = 0, *, grid: int = 2, classes: int = CLASSES, depth: int = DEPTH):
    rng = np.random.default_rng(seed)
    sd = {
        "patch_embed.proj.weight": normal(rng, DIM, 3, PATCH, PATCH),
        "patch_embed.proj.bias": normal(rng, DIM),
        "cls_token": normal(rng, 1, 1, DIM),
        "pos_embed": normal(rng, 1, 1 + grid * grid, DIM),
        "norm.weight": 1 + normal(rng, DIM),
        "norm.bias": normal(rng, DIM),
        "head.weight": normal(rng, classes, DIM),
        "head.bias": normal(rng, classes),
    }
    for i in range(depth):
        b = f"blocks.{i}."
        sd |= {
            b + "norm1.weight": 1 + normal(rng, DIM),
            b + "norm1.bias": normal(rng, DIM),
            b + "attn.qkv.weight": normal(rng, 3 * DIM, DIM),
            b + "attn.qkv.bias": normal(rng, 3 * DIM),
            b + "attn.proj.weight": normal(rng, DIM, DIM),
            b + "attn.proj.bias": normal(rng, DIM),
            b + "norm2.weight": 1 + normal(rng, DIM),
            b + "norm2.bias": normal(rng, DIM),
            b + "mlp.fc1.weight": normal(rng, MLP, DIM),
            b + "mlp.fc1.bias": normal(rng, MLP),
            b + "mlp.fc2.weight": normal(rng, DIM, MLP),
            b + "mlp.fc2.bias": normal(rng, DIM),
        }
    return sd


def timm_forward(sd: dict, images_nhwc: np.ndarray) -> np.ndarray:
    """timm's VisionTransformer.forward, in NumPy, by PyTorch's conventions."""
    x = images_nhwc.transpose(0, 3, 1, 2).astype(np.float64)  # NCHW
    n, c, h, w = x.shape
    patches = x.reshape(n, c, h // PATCH, PATCH, w // PATCH, PATCH)
    x = np.einsum("ncyixj,ocij->nyxo", patches, sd["patch_embed.proj.weight"])
    x = x.reshape(n, -1, DIM) + sd["patch_embed.proj.bias"]  # flatten(2).transpose(1, 2)
    x = np.concatenate([np.repeat(sd["cls_token"], n, 0), x], 1) + sd["pos_embed"]
    length = x.shape[1]
    for i in range(len({k.split(".")[1] for k in sd if k.startswith("blocks.")})):
        b = f"blocks.{i}."
        y = layer_norm(x, sd[b + "norm1.weight"], sd[b + "norm1.bias"])
        qkv = y @ sd[b + "attn.qkv.weight"].T + sd[b + "attn.qkv.bias"]
        qkv = qkv.reshape(n, length, 3, HEADS, DIM // HEADS).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = softmax(q @ k.transpose(0, 1, 3, 2) * (DIM // HEADS) ** -0.5)
        y = (attn @ v).transpose(0, 2, 1, 3).reshape(n, length, DIM)
        x = x + y @ sd[b + "attn.proj.weight"].T + sd[b + "attn.proj.bias"]
        y = layer_norm(x, sd[b + "norm2.weight"], sd[b + "norm2.bias"])
        y = gelu_exact(y @ sd[b + "mlp.fc1.weight"].T + sd[b + "mlp.fc1.bias"])
        x = x + y @ sd[b + "mlp.fc2.weight"].T + sd[b + "mlp.fc2.bias"]
    x = layer_norm(x, sd["norm.weight"], sd["norm.bias"])
    return x[:, 0] @ sd["head.weight"].T + sd["head.bias"]


# Flax: the original ViT and big_vision (kernels [in, out], per-head attention kernels, HWIO
# conv, NHWC images), as a tree first, then flattened by each code base's names.


def flax_tree(seed: int = 0, *, grid: int = 2, class_position: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    hd = DIM // HEADS

    def dense(*shape):
        return {"kernel": normal(rng, *shape), "bias": normal(rng, shape[-1])}

    def norm():
        return {"scale": 1 + normal(rng, DIM), "bias": normal(rng, DIM)}

    def attention():
        qkv = {
            n: {"kernel": normal(rng, DIM, HEADS, hd), "bias": normal(rng, HEADS, hd)}
            for n in ("query", "key", "value")
        }
        return qkv | {"out": {"kernel": normal(rng, HEADS, hd, DIM), "bias": normal(rng, DIM)}}

    return {
        "embedding": {"kernel": normal(rng, PATCH, PATCH, 3, DIM), "bias": normal(rng, DIM)},
        "cls": normal(rng, 1, 1, DIM),
        "pos": normal(rng, 1, grid * grid + class_position, DIM),
        "blocks": [
            {
                "ln1": norm(),
                "mha": attention(),
                "ln2": norm(),
                "mlp": {"Dense_0": dense(DIM, MLP), "Dense_1": dense(MLP, DIM)},
            }
            for _ in range(DEPTH)
        ],
        "encoder_norm": norm(),
        "head": dense(DIM, CLASSES),
    }


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}/")
        else:
            out[f"{prefix}{key}"] = value
    return out


def flax_npz(tree: dict, style: str) -> dict[str, np.ndarray]:
    """The tree under the names of the original ViT ("vit": posembed_input, blocks numbered
    LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3) or big_vision
    ("big_vision": params/ prefix, pos_embedding without a class position, LayerNorm_0,
    MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0; "big_vision_scanned" stacks the
    blocks under encoderblock/)."""
    vit = style == "vit"
    names = ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")
    if not vit:
        names = ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0")
    blocks = [dict(zip(names, (b["ln1"], b["mha"], b["ln2"], b["mlp"]))) for b in tree["blocks"]]
    encoder = {"encoder_norm": tree["encoder_norm"]}
    if style == "big_vision_scanned":
        flat = [flatten(b) for b in blocks]
        encoder["encoderblock"] = {k: np.stack([f[k] for f in flat]) for k in flat[0]}
    else:
        encoder |= {f"encoderblock_{i}": b for i, b in enumerate(blocks)}
    top = {"embedding": tree["embedding"], "cls": tree["cls"], "head": tree["head"]}
    if vit:  # as the ImageNet-21k models: with a pre-logits layer, which fine-tuning drops
        encoder["posembed_input"] = {"pos_embedding": tree["pos"]}
        pre_logits = {"kernel": np.eye(DIM, dtype=np.float32), "bias": np.zeros(DIM, np.float32)}
        return flatten(top | {"Transformer": encoder, "pre_logits": pre_logits})
    # big_vision: an optimizer's state outside params/ is not the model's.
    return flatten(top | {"pos_embedding": tree["pos"], "Transformer": encoder}, "params/") | {
        "opt/step": np.array(7)
    }


def flax_forward(tree: dict, images_nhwc: np.ndarray) -> np.ndarray:
    """The Flax ViT's forward pass in NumPy, with Flax's tanh GELU; a position table of the grid
    only (big_vision's) is added before the class token is."""
    x = images_nhwc.astype(np.float64)
    n, h, w, c = x.shape
    patches = x.reshape(n, h // PATCH, PATCH, w // PATCH, PATCH, c)
    x = np.einsum("nyixjc,ijco->nyxo", patches, tree["embedding"]["kernel"])
    x = x.reshape(n, -1, DIM) + tree["embedding"]["bias"]
    cls = np.repeat(tree["cls"], n, 0)
    if tree["pos"].shape[1] == x.shape[1]:
        x = np.concatenate([cls, x + tree["pos"]], 1)
    else:
        x = np.concatenate([cls, x], 1) + tree["pos"]
    for b in tree["blocks"]:
        y = layer_norm(x, b["ln1"]["scale"], b["ln1"]["bias"])
        q, k, v = (
            np.einsum("nld,dhk->nlhk", y, b["mha"][m]["kernel"]) + b["mha"][m]["bias"]
            for m in ("query", "key", "value")
        )
        attn = softmax(np.einsum("nqhk,nlhk->nhql", q / np.sqrt(DIM // HEADS), k))
        y = np.einsum("nhql,nlhk->nqhk", attn, v)
        x = x + np.einsum("nqhk,hkd->nqd", y, b["mha"]["out"]["kernel"]) + b["mha"]["out"]["bias"]
        y = layer_norm(x, b["ln2"]["scale"], b["ln2"]["bias"])
        d0, d1 = b["mlp"]["Dense_0"], b["mlp"]["Dense_1"]
        x = x + gelu_tanh(y @ d0["kernel"] + d0["bias"]) @ d1["kernel"] + d1["bias"]
    x = layer_norm(x, tree["encoder_norm"]["scale"], tree["encoder_norm"]["bias"])
    return x[:, 0] @ tree["head"]["kernel"] + tree["head"]["bias"]


def write_safetensors(path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    """The format's spec: u64 little-endian header size, a JSON header of dtypes, shapes and
    byte offsets (padded with spaces to 8 bytes), then the little-endian buffers."""
    numpy_dtype = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": ml_dtypes.bfloat16}
    header, buffers, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, value in tensors.items():
        data = np.ascontiguousarray(value.astype(numpy_dtype[dtype])).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        buffers.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(buffers))


def images(size: int = 8, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, size, size, 3)).astype(np.float32)


@pytest.mark.parametrize("suffix", ["safetensors", "npz"])
def test_timm_weights_give_timms_outputs(tmp_path, suffix):
    sd = timm_state_dict()
    path = tmp_path / f"vit.{suffix}"
    if suffix == "npz":
        np.savez(path, **sd)
    else:
        write_safetensors(path, sd)
    model = VisionTransformer(**MODEL)
    result = weights.load_weights(model, str(path))
    assert result.layout == "timm" and not result.reinitialized and not result.notes
    assert len(result.taken) == len(model.trainable_variables) == len(sd)
    np.testing.assert_allclose(model(images()), timm_forward(sd, images()), atol=2e-5)


@pytest.mark.parametrize(
    "style, scan_layers",
    [("vit", False), ("big_vision", False), ("big_vision_scanned", True)],
)
def test_flax_weights_give_their_outputs(tmp_path, style, scan_layers):
    tree = flax_tree(class_position=style == "vit")
    path = tmp_path / "vit.npz"
    np.savez(path, **flax_npz(tree, style))
    model = VisionTransformer(**MODEL, approximate_gelu=True, scan_layers=scan_layers)
    result = weights.load_weights(model, str(path))
    assert result.layout == style.removesuffix("_scanned") and not result.notes
    assert result.dropped == (("pre_logits/bias", "pre_logits/kernel") if style == "vit" else ())
    np.testing.assert_allclose(model(images()), flax_forward(tree, images()), atol=2e-5)
    exact = VisionTransformer(**MODEL)  # the exact GELU: close, not equal, and said so
    assert "tanh approximation" in weights.load_weights(exact, str(path)).summary()
    assert not np.allclose(exact(images()), flax_forward(tree, images()), atol=2e-5)


def test_a_head_for_other_classes_is_reinitialised_and_listed(tmp_path):
    sd = timm_state_dict(classes=7)
    np.savez(tmp_path / "vit.npz", **sd)
    model = VisionTransformer(**MODEL)
    fresh = [model.head.kernel.numpy(), model.head.bias.numpy()]
    result = weights.load_weights(model, str(tmp_path / "vit.npz"))
    assert result.reinitialized == (
        ("head/kernel", (DIM, 7), (DIM, CLASSES)),
        ("head/bias", (7,), (CLASSES,)),
    )
    np.testing.assert_array_equal(model.head.kernel.numpy(), fresh[0])
    np.testing.assert_array_equal(model.head.bias.numpy(), fresh[1])
    np.testing.assert_array_equal(model.norm.gamma.numpy(), sd["norm.weight"])
    assert "head/kernel: (12, 7) in the file, (12, 3) here" in result.summary()

    del sd["head.weight"], sd["head.bias"]  # a feature extractor's file: no head at all
    np.savez(tmp_path / "headless.npz", **sd)
    result = weights.load_weights(VisionTransformer(**MODEL), str(tmp_path / "headless.npz"))
    assert [(name, theirs) for name, theirs, _ in result.reinitialized] == [
        ("head/kernel", None),
        ("head/bias", None),
    ]


def bilinear(table: np.ndarray, size: int) -> np.ndarray:
    """Half-pixel bilinear resize of a [g, g, dim] table (PyTorch's align_corners=False)."""
    old = table.shape[0]
    src = np.clip((np.arange(size) + 0.5) * old / size - 0.5, 0, old - 1)
    low = np.floor(src).astype(int)
    high, frac = np.minimum(low + 1, old - 1), (src - low)[:, None]
    rows = table[low] * (1 - frac[..., None]) + table[high] * frac[..., None]
    return rows[:, low] * (1 - frac[None]) + rows[:, high] * frac[None]


def test_positions_are_resized_on_the_grid_keeping_the_class_token(tmp_path):
    positions = normal(np.random.default_rng(3), 1, 1 + 9, DIM)
    assert weights.resize_positions(positions, 3) is positions  # the same grid
    resized = weights.resize_positions(positions, 5)
    assert resized.shape == (1, 1 + 25, DIM)
    np.testing.assert_array_equal(resized[:, 0], positions[:, 0])
    table = positions[0, 1:].reshape(3, 3, DIM)
    np.testing.assert_allclose(resized[0, 1:], bilinear(table, 5).reshape(25, DIM), atol=1e-6)
    smaller = weights.resize_positions(positions, 2)  # no antialiasing, as timm's npz loader
    np.testing.assert_allclose(smaller[0, 1:], bilinear(table, 2).reshape(4, DIM), atol=1e-6)
    gridded = weights.resize_positions(positions[:, 1:], 3)  # big_vision: no class position
    np.testing.assert_array_equal(gridded[:, 0], 0.0)
    np.testing.assert_array_equal(gridded[:, 1:], positions[:, 1:])

    sd = timm_state_dict(grid=2)  # pretrained at 8 px, fine-tuned at 12 px
    write_safetensors(tmp_path / "vit.safetensors", sd)
    model = VisionTransformer(**{**MODEL, "image_size": 12})
    result = weights.load_weights(model, str(tmp_path / "vit.safetensors"))
    assert result.resized == (2, 3) and "from a 2x2 grid to 3x3" in result.summary()
    np.testing.assert_array_equal(model.positions.numpy()[:, 0], sd["pos_embed"][:, 0])
    assert model(images(12)).shape == (2, CLASSES)
    bicubic = VisionTransformer(**{**MODEL, "image_size": 12})
    weights.load_weights(bicubic, str(tmp_path / "vit.safetensors"), interpolation="bicubic")
    assert not np.allclose(bicubic.positions.numpy(), model.positions.numpy())


@pytest.mark.parametrize(
    "change, message",
    [
        ("fc1", r"blocks\.0\.mlp\.fc1\.weight gives block_0/mlp/fc1/kernel \[12, 20\], \[12, 16\]"),
        ("missing", r"lacks 1 of the model's tensors: blocks\.1\.norm2\.bias"),
        ("extra", r"no place for: blocks\.0\.ls1\.gamma"),
        ("deeper", "holds a ViT of 3 blocks, the model has 2"),
        ("heads", r"MultiHeadDotProductAttention_1/query/kernel has 3 heads of 4, the model 2"),
    ],
)
def test_a_file_of_another_model_is_an_error_naming_the_tensor(tmp_path, change, message):
    sd = timm_state_dict(depth=3 if change == "deeper" else DEPTH)
    if change == "fc1":
        sd["blocks.0.mlp.fc1.weight"] = normal(np.random.default_rng(0), 20, DIM)
    elif change == "missing":
        del sd["blocks.1.norm2.bias"]
    elif change == "extra":
        sd["blocks.0.ls1.gamma"] = np.ones(DIM, np.float32)  # layer scale
    elif change == "heads":
        sd = flax_npz(flax_tree(), "vit")
    np.savez(tmp_path / "vit.npz", **sd)
    model = VisionTransformer(**{**MODEL, "num_heads": 2 if change == "heads" else HEADS})
    before = model.patch_embed.kernel.numpy()
    with pytest.raises(weights.WeightsError, match=message):
        weights.load_weights(model, str(tmp_path / "vit.npz"))
    np.testing.assert_array_equal(model.patch_embed.kernel.numpy(), before)  # untouched


def test_half_precision_is_read_as_float32_and_a_broken_file_is_an_error(tmp_path):
    values = {"a": normal(np.random.default_rng(0), 3, 4), "b": np.float32([1.0, -2.5, 3e-3])}
    for dtype, rounded in (("F16", np.float16), ("BF16", ml_dtypes.bfloat16)):
        write_safetensors(tmp_path / "t.safetensors", values, dtype)
        read = weights.read_safetensors((tmp_path / "t.safetensors").read_bytes())
        for name, value in values.items():
            assert read[name].dtype == np.float32 and read[name].shape == value.shape
            np.testing.assert_array_equal(read[name], value.astype(rounded).astype(np.float32))
    data = (tmp_path / "t.safetensors").read_bytes()
    with pytest.raises(weights.WeightsError, match="truncated or corrupt"):
        weights.read_safetensors(data[:-4])
    (tmp_path / "broken.npz").write_bytes(data)
    with pytest.raises(weights.WeightsError, match="broken.npz is not a readable .npz file"):
        weights.read_arrays(str(tmp_path / "broken.npz"))
    # JAX's bfloat16 in a .npz: NumPy stores it as 2-byte void.
    sd = {k: v.astype(ml_dtypes.bfloat16) for k, v in timm_state_dict().items()}
    np.savez(tmp_path / "bf16.npz", **sd)
    model = VisionTransformer(**MODEL)
    weights.load_weights(model, str(tmp_path / "bf16.npz"))
    np.testing.assert_array_equal(model.norm.gamma.numpy(), sd["norm.weight"].astype(np.float32))


def test_init_checkpoint_takes_a_weights_file(tmp_path, caplog):
    """tiny.MODEL (dim 16, 2 heads, MLP 32, 4 classes) from a timm file of 10 classes."""
    rng = np.random.default_rng(5)
    dim, mlp = tiny.MODEL["dim"], tiny.MODEL["mlp_dim"]
    sd = {
        "patch_embed.proj.weight": normal(rng, dim, 3, 4, 4),
        "patch_embed.proj.bias": normal(rng, dim),
        "cls_token": normal(rng, 1, 1, dim),
        "pos_embed": normal(rng, 1, 5, dim),
        "norm.weight": normal(rng, dim),
        "norm.bias": normal(rng, dim),
        "head.weight": normal(rng, 10, dim),
        "head.bias": normal(rng, 10),
    }
    for i in range(tiny.MODEL["depth"]):
        for name, shape in [
            ("norm1", [dim]),
            ("attn.qkv", [3 * dim, dim]),
            ("attn.proj", [dim, dim]),
            ("norm2", [dim]),
            ("mlp.fc1", [mlp, dim]),
            ("mlp.fc2", [dim, mlp]),
        ]:
            sd[f"blocks.{i}.{name}.weight"] = normal(rng, *shape)
            sd[f"blocks.{i}.{name}.bias"] = normal(rng, shape[0])
    write_safetensors(tmp_path / "vit.safetensors", sd)
    with caplog.at_level(logging.INFO):
        run = Trainer(None, **tiny.TRAINER_ARGS, init_checkpoint=str(tmp_path / "vit.safetensors"))
    np.testing.assert_array_equal(
        run.model.patch_embed.kernel.numpy(), sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0)
    )
    np.testing.assert_array_equal(
        run.model.block_1.mlp.fc2.kernel.numpy(), sd["blocks.1.mlp.fc2.weight"].T
    )
    (line,) = [r.getMessage() for r in caplog.records if "warm start from" in r.getMessage()]
    assert "(timm layout): 30 weights taken, 2 re-initialised" in line
    assert "head/bias: (10,) in the file, (4,) here" in line

    with pytest.raises(warm_start.WarmStartError, match="init_checkpoint: no weights file at"):
        warm_start.warm_start(run.model, str(tmp_path / "absent.npz"))
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(warm_start.WarmStartError, match="initialise a VisionTransformer"):
        warm_start.warm_start(other, str(tmp_path / "vit.safetensors"))
