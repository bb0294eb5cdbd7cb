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
import datetime
import json
import os
import sys
from typing import Any

from reporting import child_json, mib, report_header, write_report
from step_models import (
    FULL_POLICIES,
    MODELS,
    SELECTIVE_POLICIES,
    SETTINGS,
    build_model,
    gradient_error,
    is_budget,
    is_names,
    label,
    median_step_times,
    model_spec,
    one_line,
    train_step,
)

from framework import memory, remat
from framework.runtime import flops

# The targets on ViT-B/16 at batch 8, as (memory ratio, time ratio) upper bounds.
FULL_TARGET = (0.30, 1.35)
SELECTIVE_TARGET = (0.60, 1.10)


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
        result["error"] = result["grad_crash"] = one_line(error)
        return result
    step = train_step(spec, model)
    if target:
        try:
            tpu_plan = memory.compiled_bytes(step, x, y, target=target)
            result["tpu_temp_bytes"] = tpu_plan.temp_bytes
            result["tpu_compiler"] = tpu_plan.compiler
        except Exception as error:
            result["tpu_error"] = one_line(error)
    if compile_only:
        try:
            plan, result["matmul_flops"] = flops.compiled_plan_and_flops(step, x, y)
            result["temp_bytes"], result["total_bytes"] = plan.temp_bytes, plan.total_bytes
        except Exception as error:
            result["error"] = one_line(error)
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
        result["error"] = one_line(error)
    if setting != "none":
        try:
            result["grad_error"], result["grad_mode"] = gradient_error(spec, model, x, y)
        except Exception as error:
            result["grad_crash"] = one_line(error)
    return result


def run_child(
    model_name: str, setting: str, steps: int, quick: bool, target: str | None, compile_only: bool
) -> dict[str, Any]:
    """Runs `measure` in a fresh Python process."""
    args = ["--child", f"{model_name}:{setting}", f"--steps={steps}"]
    args += ["--quick"] * quick + [f"--target={target}"] * bool(target)
    args += ["--compile_only"] * compile_only
    return child_json(__file__, args, {"model": model_name, "setting": setting})


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
    """The ViT-B/16 targets against the measured ratios (3 decimals: 0.603 misses 0.60)."""
    lines = []
    checks = [(f"full remat (`{p}`)", p, FULL_TARGET) for p in FULL_POLICIES]
    checks += [(f"selective (`{p}`)", p, SELECTIVE_TARGET) for p in SELECTIVE_POLICIES]
    for kind, setting, targets in checks:
        got = _ratios(results, setting)
        if got is None:
            continue
        parts = [
            f"{what} {value:.3f} (target <= {target:.2f}: {'met' if value <= target else 'missed'})"
            for what, value, target in zip(("memory", "time"), got, targets)
        ]
        lines.append(f"- {kind}: " + ", ".join(parts))
    return "\n".join(["ViT-B/16 targets:", *lines]) if lines else ""


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
        "--settings",
        default=",".join(SETTINGS),
        help=f"from {SETTINGS}, or budget:F, or names:TAG/TAG (save_only_these_names)",
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
        if name not in known and not (known is SETTINGS and (is_budget(name) or is_names(name))):
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
