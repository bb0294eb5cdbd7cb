"""How a plan is shown: a table and a verdict on stdout, `plan.json` and `plan.png` on disk.

The picture puts peak memory against step time for every combination that ran, with the budget
and the usable budget as lines and the pick marked, so the trade-off is visible at a glance.
"""

from __future__ import annotations

import io
import json

from framework.planner.choose import Plan
from framework.planner.measurement import SKIPPED_STAGE, Measurement
from framework.planner.spec import Measure

_COLUMNS = (
    "policy",
    "shard",
    "batch",
    "peak",
    "step adds",
    "XLA step",
    "XLA temp",
    "step s",
    "examples/s",
    "fits",
)
# Figures estimated from XLA's plan rather than measured in a run carry this mark.
ESTIMATED = "~"


def _mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


def rate(per_second: float) -> str:
    """A throughput with one decimal, or three significant digits below 1 (a 1 B model's
    estimate on a CPU is hundredths of an example per second)."""
    return f"{per_second:.1f}" if per_second >= 1 else f"{per_second:.3g}"


def _row(plan: Plan, m: Measurement) -> tuple[str, ...]:
    batch = str(m.batch_size or "config")
    if not m.ok:
        reason = m.error if m.stage == SKIPPED_STAGE else f"failed: {m.error}"
        return (m.policy, m.shard_state, batch, "-", "-", "-", "-", "-", "-", reason)
    mark = "yes" if plan.fits(m) else "no"
    if m is plan.pick:
        mark = "PICK"
    if m.compiler_remat_bytes:
        mark += f" (the compiler recomputes {_mib(m.compiler_remat_bytes)} of it)"
    estimated = ESTIMATED if m.step_seconds is None else ""
    return (
        m.policy,
        m.shard_state,
        batch,
        _mib(m.peak_bytes),
        _mib(m.step_bytes),
        _mib(m.compiled_step_bytes),
        _mib(m.compiled_temp_bytes),
        "-" if m.seconds is None else f"{estimated}{m.seconds:.3f}",
        "-" if m.examples_per_second is None else f"{estimated}{rate(m.examples_per_second)}",
        mark,
    )


def table(plan: Plan) -> str:
    """A fixed-width table, one row per combination; a failure or a combination left out
    (`schedule.py`) keeps its row, the reason last.

    "peak" is the allocator's peak of a step that ran and "step adds" what the step allocated
    on top of what was live; "XLA step" is XLA's plan of the forward and backward pass at its
    peak plus the optimizer's state, "XLA temp" its scratch. Times and throughputs marked
    `ESTIMATED` come from the step's dot and convolution FLOPs at the device's peak FLOP/s.
    The last line names the compiler that planned the XLA figures ("XLA:CPU", "TPU v5e (libtpu
    ...)") and the XLA flags the steps were compiled under.
    """
    rows = [_COLUMNS, *(_row(plan, m) for m in plan.measurements)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS) - 1)] + [4]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    flags = " ".join(f"{var}={value!r}" for var, value in plan.xla_flags.items())
    compilers = sorted({m.compiler for m in plan.measurements if m.compiler})
    planned = f"planned by {' and '.join(compilers)}, " if compilers else ""
    lines.append(f"{planned}compiled under {flags or 'no XLA flags (its defaults)'}")
    return "\n".join(lines)


def verdict(plan: Plan) -> str:
    """One line: the pick and its headroom, or "nothing fits" with the smallest option."""
    from framework.memory import format_bytes  # (imports TensorFlow: not for `--help`)

    budget = (
        f"{format_bytes(plan.budget_bytes)} with a {plan.safety_margin:.0%} margin "
        f"(usable {format_bytes(plan.usable_bytes)})"
    )
    if plan.pick is not None:
        pick = plan.pick
        speed = "" if pick.measure == Measure.RUN else " (estimated from its FLOPs)"
        recomputed = ""
        if pick.compiler_remat_bytes:
            recomputed = (
                f"; it fits because {pick.compiler.split(' (')[0]} rematerializes by itself "
                f"(without a memory limit it plans "
                f"{format_bytes(pick.unlimited_peak_bytes + pick.state_bytes)})"
            )
        return (
            f"pick: remat policy {pick.policy} at batch size {pick.batch_size}{_sharded(pick)}: "
            f"{pick.fit_kind} "
            f"{format_bytes(pick.fit_bytes)} of a budget of {budget}, "
            f"{rate(pick.examples_per_second)} examples/s{speed}{recomputed}"
        )
    smallest = plan.smallest
    if smallest is None:
        return f"nothing fits in {budget}: no combination could be measured (see the table)"
    over = smallest.fit_bytes - plan.usable_bytes
    return (
        f"nothing fits in {budget}: the smallest is remat policy {smallest.policy} at batch "
        f"size {smallest.batch_size}{_sharded(smallest)}, {smallest.fit_kind} "
        f"{format_bytes(smallest.fit_bytes)}, "
        f"{format_bytes(over)} over the usable budget "
        f"({smallest.fit_bytes / plan.budget_bytes:.2f}x the budget)"
    )


def _sharded(m: Measurement) -> str:
    return "" if m.shard_state == "none" else f", state sharded at the {m.shard_state} level"


def to_json(plan: Plan) -> dict:
    """Everything the plan knows, in plain JSON types."""
    return {
        "budget_bytes": plan.budget_bytes,
        "safety_margin": plan.safety_margin,
        "usable_bytes": plan.usable_bytes,
        "tie_tolerance": plan.tie_tolerance,
        "xla_flags": plan.xla_flags,
        "combinations": [
            {**m.to_json(), "fits": plan.fits(m), "picked": m is plan.pick}
            for m in plan.measurements
        ],
        "pick": None
        if plan.pick is None
        else {
            "policy": plan.pick.policy,
            "batch_size": plan.pick.batch_size,
            "shard_state": plan.pick.shard_state,
        },
        "verdict": verdict(plan),
    }


def plot(plan: Plan, path: str) -> None:
    """Writes the peak-memory-against-step-time picture (matplotlib, no display needed)."""
    import matplotlib

    from framework.core import files

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    measured = [m for m in plan.measurements if m.ok and m.seconds]
    times = [m.seconds for m in measured] or [0.0]
    middle = (min(times) + max(times)) / 2
    for m in measured:
        color = "tab:green" if plan.fits(m) else "tab:gray"
        axes.scatter(m.seconds, m.fit_bytes / 2**20, color=color, zorder=3)
        # Labels point inwards, so the ones of the slowest points stay inside the picture.
        right = m.seconds > middle
        axes.annotate(
            m.label,
            (m.seconds, m.fit_bytes / 2**20),
            fontsize=8,
            xytext=(-5 if right else 5, 5),
            textcoords="offset points",
            ha="right" if right else "left",
        )
    if plan.pick is not None:
        axes.scatter(
            plan.pick.seconds,
            plan.pick.fit_bytes / 2**20,
            marker="*",
            s=300,
            facecolors="none",
            edgecolors="tab:red",
            zorder=4,
            label="pick",
        )
    axes.axhline(plan.budget_bytes / 2**20, color="tab:red", label="budget")
    axes.axhline(
        plan.usable_bytes / 2**20,
        color="tab:red",
        linestyle="--",
        label=f"budget - {plan.safety_margin:.0%} margin",
    )
    peaks = [m.fit_bytes / 2**20 for m in measured] or [plan.budget_bytes / 2**20]
    # A budget far above every peak would squash the points into one line at the bottom.
    axes.set_ylim(0, max(min(plan.budget_bytes / 2**20, 4 * max(peaks)), max(peaks)) * 1.1)
    axes.margins(x=0.15)
    compiled = any(m.measure != Measure.RUN for m in measured)
    axes.set_xlabel("step time (s)" + (", estimated from FLOPs" if compiled else ", median"))
    axes.set_ylabel("XLA's plan (MiB)" if compiled else "allocator peak (MiB)")
    axes.set_title("remat policy and batch size: memory against time")
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png")
    plt.close(figure)
    files.write_bytes(path, png.getvalue())


def write_plan(plan: Plan, model_dir: str) -> tuple[str, str]:
    """Writes `plan.json` and `plan.png` into model_dir (a gs:// one too); returns their paths."""
    from framework.core import files

    json_path, png_path = files.join(model_dir, "plan.json"), files.join(model_dir, "plan.png")
    files.write_bytes(json_path, json.dumps(to_json(plan), indent=2) + "\n")
    plot(plan, png_path)
    return json_path, png_path
