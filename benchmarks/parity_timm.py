"""Parity with timm: published-layout weights imported by `framework.models.weights` give
timm's logits.

Needs PyTorch and timm, which the framework does not depend on: run it in an environment that has
them beside the framework (`pip install torch timm` and `pip install -e .`). Nothing is
downloaded. timm's `vit_base_patch16_224` is built with random weights (`pretrained=False`, then
every parameter moved by N(0, 0.02^2) so that biases, norms and the class token are not their
constant initial values), and the same random images go through timm's model and ours:

- timm's state dict saved by `safetensors.torch.save_file` and as a `.npz`, imported into
  `vit_b16()`;
- a `.npz` of random arrays under the original ViT's Flax names, loaded by timm's own reader
  (`model.load_pretrained`) and by ours (`vit_b16(approximate_gelu=False)`: timm computes the
  exact GELU whatever the file);
- the 224 px state dict into 384 px models: timm resizes `pos_embed` with
  `resample_abs_pos_embed(interpolation="bilinear", antialias=False)`, we with `load_weights`;
  the bicubic tables are compared too (TensorFlow's bicubic kernel is Keys' a = -0.5, PyTorch's
  a = -0.75, so they differ by design).

    python benchmarks/parity_timm.py --out=benchmarks/results/parity_timm.md
    python benchmarks/parity_timm.py --quick      # ViT-Ti/16, no 384 px case
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile

# isort: off
# timm (through torchvision) before TensorFlow: the other order crashes in torchvision's
# operator registration (seen with torch 2.14.1, torchvision 0.29.1 and TensorFlow 2.21).
import timm
import torch
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed

# isort: on
import numpy as np
import tensorflow as tf
from reporting import machine, write_report

from framework.models import vit, weights

TOLERANCE = 1e-4  # float32, 12 blocks


def timm_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return model


def our_model(size: str, **overrides) -> vit.VisionTransformer:
    return {"tiny": vit.vit_tiny, "base": vit.vit_b16}[size](**overrides)


def logits_gap(theirs: torch.nn.Module, ours: vit.VisionTransformer, image_size: int) -> tuple:
    """(max |their logits - ours|, max |their logits|) on 4 random images."""
    images = np.random.default_rng(0).standard_normal((4, image_size, image_size, 3))
    images = images.astype(np.float32)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
    got = ours(tf.constant(images), training=False).numpy()
    return float(np.abs(expected - got).max()), float(np.abs(expected).max())


def flax_npz(model: torch.nn.Module, path: str, seed: int = 1) -> None:
    """Random arrays under the original ViT's Flax names and shapes (the model gives sizes)."""
    rng = np.random.default_rng(seed)
    dim, heads = model.embed_dim, model.blocks[0].attn.num_heads
    patch, mlp = model.patch_embed.patch_size[0], model.blocks[0].mlp.fc1.out_features
    tokens, classes = model.pos_embed.shape[1], model.head.out_features

    def normal(*shape, mean=0.0):
        return (mean + 0.02 * rng.standard_normal(shape)).astype(np.float32)

    arrays = {
        "embedding/kernel": normal(patch, patch, 3, dim),
        "embedding/bias": normal(dim),
        "cls": normal(1, 1, dim),
        "Transformer/posembed_input/pos_embedding": normal(1, tokens, dim),
        "Transformer/encoder_norm/scale": normal(dim, mean=1.0),
        "Transformer/encoder_norm/bias": normal(dim),
        "head/kernel": normal(dim, classes),
        "head/bias": normal(classes),
    }
    for i in range(len(model.blocks)):
        b = f"Transformer/encoderblock_{i}/"
        for norm in ("LayerNorm_0", "LayerNorm_2"):
            arrays[f"{b}{norm}/scale"] = normal(dim, mean=1.0)
            arrays[f"{b}{norm}/bias"] = normal(dim)
        for name in ("query", "key", "value"):
            arrays[f"{b}MultiHeadDotProductAttention_1/{name}/kernel"] = normal(
                dim, heads, dim // heads
            )
            arrays[f"{b}MultiHeadDotProductAttention_1/{name}/bias"] = normal(heads, dim // heads)
        arrays[f"{b}MultiHeadDotProductAttention_1/out/kernel"] = normal(heads, dim // heads, dim)
        arrays[f"{b}MultiHeadDotProductAttention_1/out/bias"] = normal(dim)
        arrays[f"{b}MlpBlock_3/Dense_0/kernel"] = normal(dim, mlp)
        arrays[f"{b}MlpBlock_3/Dense_0/bias"] = normal(mlp)
        arrays[f"{b}MlpBlock_3/Dense_1/kernel"] = normal(mlp, dim)
        arrays[f"{b}MlpBlock_3/Dense_1/bias"] = normal(dim)
    np.savez(path, **arrays)


def measure(quick: bool, scratch: str) -> list[tuple[str, str, str]]:
    size = "tiny" if quick else "base"
    name = f"vit_{size}_patch16_224"
    theirs = timm_model(name)
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    rows = []

    def row(case: str, gap: float, scale: float) -> None:
        verdict = "yes" if gap < TOLERANCE else "NO"
        rows.append((case, f"{gap:.2e} (logits up to {scale:.2f})", verdict))

    path = os.path.join(scratch, "timm.safetensors")
    save_file(state, path)
    ours = our_model(size)
    weights.load_weights(ours, path)
    row(f"`{name}` state dict, .safetensors (F32)", *logits_gap(theirs, ours, 224))

    path = os.path.join(scratch, "timm.npz")
    np.savez(path, **{k: v.numpy() for k, v in state.items()})
    ours = our_model(size)
    weights.load_weights(ours, path)
    row(f"`{name}` state dict, .npz", *logits_gap(theirs, ours, 224))

    path = os.path.join(scratch, "vit.npz")
    flax_npz(theirs, path)
    flax_timm = timm_model(name)
    flax_timm.load_pretrained(path)
    ours = our_model(size, approximate_gelu=False)
    weights.load_weights(ours, path)
    row("original ViT .npz (Flax names), read by timm and by us", *logits_gap(flax_timm, ours, 224))

    if not quick:
        path = os.path.join(scratch, "timm.safetensors")
        big = timm_model(f"vit_{size}_patch16_384")
        resized = dict(state)
        resized["pos_embed"] = resample_abs_pos_embed(
            state["pos_embed"], [24, 24], interpolation="bilinear", antialias=False
        )
        big.load_state_dict(resized)
        ours = our_model(size, image_size=384)
        weights.load_weights(ours, path)
        row(
            "224 px state dict into 384 px models (bilinear positions)", *logits_gap(big, ours, 384)
        )
        bicubic = resample_abs_pos_embed(
            state["pos_embed"], [24, 24], interpolation="bicubic", antialias=False
        ).numpy()
        ours_bicubic = weights.resize_positions(state["pos_embed"].numpy(), 24, "bicubic")
        gap = float(np.abs(bicubic - ours_bicubic).max())
        scale = float(np.abs(bicubic).max())
        rows.append(
            (
                "bicubic position tables 14x14 -> 24x24 (not logits)",
                f"{gap:.2e} (values up to {scale:.2f})",
                "differs by design (a = -0.5 vs -0.75)",
            )
        )
    return rows


def format_report(rows: list[tuple[str, str, str]], command: str) -> str:
    table = "\n".join(f"| {case} | {gap} | {verdict} |" for case, gap, verdict in rows)
    return (
        f"Command: `{command}`\n\nMachine: {machine()}, PyTorch {torch.__version__}, "
        f"timm {timm.__version__}\n\n"
        f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}, load average "
        f"{os.getloadavg()[0]:.2f}\n\n"
        f"| case | max abs difference of the logits, float32 | below {TOLERANCE:g} |\n"
        f"|---|---|---|\n{table}\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="ViT-Ti/16, no 384 px case")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parity_timm-") as scratch:
        rows = measure(args.quick, scratch)
    command = "python benchmarks/parity_timm.py " + " ".join(sys.argv[1:])
    write_report(format_report(rows, command.strip()), args.out)
    return 0 if all(verdict != "NO" for _, _, verdict in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
