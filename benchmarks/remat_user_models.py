"""`set_grad_checkpointing` on keras-hub and keras.applications models: memory, cost, gradients.

For each model, a fresh process builds it with random weights (nothing downloaded), checkpoints
it with `remat.set_grad_checkpointing(model)` (default selection, `nothing_saveable`) and measures
against the same model without remat:

- XLA's temporaries for the gradient step (`framework.memory.compiled_bytes`, compiled, not run);
- the first call of the step in eager mode, in a `tf.function` and under XLA (`jit_compile=True`,
  as the trainer runs it), tracing and compilation included, with and without remat: what
  checkpointing adds to tracing;
- the gradients' relative error (global norm) in a `tf.function`, dropout on, same weights, seeds.

    python benchmarks/remat_user_models.py --out=benchmarks/results/remat_user_models.md
    python benchmarks/remat_user_models.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf
from reporting import child_json, machine, write_report

MODELS = (
    "vit", "bert", "gpt2", "gemma", "mixtral", "resnet50", "convnext", "efficientnet", "mobilenetv3"
)  # fmt: skip


def build(name: str, quick: bool):
    """The model and a batch for it: keras-hub backbones at 12 blocks, width 256 (quick: 2, 16);
    keras.applications at 160 px, batch 8 (quick: 32 px, batch 2)."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    layers, width = (2, 16) if quick else (12, 256)
    batch, length = (2, 8) if quick else (8, 128)
    ids = tf.random.stateless_uniform((batch, length), [1, 2], 1, 1000, tf.int32)
    tokens = {"token_ids": ids, "padding_mask": tf.ones_like(ids)}
    text = dict(
        vocabulary_size=1000, num_layers=layers, hidden_dim=width, intermediate_dim=4 * width
    )
    if name == "vit":
        size = 32 if quick else 224
        model = keras_hub.models.ViTBackbone(
            image_shape=(size, size, 3), patch_size=16 if not quick else 8, num_layers=layers,
            num_heads=4 if not quick else 2, hidden_dim=width, mlp_dim=4 * width,
            dropout_rate=0.1, attention_dropout=0.1,
        )  # fmt: skip
        return model, tf.random.stateless_normal((batch, size, size, 3), [3, 4])
    if name == "bert":
        model = keras_hub.models.BertBackbone(num_heads=4, max_sequence_length=length, **text)
        return model, {**tokens, "segment_ids": tf.zeros_like(ids)}
    if name == "gpt2":
        model = keras_hub.models.GPT2Backbone(num_heads=4, max_sequence_length=length, **text)
        return model, tokens
    if name == "gemma":
        model = keras_hub.models.GemmaBackbone(
            num_query_heads=4, num_key_value_heads=1, head_dim=width // 4, dropout=0.1, **text
        )
        return model, tokens
    if name == "mixtral":  # 4 experts, 2 per token; its blocks add the router's loss
        model = keras_hub.models.MixtralBackbone(
            num_query_heads=4, num_key_value_heads=1, num_experts=4, top_k=2, dropout=0.1, **text
        )
        return model, tokens
    size = 32 if quick else 160
    constructor = {
        "resnet50": keras.applications.ResNet50,
        "convnext": keras.applications.ConvNeXtTiny,
        "efficientnet": keras.applications.EfficientNetB0,
        "mobilenetv3": keras.applications.MobileNetV3Small,
    }[name]
    model = constructor(weights=None, input_shape=(size, size, 3), classes=10)
    return model, tf.random.stateless_normal((batch, size, size, 3), [5, 6])


def measure(name: str, quick: bool) -> dict:
    """One model, both settings, in this process."""
    from framework import memory, remat

    model, x = build(name, quick)
    model(x)
    start = [v.numpy() for v in model.variables]

    def step(x):
        with tf.GradientTape() as tape:
            y = model(x, training=True)
            y = tf.cast(y["sequence_output"] if isinstance(y, dict) else y, tf.float32)
            loss = tf.reduce_sum(y * tf.random.stateless_normal(tf.shape(y), [7, 8]))
            loss += sum(model.losses)  # Mixtral's router losses, as `fit` adds them
        grads = tape.gradient(loss, model.trainable_variables)
        return [tf.convert_to_tensor(g) for g in grads if g is not None]

    def first_call(function) -> tuple[float, list]:
        for v, value in zip(model.variables, start, strict=True):
            v.assign(value)
        begin = time.perf_counter()
        grads = [g.numpy() for g in function(x)]
        return time.perf_counter() - begin, grads

    result = {"model": name}
    for setting in ("none", "full"):
        if setting == "full":
            regions = remat.set_grad_checkpointing(model)
            result["regions"] = len(regions)
            result["region_kind"] = type(regions[0]).__name__
        result[f"{setting}_eager_s"], _ = first_call(step)
        result[f"{setting}_function_s"], grads = first_call(tf.function(step))
        result[f"{setting}_xla_s"], _ = first_call(tf.function(step, jit_compile=True))
        result[f"{setting}_grads"] = grads
        plan = memory.compiled_bytes(tf.function(step, jit_compile=True), x)
        result[f"{setting}_temp"] = plan.temp_bytes
    want, got = result.pop("none_grads"), result.pop("full_grads")
    diff = sum(np.sum((g.astype(np.float64) - w) ** 2) for g, w in zip(got, want, strict=True))
    result["grad_error"] = float(
        np.sqrt(diff / sum(np.sum(w.astype(np.float64) ** 2) for w in want))
    )
    return result


def report(rows: list[dict], command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}; date {datetime.date.today()}; load average "
        f"{os.getloadavg()[0]:.2f}.",
        "",
        "Full remat (`nothing_saveable`) with the default selection against no remat. Memory: "
        "XLA:CPU's temporaries of the gradient step. First call: trace (and compilation) plus "
        "one step, eager, in a `tf.function` and under XLA. Gradient error: relative, global "
        "norm, in a `tf.function`.",
        "",
        "| model | regions | XLA temp MiB no remat / full | ratio | first eager call s "
        "no remat / full | first tf.function call s no remat / full | first XLA call s no remat / "
        "full | grad rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['regions']} {r['region_kind']}s "
            f"| {r['none_temp'] / 2**20:.1f} / {r['full_temp'] / 2**20:.1f} "
            f"| {r['full_temp'] / r['none_temp']:.3f} "
            f"| {r['none_eager_s']:.1f} / {r['full_eager_s']:.1f} "
            f"| {r['none_function_s']:.1f} / {r['full_function_s']:.1f} "
            f"| {r['none_xla_s']:.1f} / {r['full_xla_s']:.1f} "
            f"| {r['grad_error']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.quick)))
        return
    rows = []
    for name in args.models.split(","):
        extra = ["--quick"] if args.quick else []
        rows.append(child_json(__file__, ["--child", name, *extra], {"model": name}))
    command = "python benchmarks/remat_user_models.py " + " ".join(sys.argv[1:])
    write_report(report(rows, command.strip()), args.out)


if __name__ == "__main__":
    main()
