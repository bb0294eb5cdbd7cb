"""Memory and time of one train step under each rematerialization setting, side by side.

For a stack of transformer blocks, ViT-B/16 and a decoder LM, every setting - no remat, the
framework's policies, `tf.recompute_grad` per block and Keras 3 `RematScope` - trains with the same
`tf.function(jit_compile=True)` step (forward, backward, SGD apply) and is measured for:

- the allocator's peak of one steady step beyond what was live before it
  (`framework.memory.peak_bytes(...).step_bytes`, CPU BFC allocator);
- XLA's plan for that step (`framework.memory.compiled_bytes`: temps and total);
- the median step time over `--steps` steps, and its ratio to a no-remat copy of the model compiled
  in the same process and timed in alternation with it (step for step), so that a shared machine's
  drift weighs on both sides of the ratio alike;
- the gradients' relative error against the same model without remat, on the same batch with the
  same dropout seeds (dropout is active).

Each (model, setting) runs in a fresh subprocess: allocator statistics and peaks are per process,
and one setting's compiled programs or leaked tensors must not weigh on the next. A setting that
fails (Keras' `RematScope("full")` under `tf.function`) is reported as "crash: <reason>".

    python benchmarks/remat_policies.py --out=benchmarks/results/remat_policies.md
    python benchmarks/remat_policies.py --quick --models=stack --settings=none,nothing_saveable
    python benchmarks/remat_policies.py --target=v5e --compile_only  # XLA:CPU beside TPU v5e
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from framework import memory, models, remat
from framework.core import tf_internals
from framework.models.language import DecoderLM
from framework.runtime import flops

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL_POLICIES = ("nothing_saveable", "random_masks_saveable")
SELECTIVE_POLICIES = (
    "dots_saveable",
    "dots_saveable+random_masks_saveable",
    "dots_with_no_batch_dims_saveable",
)
POLICIES = FULL_POLICIES + SELECTIVE_POLICIES
SETTINGS = ("none", *POLICIES, "recompute_grad", "rematscope_full", "rematscope_activations")
SETTING_LABELS = {
    "none": "no remat",
    "recompute_grad": "`tf.recompute_grad` per block",
    "rematscope_full": '`keras.RematScope("full")`',
    "rematscope_activations": '`keras.RematScope("activations")`',
    **{p: f"`{p}`" for p in POLICIES},
}
MODELS = ("stack", "vit_b16", "decoder_lm")
# Issue 3, "Measured": targets on ViT-B/16 at batch 8 as (memory ratio, time ratio) upper bounds.
FULL_TARGET = (0.30, 1.35)
SELECTIVE_TARGET = (0.60, 1.10)


class BlockStack(keras.Model):
    """`depth` TransformerBlocks in a row, built eagerly.

    Subclassed, like the ViT, rather than `keras.Sequential`: building a Sequential or functional
    model runs its layers symbolically, which `RematScope("full")` already breaks.
    """

    def __init__(self, depth: int, num_heads: int, mlp_dim: int, shape: tuple[int, int], **kw):
        super().__init__(**kw)
        self.blocks = [
            models.TransformerBlock(num_heads, mlp_dim, dropout=0.1, name=f"block_{i}")
            for i in range(depth)
        ]
        for block in self.blocks:
            block.build((None, *shape))
        self.built = True

    def call(self, x: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        for block in self.blocks:
            x = block(x, training=training)
        return x


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark: how to build it, its batch and its loss."""

    description: str
    build: Callable[[], Any]
    batch: Callable[[], tuple[Any, Any]]
    loss: Callable[[Any, Any], Any]


def model_spec(name: str, quick: bool) -> ModelSpec:
    """The benchmark's two models, full size or `quick` (tiny, for the smoke test)."""
    if name == "stack":
        depth, batch, seq, width, heads, mlp = (
            (2, 2, 16, 32, 2, 64) if quick else (12, 8, 197, 384, 6, 1536)
        )

        return ModelSpec(
            description=(
                f"{depth} x TransformerBlock, batch {batch}, sequence {seq}, width {width}, "
                f"{heads} heads, MLP {mlp}, dropout 0.1; loss: mean squared error"
            ),
            build=lambda: BlockStack(depth, heads, mlp, (seq, width), name="stack"),
            batch=lambda: (
                tf.random.stateless_normal((batch, seq, width), seed=(1, 2)),
                tf.random.stateless_normal((batch, seq, width), seed=(3, 4)),
            ),
            loss=lambda out, y: tf.reduce_mean(tf.square(out - y)),
        )
    if name == "vit_b16":
        batch, size, classes = (2, 32, 10) if quick else (8, 224, 1000)
        small = {"dim": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64, "patch_size": 8}
        overrides = {"image_size": size, "num_classes": classes, "dropout": 0.1}
        if quick:
            overrides |= small
        return ModelSpec(
            description=(
                f"ViT-B/16{' (quick: width 32, 2 blocks)' if quick else ''}, batch {batch}, "
                f"{size} px, {classes} classes, dropout 0.1; loss: softmax cross-entropy"
            ),
            build=lambda: models.vit_b16(**overrides),
            batch=lambda: (
                tf.random.stateless_normal((batch, size, size, 3), seed=(1, 2)),
                tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=classes, dtype=tf.int32),
            ),
            loss=lambda logits, y: tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            ),
        )
    if name == "decoder_lm":
        batch, length = (2, 16) if quick else (4, 512)
        config = (
            {"vocab_size": 256, "dim": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}
            if quick
            else {"vocab_size": 32_000, "dim": 768, "depth": 12, "num_heads": 12, "mlp_dim": 3072}
        )

        def text_batch() -> tuple[dict, tf.Tensor]:
            tokens = tf.random.stateless_uniform(
                (batch, length + 1), seed=(1, 2), maxval=config["vocab_size"], dtype=tf.int32
            )
            positions = tf.broadcast_to(tf.range(length), (batch, length))
            inputs = {"tokens": tokens[:, :-1], "positions": positions}
            return inputs | {"segment_ids": tf.ones((batch, length), tf.int32)}, tokens[:, 1:]

        return ModelSpec(
            description=(
                f"decoder LM, width {config['dim']}, {config['depth']} blocks, "
                f"{config['vocab_size']} tokens, batch {batch} x {length}, dropout 0.1; "
                "loss: next-token softmax cross-entropy"
            ),
            build=lambda: DecoderLM(max_length=length, dropout=0.1, **config),
            batch=text_batch,
            loss=lambda logits, y: tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            ),
        )
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def _recompute_grad_blocks(model: Any) -> None:
    """Runs each TransformerBlock through `tf.recompute_grad`, the way a TF user wraps it.

    `tf.recompute_grad` rejects keyword arguments inside `tf.function`, so the block's other
    arguments (mask, `training`) are closed over and only the tensor goes through it.
    """
    for block in tf_internals.flatten_layers(model, recursive=True):
        if isinstance(block, models.TransformerBlock):

            def call(x, *args, original=block.call, **kwargs):
                return tf.recompute_grad(lambda h: original(h, *args, **kwargs))(x)

            object.__setattr__(block, "call", call)


def is_budget(setting: str) -> bool:
    """A memory-budget policy, `budget:F` (any fraction F from 0 to 1)."""
    return setting.startswith(remat.policies.BUDGET_PREFIX)


def label(setting: str) -> str:
    return SETTING_LABELS.get(setting) or f"`{setting}`"


def build_model(spec: ModelSpec, setting: str) -> Any:
    """Builds the model with `setting` applied; the same seed gives the same weights for all."""
    keras.utils.set_random_seed(0)
    if setting.startswith("rematscope_"):
        # RematScope only affects layers constructed inside it.
        with keras.RematScope(mode=setting.removeprefix("rematscope_")):
            return spec.build()
    model = spec.build()
    if setting in POLICIES or is_budget(setting):
        remat.set_grad_checkpointing(model, policy=setting)
    elif setting == "recompute_grad":
        _recompute_grad_blocks(model)
    elif setting != "none":
        raise ValueError(f"unknown setting {setting!r}; choose from {SETTINGS}")
    return model


def _one_line(error: BaseException) -> str:
    """The innermost reason of an error, without the wrappers Keras and tf.function add."""
    noise = ("Exception encountered", "Arguments received", "in user code", "File ", "•")
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    reasons = [line for line in lines if line and not line.startswith(noise)]
    return f"{type(error).__name__}: {reasons[-1] if reasons else ''}"[:160].replace("|", "/")


def gradient_error(spec: ModelSpec, model: Any, x: Any, y: Any) -> tuple[float, str]:
    """Largest relative error over the variables of `model`'s gradients against no remat.

    The reference is the same model built without remat, given `model`'s variables (the
    dropout seed generators' states included), so both draw the same dropout masks on the
    same batch. Compiled with XLA like the train step; if that crashes, eagerly.
    """
    reference = build_model(spec, "none")
    state = [v.numpy() for v in model.variables]

    def grads(m: Any) -> list:
        with tf.GradientTape() as tape:
            loss = spec.loss(m(x, training=True), y)
        return tape.gradient(loss, m.trainable_variables)

    for mode in ("xla", "eager"):
        for m in (model, reference):
            for variable, value in zip(m.variables, state, strict=True):
                variable.assign(value)
        run = tf.function(grads, jit_compile=True) if mode == "xla" else grads
        try:
            got = run(model)
        except Exception:
            if mode == "eager":
                raise
            continue
        want = run(reference)
        # Dense: an embedding's gradient is IndexedSlices, which do not subtract.
        got, want = ([tf.convert_to_tensor(g) for g in grads] for grads in (got, want))
        errors = [
            float(tf.norm(g - w) / (tf.norm(w) + 1e-30)) for g, w in zip(got, want, strict=True)
        ]
        return max(errors), mode
    raise AssertionError("unreachable")


def train_step(spec: ModelSpec, model: Any) -> Callable:
    """The benchmarked step for `model`: forward, backward and an SGD update, compiled by XLA."""
    optimizer = keras.optimizers.SGD(learning_rate=1e-4)
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = spec.loss(model(x, training=True), y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return step


def median_step_times(steps_to_time: list[Callable], x: Any, y: Any, repeats: int) -> list[float]:
    """Median seconds per step of each function, timed in turns (one step each, `repeats` times)."""
    for step in steps_to_time:
        step(x, y).numpy()
    times: list[list[float]] = [[] for _ in steps_to_time]
    for _ in range(repeats):
        for step, spent in zip(steps_to_time, times, strict=True):
            start = time.perf_counter()
            step(x, y).numpy()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def measure(
    model_name: str,
    setting: str,
    steps: int,
    quick: bool,
    target: str | None = None,
    compile_only: bool = False,
) -> dict[str, Any]:
    """One (model, setting) in this process: memory, compiled bytes, step time, gradient error;
    with `target`, also the TPU compiler's temp bytes for that chip; with `compile_only`, the
    compiled figures alone (nothing runs)."""
    spec = model_spec(model_name, quick)
    x, y = spec.batch()
    result: dict[str, Any] = {"model": model_name, "setting": setting}
    try:
        model = build_model(spec, setting)
    except Exception as error:
        result["error"] = result["grad_crash"] = _one_line(error)
        return result
    step = train_step(spec, model)
    if target:
        try:
            tpu_plan = memory.compiled_bytes(step, x, y, target=target)
            result["tpu_temp_bytes"] = tpu_plan.temp_bytes
            result["tpu_compiler"] = tpu_plan.compiler
        except Exception as error:
            result["tpu_error"] = _one_line(error)
    if compile_only:
        try:
            plan, result["matmul_flops"] = flops.compiled_plan_and_flops(step, x, y)
            result["temp_bytes"], result["total_bytes"] = plan.temp_bytes, plan.total_bytes
        except Exception as error:
            result["error"] = _one_line(error)
        return result
    try:
        step(x, y).numpy()
        result["step_bytes"] = memory.peak_bytes(step, x, y).step_bytes
        plan = memory.compiled_bytes(step, x, y)
        result["temp_bytes"], result["total_bytes"] = plan.temp_bytes, plan.total_bytes
        if setting == "none":
            result["step_s"] = median_step_times([step], x, y, steps)[0]
        else:
            baseline = train_step(spec, build_model(spec, "none"))
            times = median_step_times([step, baseline], x, y, steps)
            result["step_s"], result["time_ratio"] = times[0], times[0] / times[1]
    except Exception as error:
        result["error"] = _one_line(error)
    if setting != "none":
        try:
            result["grad_error"], result["grad_mode"] = gradient_error(spec, model, x, y)
        except Exception as error:
            result["grad_crash"] = _one_line(error)
    return result


def child_json(script: str, args: list[str], identity: dict[str, Any]) -> dict[str, Any]:
    """Runs `script` with `args` in a fresh Python process (CPU BFC allocator on) and returns the
    JSON object of its last output line, or `identity` with the error when the process fails."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_DIR, env.get("PYTHONPATH")]))
    command = [sys.executable, os.path.abspath(script), *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return {**identity, "error": f"process died: {tail}"[:140]}


def run_child(
    model_name: str, setting: str, steps: int, quick: bool, target: str | None, compile_only: bool
) -> dict[str, Any]:
    """Runs `measure` in a fresh Python process."""
    args = ["--child", f"{model_name}:{setting}", f"--steps={steps}"]
    args += ["--quick"] * quick + [f"--target={target}"] * bool(target)
    args += ["--compile_only"] * compile_only
    return child_json(__file__, args, {"model": model_name, "setting": setting})


def write_report(report: str, out: str | None) -> None:
    """Prints the report and, with `out`, writes it to that file."""
    print(report)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(report)


def mib(n: float) -> str:
    """Bytes as MiB with one decimal, as the reports print them."""
    return f"{n / 2**20:.1f}"


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "-"


def format_compiled_table(results: list[dict[str, Any]]) -> str:
    """XLA:CPU's and (when compiled) the TPU compiler's temp bytes, each as a ratio to no remat,
    and the matrix-product FLOPs of XLA:CPU's optimised step as a ratio to no remat's (the
    recomputation a setting keeps; elementwise work, such as a mask's redraw, not counted)."""
    with_tpu = any("tpu_temp_bytes" in r or "tpu_error" in r for r in results)
    compiler = next((r["tpu_compiler"] for r in results if "tpu_compiler" in r), "TPU")
    head = ["model", "setting", "XLA:CPU temp MiB", "ratio"]
    head += [f"{compiler} temp MiB", "ratio"] if with_tpu else []
    head += ["matmul FLOPs / no remat"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {r["model"]: r for r in results if r["setting"] == "none"}
    for r in results:
        b = base.get(r["model"], {})
        cells = [r["model"], label(r["setting"])]
        cells += (
            [mib(r["temp_bytes"]), _ratio(r["temp_bytes"], b.get("temp_bytes"))]
            if "temp_bytes" in r
            else [f"crash: {r.get('error')}", ""]
        )
        if with_tpu:
            cells += (
                [mib(r["tpu_temp_bytes"]), _ratio(r["tpu_temp_bytes"], b.get("tpu_temp_bytes"))]
                if "tpu_temp_bytes" in r
                else [f"crash: {r.get('tpu_error', r.get('error'))}", ""]
            )
        counted = r.get("matmul_flops") and b.get("matmul_flops")
        cells.append(f"{r['matmul_flops'] / b['matmul_flops']:.3f}" if counted else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def format_table(results: list[dict[str, Any]]) -> str:
    """The markdown table: one row per setting, ratios against the model's "none" row."""
    header = (
        "| model | setting | peak MiB | memory ratio | XLA temp MiB | XLA total MiB | step s "
        "| time ratio | grad rel. error |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = [header]
    base = {r["model"]: r for r in results if r["setting"] == "none" and "error" not in r}
    for r in results:
        b = base.get(r["model"], {})
        if "grad_error" in r:
            grad = f"{r['grad_error']:.1e}" + (" (eager)" if r["grad_mode"] == "eager" else "")
        elif "grad_crash" in r:
            grad = f"crash: {r['grad_crash']}"
        else:
            grad = "reference" if r["setting"] == "none" else "-"
        name = label(r["setting"])
        if "error" in r:
            rows.append(f"| {r['model']} | {name} | crash: {r['error']} | | | | | | {grad} |")
            continue
        cells = [
            r["model"],
            name,
            mib(r["step_bytes"]),
            _ratio(r["step_bytes"], b.get("step_bytes")),
            mib(r["temp_bytes"]),
            mib(r["total_bytes"]),
            f"{r['step_s']:.3f}",
            f"{r.get('time_ratio', 1.0):.2f}",
            grad,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ratios(results: list[dict[str, Any]], setting: str) -> tuple[float, float] | None:
    rows = {r["setting"]: r for r in results if r["model"] == "vit_b16" and "error" not in r}
    if "none" not in rows or setting not in rows:
        return None
    r, b = rows[setting], rows["none"]
    return r["step_bytes"] / b["step_bytes"], r["time_ratio"]


def format_targets(results: list[dict[str, Any]]) -> str:
    """Issue 3's ViT-B/16 targets against the measured ratios (3 decimals: 0.603 misses 0.60)."""
    lines = []
    checks = [(f"full remat (`{p}`)", p, FULL_TARGET) for p in FULL_POLICIES]
    checks += [(f"selective (`{p}`)", p, SELECTIVE_TARGET) for p in SELECTIVE_POLICIES]
    for label, setting, targets in checks:
        got = _ratios(results, setting)
        if got is None:
            continue
        parts = [
            f"{what} {value:.3f} (target <= {target:.2f}: {'met' if value <= target else 'missed'})"
            for what, value, target in zip(("memory", "time"), got, targets)
        ]
        lines.append(f"- {label}: " + ", ".join(parts))
    return "\n".join(["ViT-B/16 targets (issue 3):", *lines]) if lines else ""


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Memory against time, as ratios to no remat, per model: the named policies as labelled
    points, the `budget:F` settings as one curve (the trade-off the budget policy offers)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    figure, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results if r["model"] == model and "error" not in r]
        base = next((r for r in rows if r["setting"] == "none"), None)
        if base is None:
            continue

        def point(r, base=base):
            return r["temp_bytes"] / base["temp_bytes"], r.get("time_ratio", 1.0)

        budgets = sorted((r for r in rows if is_budget(r["setting"])), key=lambda r: point(r)[0])
        if budgets:
            xs, ys = zip(*(point(r) for r in budgets))
            ax.plot(xs, ys, "o-", color="tab:blue", label="budget:F")
            for r, x, y in zip(budgets, xs, ys):
                ax.annotate(
                    r["setting"][7:],
                    (x, y),
                    fontsize=7,
                    xytext=(3, -10),
                    textcoords="offset points",
                    color="tab:blue",
                )
        for r in rows:
            if is_budget(r["setting"]):
                continue
            x, y = point(r)
            ax.scatter(x, y, color="tab:red", zorder=3)
            ax.annotate(
                label(r["setting"]).strip("`"),
                (x, y),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.set_xlabel("memory: XLA temp bytes / no remat")
        ax.set_ylabel("step time / no remat")
        ax.set_title(f"{model}: remat policies and memory budgets")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report_header(script: str, started: datetime.datetime) -> list[str]:
    """The lines a report opens with: the command that ran `script`, when it started and how
    long it took, and the machine."""
    command = "python " + " ".join([os.path.relpath(script, REPO_DIR), *sys.argv[1:]])
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    return [
        f"Command: `{command}`",
        f"Date: {started:%Y-%m-%d %H:%M}, took {minutes:.1f} min",
        f"Machine: {machine()}",
    ]


def machine() -> str:
    """nproc, CPU model, Python, TensorFlow and Keras versions: what the numbers depend on."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    )


def format_report(
    results: list[dict[str, Any]],
    model_names: list[str],
    steps: int,
    quick: bool,
    started: datetime.datetime,
    loads: list[float],
    compile_only: bool = False,
) -> str:
    """The whole report: how it was run and on what, the table, and the targets."""
    header = report_header(__file__, started)
    tpu_table = []
    if compile_only or any("tpu_temp_bytes" in r or "tpu_error" in r for r in results):
        tpu_table = [
            "",
            "Compiled, not run: XLA:CPU's buffer assignment and, with `--target`, the TPU "
            "compiler's (libtpu's compile-only client, `memory.compiled_bytes(..., target=)`) of "
            "the same step; TPU temp bytes count HBM only (what fits in on-chip VMEM is not in "
            "them).",
            "",
            format_compiled_table(results),
        ]
    if compile_only:
        models = [f"- {m}: {model_spec(m, quick).description}" for m in model_names]
        return "\n".join([*header, *models, *tpu_table]).rstrip() + "\n"
    lines = [
        *header,
        f"Load average (1 min) when each setting started: {min(loads):.1f} to {max(loads):.1f} "
        f"on {os.cpu_count()} CPUs (a shared machine: other processes competed for the cores).",
        "Step: `tf.function(jit_compile=True)`: forward, backward, SGD apply. Peak: allocator peak "
        "of one step after a warm-up step, minus what was live before it. Time: median of "
        f"{steps} steps; time ratio: against a no-remat copy timed in alternation in the same "
        "process. Each setting in a fresh process with TF_CPU_ALLOCATOR_USE_BFC=true.",
        "A peak above the XLA temp bytes, at a power of two MiB, is the BFC allocator handing "
        "a whole free chunk to the step's temp buffer, which it does when splitting the chunk "
        "would leave less than 128 MiB; XLA temp MiB is what the step itself asks for.",
        *[f"- {m}: {model_spec(m, quick).description}" for m in model_names],
        "",
        format_table(results),
        *tpu_table,
    ]
    if not quick:
        lines += ["", format_targets(results)]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"from {MODELS}")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"from {SETTINGS}, or budget:F"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5, quick 2)")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    parser.add_argument("--plot", help="also draw memory against time (PNG) to this file")
    parser.add_argument("--quick", action="store_true", help="tiny models, for a smoke test")
    parser.add_argument(
        "--target",
        help="also compile each step for this TPU chip (v5e, v4, ...; the tpu extra) and "
        "report its temp bytes beside XLA:CPU's",
    )
    parser.add_argument(
        "--compile_only",
        action="store_true",
        help="compiled figures only (XLA:CPU and --target): nothing runs, nothing is timed",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    steps = args.steps or (2 if args.quick else 5)
    if args.child:
        model_name, setting = args.child.split(":", 1)
        result = measure(model_name, setting, steps, args.quick, args.target, args.compile_only)
        print(json.dumps(result))
        return
    if args.target:
        from framework.memory import tpu

        try:
            tpu.tpu_chip(args.target)
        except ValueError as error:
            parser.error(str(error))

    model_names, settings = args.models.split(","), args.settings.split(",")
    for name, known in [(m, MODELS) for m in model_names] + [(s, SETTINGS) for s in settings]:
        if name not in known and not (known is SETTINGS and is_budget(name)):
            parser.error(f"unknown {name!r}; choose from {known}")
    for setting in filter(is_budget, settings):
        try:
            remat.get_policy(setting)
        except ValueError as error:
            parser.error(str(error))
    # "none" first: the ratios are against it.
    settings = ["none", *[s for s in settings if s != "none"]]
    started = datetime.datetime.now()
    results, loads = [], []
    for model_name in model_names:
        for setting in settings:
            loads.append(os.getloadavg()[0])
            results.append(
                run_child(model_name, setting, steps, args.quick, args.target, args.compile_only)
            )
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report = format_report(
        results, model_names, steps, args.quick, started, loads, args.compile_only
    )
    write_report(report, args.out)
    if args.plot and not args.compile_only:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
