"""JAX's own checkpointing on the same ViT-B/16 step: XLA's plan on the CPU and a TPU chip.

The comparison the remat library has to win: a user who could move to JAX would write the step
below (ViT-B/16 as this project builds it, dropout 0.1 in the same five places, softmax
cross-entropy) and wrap each block in `jax.checkpoint(block, policy=...)`. This script compiles
its forward and backward pass - nothing runs - with jax's CPU backend (XLA:CPU) and, with
`--target`, with libtpu's compile-only client for that chip, and reports the figures
`python -m framework.planner` reports for the TensorFlow step.

    python benchmarks/jax_vit_memory.py                       # batch 64, XLA:CPU and TPU v5e
    python benchmarks/jax_vit_memory.py --target= --batch=8   # XLA:CPU only
    python benchmarks/jax_vit_memory.py --quick               # a 2-block, 64 px smoke test
    python benchmarks/jax_vit_memory.py --target= --batch=8 --steps=5  # and time SGD steps

With `--steps`, each policy's train step (forward, backward and an SGD update, one jitted
program, the weights donated) also runs on the CPU: one call to compile and warm up, then the
median of `--steps` calls, each with fresh dropout bits.

Needs the `tpu` extra (jax, jaxlib, libtpu; in the test extra too). Every figure is a compiler's
plan: "step" is the program's arguments (weights, batch) + outputs (gradients) + temporaries (+
its code on a TPU) + AdamW's two slots per weight, the planner's "XLA step" on a TPU (on XLA:CPU
jax reports totals only, where the planner counts the buffers live at the peak: compare temps
there); "temp" is the temporaries alone, the planner's "XLA temp".
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from reporting import write_report  # noqa: E402

from framework.core import jax_internals  # noqa: E402
from framework.memory import tpu  # noqa: E402

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def vit_config(quick: bool) -> dict[str, int]:
    """ViT-B/16 (86.6 M parameters), or a 2-block, 64 px one for a smoke test."""
    if quick:
        return dict(image=64, patch=16, width=64, depth=2, heads=4, mlp=128, classes=10)
    return dict(image=224, patch=16, width=768, depth=12, heads=12, mlp=3072, classes=1000)


def init_params(cfg: dict[str, int], key: jax.Array) -> dict[str, Any]:
    """Random weights in the ViT's shapes; the blocks' weights stacked along a leading axis."""
    w, m, d = cfg["width"], cfg["mlp"], cfg["depth"]
    patches = (cfg["image"] // cfg["patch"]) ** 2
    keys = iter(jax.random.split(key, 16))

    def normal(*shape: int) -> jax.Array:
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

    blocks = {
        "ln1_scale": jnp.ones((d, w)), "ln1_bias": jnp.zeros((d, w)),
        "qkv": normal(d, w, 3 * w), "qkv_bias": jnp.zeros((d, 3 * w)),
        "out": normal(d, w, w), "out_bias": jnp.zeros((d, w)),
        "ln2_scale": jnp.ones((d, w)), "ln2_bias": jnp.zeros((d, w)),
        "fc1": normal(d, w, m), "fc1_bias": jnp.zeros((d, m)),
        "fc2": normal(d, m, w), "fc2_bias": jnp.zeros((d, w)),
    }  # fmt: skip
    return {
        "embed": normal(cfg["patch"] ** 2 * 3, w), "embed_bias": jnp.zeros((w,)),
        "cls": normal(1, 1, w), "pos": normal(1, patches + 1, w),
        "blocks": blocks,
        "ln_scale": jnp.ones((w,)), "ln_bias": jnp.zeros((w,)),
        "head": normal(w, cfg["classes"]), "head_bias": jnp.zeros((cfg["classes"],)),
    }  # fmt: skip


def param_shapes(cfg: dict[str, int]) -> dict[str, Any]:
    return jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias


def dropout(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def block(p: dict, x: jax.Array, key: jax.Array, heads: int, rate: float) -> jax.Array:
    """The project's TransformerBlock: pre-norm attention and MLP, dropout on the attention
    weights, the MLP's hidden layer and both residual branches."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    b, n, w = x.shape
    h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    q, k, v = jnp.split(h @ p["qkv"] + p["qkv_bias"], 3, axis=-1)
    q, k, v = (t.reshape(b, n, heads, w // heads) for t in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(w // heads)
    weights = dropout(jax.nn.softmax(logits, axis=-1), k1, rate)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, w)
    x = x + dropout(attended @ p["out"] + p["out_bias"], k2, rate)
    h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    hidden = dropout(jax.nn.gelu(h @ p["fc1"] + p["fc1_bias"], approximate=False), k3, rate)
    return x + dropout(hidden @ p["fc2"] + p["fc2_bias"], k4, rate)


def make_loss(cfg: dict[str, int], policy: str, rate: float = 0.1, scan: bool = False) -> Callable:
    """Softmax cross-entropy of the ViT: (params, images, labels, key) -> loss. With `scan`, the
    blocks run in `jax.lax.scan` over the stacked weights (as JAX users write deep models)."""
    body = lambda p, x, key: block(p, x, key, cfg["heads"], rate)  # noqa: E731
    if policy != "none":
        body = jax.checkpoint(body, policy=POLICIES[policy])

    def loss_fn(params: dict, images: jax.Array, labels: jax.Array, key: jax.Array) -> jax.Array:
        b, s, pt = images.shape[0], cfg["image"] // cfg["patch"], cfg["patch"]
        patches = images.reshape(b, s, pt, s, pt, 3).transpose(0, 1, 3, 2, 4, 5)
        x = patches.reshape(b, s * s, pt * pt * 3) @ params["embed"] + params["embed_bias"]
        cls = jnp.broadcast_to(params["cls"], (b, 1, x.shape[-1]))
        keys = jax.random.split(key, cfg["depth"] + 1)
        x = dropout(jnp.concatenate([cls, x], axis=1) + params["pos"], keys[0], rate)
        if scan:
            x, _ = jax.lax.scan(
                lambda h, p: (body(p[0], h, p[1]), None), x, (params["blocks"], keys[1:])
            )
        for i in range(0 if scan else cfg["depth"]):  # unrolled, as the TensorFlow model is
            layer = jax.tree.map(lambda t, i=i: t[i], params["blocks"])
            x = body(layer, x, keys[i + 1])
        x = layer_norm(x[:, 0], params["ln_scale"], params["ln_bias"])
        logits = x @ params["head"] + params["head_bias"]
        labels = jax.nn.one_hot(labels, cfg["classes"])
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

    return loss_fn


def compile_step(
    cfg: dict[str, int], policy: str, batch: int, device: Any, scan: bool = False
) -> dict[str, Any]:
    """The step compiled for `device` (a CPU or a compile-only TPU device): its memory stats."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    params = param_shapes(cfg)

    def spec(shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    tree = jax.tree.map(lambda t: spec(t.shape, t.dtype), params)
    args = (
        tree,
        spec((batch, cfg["image"], cfg["image"], 3), jnp.float32),
        spec((batch,), jnp.int32),
        jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding),
    )
    adamw_state = 2 * sum(t.size * t.dtype.itemsize for t in jax.tree.leaves(params))
    started = time.perf_counter()
    compiled = jax.jit(jax.grad(make_loss(cfg, policy, scan=scan))).lower(*args).compile()
    stats = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )
    if device.platform == "tpu":  # its code sits in HBM beside the buffers
        total += stats.generated_code_size_in_bytes
    return {
        "policy": policy,
        "step": total + adamw_state,
        "temp": stats.temp_size_in_bytes,
        "flops": (cost or {}).get("flops"),
        "seconds": time.perf_counter() - started,
    }


def median_step_seconds(
    cfg: dict[str, int], policy: str, batch: int, steps: int, scan: bool = False
) -> float:
    """The median time of `steps` SGD steps on the CPU, after one that compiles and warms up."""
    loss = make_loss(cfg, policy, scan=scan)

    def sgd(params: dict, images: jax.Array, labels: jax.Array, key: jax.Array) -> dict:
        grads = jax.grad(loss)(params, images, labels, key)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    step = jax.jit(sgd, donate_argnums=0)
    keys = jax.random.split(jax.random.key(1), steps + 3)
    params = init_params(cfg, keys[0])
    images = jax.random.normal(keys[1], (batch, cfg["image"], cfg["image"], 3))
    labels = jax.random.randint(keys[2], (batch,), 0, cfg["classes"])
    params = jax.block_until_ready(step(params, images, labels, keys[3]))
    times = []
    for key in keys[3:]:
        started = time.perf_counter()
        params = jax.block_until_ready(step(params, images, labels, key))
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def format_table(cfg: dict[str, int], batch: int, columns: dict[str, list[dict]]) -> str:
    mib = 2**20
    header = "| policy | " + " | ".join(
        f"{name} step MiB | {name} temp MiB | {name} FLOPs / none" for name in columns
    )
    rows = [header + " |", "|---" * (1 + 3 * len(columns)) + "|"]
    timed = "seconds_per_step" in next(iter(columns.values()))[0]
    if timed:
        rows[0] += " CPU step s | time / none |"
        rows[1] += "---|---|"
    for i, policy in enumerate(r["policy"] for r in next(iter(columns.values()))):
        cells = [f"`{policy}`" if policy != "none" else "no remat"]
        for results in columns.values():
            r, base = results[i], results[0]
            ratio = f"{r['flops'] / base['flops']:.2f}" if r["flops"] and base["flops"] else "-"
            cells += [f"{r['step'] / mib:.1f}", f"{r['temp'] / mib:.1f}", ratio]
        if timed:
            r, base = columns["XLA:CPU"][i], columns["XLA:CPU"][0]
            seconds = r["seconds_per_step"]
            cells += [f"{seconds:.2f}", f"{seconds / base['seconds_per_step']:.2f}"]
        rows.append("| " + " | ".join(cells) + " |")
    params = sum(x.size for x in jax.tree.leaves(param_shapes(cfg)))
    title = (
        f"ViT (width {cfg['width']}, {cfg['depth']} blocks, {cfg['image']} px, "
        f"{params / 1e6:.1f} M parameters), batch {batch}, dropout 0.1, AdamW state, float32"
    )
    return "\n".join([title, "", *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="examples per step (default 64)")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help=f"from {tuple(POLICIES)}, comma-separated"
    )
    parser.add_argument(
        "--target", default="v5e", help="also compile for this TPU chip (default v5e; '' for none)"
    )
    parser.add_argument(
        "--steps", type=int, default=0, help="also time this many SGD steps on the CPU (median)"
    )
    parser.add_argument(
        "--scan", action="store_true", help="blocks in jax.lax.scan (default: unrolled)"
    )
    parser.add_argument("--quick", action="store_true", help="a 2-block, 64 px ViT")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args()
    policies = args.policies.split(",")
    if unknown := [p for p in policies if p not in POLICIES]:
        parser.error(f"unknown policies {unknown}; choose from {tuple(POLICIES)}")
    if "none" not in policies:
        policies.insert(0, "none")
    cfg = vit_config(args.quick)
    started = time.time()
    devices = {"XLA:CPU": jax.devices("cpu")[0]}
    if args.target:
        chip = tpu.tpu_chip(args.target)
        devices[f"TPU {chip.name}"] = jax_internals.tpu_device(chip.topology, chip.chip_config)
    columns: dict[str, list[dict]] = {}
    for name, device in devices.items():
        columns[name] = []
        for policy in policies:
            result = compile_step(cfg, policy, args.batch, device, args.scan)
            if args.steps and name == "XLA:CPU":
                result["seconds_per_step"] = median_step_seconds(
                    cfg, policy, args.batch, args.steps, args.scan
                )
            print(f"{name} {policy}: step {result['step'] / 2**20:.1f} MiB, temp "
                  f"{result['temp'] / 2**20:.1f} MiB, compiled in {result['seconds']:.0f} s",
                  flush=True)  # fmt: skip
            columns[name].append(result)
    command = "python benchmarks/jax_vit_memory.py " + " ".join(sys.argv[1:])
    layout = "in `jax.lax.scan`" if args.scan else "unrolled"
    versions = f"jax {jax.__version__}, Python {platform.python_version()}"
    report = "\n".join([
        "# JAX's checkpointing on the ViT-B/16 step: the compilers' plans",
        "",
        f"Command: `{command.strip()}`",
        f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}, took "
        f"{(time.time() - started) / 60:.1f} min; {os.cpu_count()} CPUs, {versions}",
        "Each step is compiled by jax's CPU backend and by libtpu's compile-only client; with "
        "`--steps`, the CPU's SGD step is also timed (median). `jax.checkpoint(block, "
        f"policy=...)` around each of the blocks, {layout}; dropout bits "
        f"from jax's default generator ({jax.config.jax_default_prng_impl}).",
        "",
        format_table(cfg, args.batch, columns),
        "",
    ])  # fmt: skip
    write_report(report, args.out)


if __name__ == "__main__":
    main()
