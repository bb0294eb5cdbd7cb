"""Scan over layers against unrolled blocks: compile time, memory and step time at several depths.

For each depth, one fresh process builds a ViT twice - blocks unrolled and blocks scanned
(`scan_layers=True`), same weights - with every block (every loop step) checkpointed by the same
remat policy, and measures for each layout:

- compile time: the first call of the `tf.function(jit_compile=True)` train step (trace, XLA
  compile and one step) minus the median steady step;
- XLA's plan for the step (`framework.memory.compiled_bytes`): temporaries, and everything
  including weights;
- the allocator's peak of one steady step beyond what was live before it;
- the step time, the two layouts timed in alternation, and the scanned/unrolled ratio.

With `--target=v5e` (any chip `framework.memory.tpu.tpu_chip` knows, or a GPU card
`framework.memory.gpu.gpu_card` knows) it compiles both steps for that device with its compiler
instead and reports its plan only: nothing runs, so there is no peak or step time, and compile
time is that compiler's on this host. `--compile_only` does the same with XLA:CPU.

The default step is the program the trainer compiles (`train_step.compiled_gradients`): the
forward and backward pass with every gradient an output; the trainer sums, clips and applies
them after it, outside the program. `--step=adamw` and `--step=sgd` measure a step a user may
write instead, with the update inside the one program: `adamw` clips by the global norm, then
applies AdamW (every gradient exists before the first update in both layouts); with `sgd` each
unrolled layer is updated as soon as its gradients exist, while the scanned stack's gradient is
one `[depth, ...]` buffer per block variable that exists whole before its update (as in JAX).

    python benchmarks/scan_layers.py --out=benchmarks/results/scan_layers.md
    python benchmarks/scan_layers.py --target=v5e --out=benchmarks/results/scan_layers_tpu_v5e.md
    python benchmarks/scan_layers.py --compile_only --step=sgd --batches=2,4,8
    python benchmarks/scan_layers.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import keras
import tensorflow as tf
from reporting import REPO_DIR, child_json, machine, write_report
from step_models import median_step_times

from framework import memory, models, remat
from framework.memory import targets
from framework.models import transformer
from framework.trainer import train_step as trainer_step

DEPTHS = (12, 24, 48)


def build(depth: int, scan: bool, quick: bool):
    size, dim, heads, mlp = (32, 32, 2, 64) if quick else (224, 384, 6, 1536)
    return models.vit_small(
        image_size=size,
        patch_size=16,
        dim=dim,
        num_heads=heads,
        mlp_dim=mlp,
        depth=depth,
        num_classes=10 if quick else 1000,
        dropout=0.1,
        scan_layers=scan,
    )


STEPS = {
    "trainer": "the trainer's program: forward and backward, the gradients its outputs",
    "adamw": "forward, backward, global-norm clipping and AdamW",
    "sgd": "forward, backward and SGD",
}


def train_step(model, kind: str = "trainer", learning_rate: float = 1e-4):
    """The step of `kind` (see `STEPS`) as one XLA program `fn(x, y)` whose first output is the
    loss (sum): `trainer` is what the trainer compiles (`train_step.compiled_gradients`); `sgd`
    updates each variable as soon as its gradient exists; `adamw` clips the gradients by their
    global norm, then applies AdamW, which needs every gradient before the first update."""
    if kind == "trainer":
        # What `train_step.compiled_gradients` compiles, taking (x, y) as two arguments.
        return tf.function(lambda x, y: trainer_step.gradients(model, (x, y)), jit_compile=True)
    adamw = None
    if kind == "adamw":
        adamw = keras.optimizers.AdamW(learning_rate)
        adamw.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        if adamw is not None:
            grads, _ = tf.clip_by_global_norm(grads, 1.0)
            adamw.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        for variable, grad in zip(model.trainable_variables, grads):
            variable.assign_sub(learning_rate * grad)
        return loss

    return step


def _loss(step):
    """`step` as a function of (x, y) that returns its first output alone (for timing)."""
    return lambda x, y: tf.nest.flatten(step(x, y))[0]


def measure(
    depth: int,
    batch: int,
    policy: str,
    steps: int,
    quick: bool,
    step_kind: str,
    target: str | None = None,
    compile_only: bool = False,
) -> dict:
    """One depth and batch: both layouts' plans (and, unless `target` or `compile_only`, their
    compile and step times and allocator peaks)."""
    size = 32 if quick else 224
    result = {"depth": depth, "batch": batch, "policy": policy}
    if target or compile_only:
        x = tf.TensorSpec((batch, size, size, 3), tf.float32)
        y = tf.TensorSpec((batch,), tf.int32)
        for name in ("unrolled", "scanned"):
            model = build(depth, scan=name == "scanned", quick=quick)
            remat.set_grad_checkpointing(model, policy=policy)
            start = time.perf_counter()
            plan = memory.compiled_bytes(train_step(model, step_kind), x, y, target=target)
            result[f"{name}_compile_s"] = time.perf_counter() - start
            result[f"{name}_temp"], result[f"{name}_total"] = plan.temp_bytes, plan.total_bytes
            result[f"{name}_code"] = plan.generated_code_bytes
            result["compiler"] = plan.compiler
        return result
    tf.function(lambda: tf.constant(1.0) + 1.0, jit_compile=True)()  # pay XLA's set-up once
    x = tf.random.stateless_normal((batch, size, size, 3), seed=(1, 2))
    y = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=10, dtype=tf.int32)
    unrolled = build(depth, scan=False, quick=quick)
    scanned = build(depth, scan=True, quick=quick)
    transformer.copy_weights(unrolled, scanned)
    step_fns = {}
    for name, model in (("unrolled", unrolled), ("scanned", scanned)):
        remat.set_grad_checkpointing(model, policy=policy)
        step = train_step(model, step_kind)
        start = time.perf_counter()
        _loss(step)(x, y).numpy()
        result[f"{name}_first_s"] = time.perf_counter() - start
        plan = memory.compiled_bytes(step, x, y)
        result[f"{name}_temp"], result[f"{name}_total"] = plan.temp_bytes, plan.total_bytes
        result[f"{name}_peak"] = memory.peak_bytes(_loss(step), x, y).step_bytes
        result["compiler"] = plan.compiler
        step_fns[name] = _loss(step)
    times = median_step_times([step_fns["unrolled"], step_fns["scanned"]], x, y, steps)
    result["unrolled_step_s"], result["scanned_step_s"] = times
    for name in ("unrolled", "scanned"):
        result[f"{name}_compile_s"] = result[f"{name}_first_s"] - result[f"{name}_step_s"]
    return result


def run_child(depth: int, batch: int, policy: str, args: argparse.Namespace) -> dict:
    """Runs `measure` in a fresh Python process."""
    flags = [f"--child={depth}", f"--batches={batch}", f"--policy={policy}"]
    flags += [f"--steps={args.steps}", f"--step={args.step}"]
    flags += [f"--target={args.target}"] if args.target else []
    flags += [name for name in ("--quick", "--compile_only") if getattr(args, name[2:])]
    return child_json(__file__, flags, {"depth": depth, "batch": batch, "policy": policy})


def format_report(
    results: list[dict],
    command: str,
    started: datetime.datetime,
    quick: bool,
    step_kind: str,
    plan_only: bool,
) -> str:
    mib = 2.0**20
    model = "tiny ViT (width 32)" if quick else "ViT-S/16 (width 384, 6 heads, MLP 1536)"
    compiler = next((r["compiler"] for r in results if "compiler" in r), "XLA")
    if plan_only:
        how = (
            f"Plans for {compiler}, compiled on this host (nothing runs): compile s is that "
            "compiler's time here; temps and total (parameters, outputs and temps) from its "
            "buffer assignment."
        )
        header = (
            "| depth | batch | policy | compile s unrolled | compile s scanned | temp MiB unrolled "
            "| temp MiB scanned | temp scanned / unrolled | total MiB unrolled "
            "| total MiB scanned | code MiB unrolled | code MiB scanned |"
        )
    else:
        how = (
            f"Compile: first call minus a steady step. Temps and total from {compiler}'s plan. "
            "Peak: allocator peak of a steady step beyond what was live before it. Step times "
            "in alternation."
        )
        header = (
            "| depth | batch | policy | compile s unrolled | compile s scanned "
            "| XLA temp MiB unrolled "
            "| XLA temp MiB scanned | temp scanned / unrolled | peak MiB unrolled "
            "| peak MiB scanned | step s unrolled | step time scanned / unrolled |"
        )
    lines = [
        f"Command: `{command}`",
        f"Date: {started:%Y-%m-%d %H:%M}, load average {os.getloadavg()[0]:.1f}",
        f"Machine: {machine()}",
        f"Model: {model}, dropout 0.1. Step `{step_kind}`: "
        f"{STEPS[step_kind]}, under `tf.function(jit_compile=True)`; remat policy as listed on "
        f"every block / loop step; each depth in a fresh process. {how}",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['depth']} | {r['batch']} | `{r['policy']}` | {r['error']} |")
            continue
        cells = [
            str(r["depth"]),
            str(r["batch"]),
            f"`{r['policy']}`",
            f"{r['unrolled_compile_s']:.1f}",
            f"{r['scanned_compile_s']:.1f}",
            f"{r['unrolled_temp'] / mib:.1f}",
            f"{r['scanned_temp'] / mib:.1f}",
            # A tiny step's temporaries can all sit in a TPU's on-chip memory: none in HBM.
            f"{r['scanned_temp'] / r['unrolled_temp']:.2f}" if r["unrolled_temp"] else "-",
        ]
        if plan_only:
            # XLA:CPU reports no code size: "-".
            cells += [
                f"{r[f'{name}_{what}'] / mib:.1f}" if r[f"{name}_{what}"] else "-"
                for what in ("total", "code")
                for name in ("unrolled", "scanned")
            ]
        else:
            cells += [
                f"{r['unrolled_peak'] / mib:.1f}",
                f"{r['scanned_peak'] / mib:.1f}",
                f"{r['unrolled_step_s']:.2f}",
                f"{r['scanned_step_s'] / r['unrolled_step_s']:.2f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--depths", help=f"comma-separated (default {','.join(map(str, DEPTHS))}; 2,4 --quick)"
    )
    parser.add_argument("--policies", default="nothing_saveable")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument(
        "--step",
        choices=tuple(STEPS),
        default="trainer",
        help="; ".join(f"{name}: {what}" for name, what in STEPS.items()),
    )
    parser.add_argument("--batches", help="comma-separated batch sizes (default 8; 2 --quick)")
    parser.add_argument(
        "--target",
        help="a TPU chip (v5e, v4, ...) or GPU card (a100-40gb, ...): report its compiler's "
        "plan; nothing runs",
    )
    parser.add_argument(
        "--compile_only", action="store_true", help="report XLA:CPU's plan only; nothing runs"
    )
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    parser.add_argument("--quick", action="store_true", help="tiny model, depths 2 and 4")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    default_batch = "2" if args.quick else "8"
    batches = [int(b) for b in (args.batches or default_batch).split(",")]
    if args.child:
        result = measure(
            args.child,
            batches[0],
            args.policy,
            args.steps,
            args.quick,
            args.step,
            args.target,
            args.compile_only,
        )
        print(json.dumps(result))
        return
    if args.target:
        try:
            targets.target_device(args.target)  # an unknown device fails here, not in a child
        except ValueError as error:
            parser.error(str(error))
    default = (2, 4) if args.quick else DEPTHS
    depths = [int(d) for d in args.depths.split(",")] if args.depths else list(default)
    started = datetime.datetime.now()
    results = []
    for policy in args.policies.split(","):
        remat.get_policy(policy)  # an unknown name fails here, not in a child
        for depth in depths:
            for batch in batches:
                results.append(run_child(depth, batch, policy, args))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    command = "python " + " ".join([os.path.relpath(__file__, REPO_DIR), *sys.argv[1:]])
    plan_only = bool(args.target or args.compile_only)
    report = format_report(results, command, started, args.quick, args.step, plan_only)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
