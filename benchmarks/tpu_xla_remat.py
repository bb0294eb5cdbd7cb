"""XLA's own TPU rematerialization against the framework's remat policies, on the TPU's plan.

libtpu's compiler rematerializes by itself when a program does not fit its HBM limit
(`--xla_tpu_max_hbm_size_mib`, `Runtime.xla_memory_limit`); the framework's policies decide in
TensorFlow what the backward pass recomputes. Both trade FLOPs for memory. For one model's train
step (the `remat_policies.py` models: forward, backward, SGD apply; dropout on) this compiles, for a
TPU chip and with nothing run:

- no remat, with XLA's default limit (the chip's HBM);
- no remat with the limit set to fractions of that plan's peak: what XLA's pass reaches, and
  at what FLOP cost, or "does not fit" when it cannot;
- the framework's policies, XLA's limit left at its default.

Each row: the plan's peak (HBM: parameters, outputs, temps, code), its temps, the compiler's FLOP
count as a ratio to no remat (the recomputation each keeps), and the compile time.

    python benchmarks/tpu_xla_remat.py --target=v5e --out=benchmarks/results/tpu_xla_remat.md
    python benchmarks/tpu_xla_remat.py --quick --fractions=0.5 --policies=nothing_saveable
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import tensorflow as tf
from reporting import mib, write_report
from step_models import MODELS, ModelSpec, build_model, model_spec, train_step

from framework.memory import tpu


def compile_setting(spec: ModelSpec, setting: str, chip: tpu.TpuChip, flags: dict | None) -> dict:
    """The TPU plan of the model's train step under `setting`, with libtpu `flags`."""
    model = build_model(spec, setting)
    step = train_step(spec, model)
    x, y = spec.batch()
    hlo = step.experimental_get_compiler_ir(x, y)(stage="hlo_serialized")
    start = time.perf_counter()
    try:
        plan = tpu.compile_for_chip(hlo, chip, flags)
    except Exception as error:  # the compiler's out-of-memory comes back as a runtime error
        reason = str(error).splitlines()[0]
        return {"error": reason[:160], "seconds": time.perf_counter() - start}
    return {
        "peak": plan.peak_bytes,
        "temp": plan.temp_bytes,
        "flops": plan.flops,
        "seconds": time.perf_counter() - start,
        "compiler": plan.compiler,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="v5e", help="TPU chip (v4, v5e, v5p, v6e)")
    parser.add_argument("--model", default="vit_b16", choices=MODELS)
    parser.add_argument(
        "--fractions",
        default="0.7,0.5,0.3",
        help="XLA limits as fractions of the no-remat plan's peak",
    )
    parser.add_argument(
        "--policies",
        default="dots_saveable,random_masks_saveable,nothing_saveable",
        help="framework policies to compare with",
    )
    parser.add_argument("--quick", action="store_true", help="the tiny model, for a smoke test")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args()
    try:
        chip = tpu.tpu_chip(args.target)
        fractions = [float(f) for f in args.fractions.split(",") if f]
    except ValueError as error:
        parser.error(str(error))
    spec = model_spec(args.model, args.quick)
    started = datetime.datetime.now()

    rows = [("no remat", compile_setting(spec, "none", chip, None))]
    base = rows[0][1]
    if "error" in base:
        raise SystemExit(f"error: no remat does not compile for {chip.name}: {base['error']}")
    for fraction in fractions:
        limit_mib = max(1, int(fraction * base["peak"] / 2**20))
        flags = {"xla_tpu_max_hbm_size_mib": str(limit_mib)}
        name = f"no remat, XLA limit {fraction:g} x peak ({limit_mib} MiB)"
        rows.append((name, compile_setting(spec, "none", chip, flags)))
    for policy in filter(None, args.policies.split(",")):
        rows.append((f"`{policy}`", compile_setting(spec, policy, chip, None)))

    lines = [
        "Command: `python " + " ".join(["benchmarks/tpu_xla_remat.py", *sys.argv[1:]]) + "`",
        f"Date: {started:%Y-%m-%d %H:%M}; TensorFlow {tf.__version__}; {base['compiler']}",
        f"Model: {spec.description}. Compiled for one {chip.name} chip "
        f"({chip.hbm_bytes / 2**30:.0f} GiB HBM), nothing run.",
        "",
        "| setting | peak MiB | temp MiB | FLOPs / no remat | compile s |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows:
        if "error" in r:
            lines.append(f"| {name} | does not fit: {r['error']} | | | {r['seconds']:.0f} |")
            continue
        cells = [mib(r["peak"]), mib(r["temp"]), f"{r['flops'] / base['flops']:.3f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
