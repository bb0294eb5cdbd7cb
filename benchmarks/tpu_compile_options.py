"""Which TPU compile options make the planner's compilations faster without changing the plan.

A TPU plan is a full compilation by libtpu: XLA's passes and buffer assignment (which decide the
memory plan), then code generation for the chip (which decides only the code). The planner needs
the first part, so options that cut the second part's effort should leave the plan unchanged. This
compiles one train step (the `remat_policies.py` models: forward, backward, SGD apply; dropout
on) for a TPU chip under each option set, in turn, `--repeats` times, and reports each set's
median compile time as a ratio to the defaults' (measured in the same run) and whether the plan
is the defaults' plan: the same argument, output and temp bytes and the same buffers live at the
peak. The code's size and the compiler's FLOP count are shown beside it.

    python benchmarks/tpu_compile_options.py --out=benchmarks/results/tpu_compile_options.md
    python benchmarks/tpu_compile_options.py --quick --repeats=1
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import tensorflow as tf
from reporting import mib, write_report
from step_models import MODELS, ModelSpec, build_model, model_spec, train_step

from framework.core import jax_internals
from framework.memory import tpu
from framework.memory.xla_buffers import CompiledMemory

# Candidate option sets: XLA's build options for effort, and the code generator's own switches.
OPTION_SETS = (
    "exec_time_optimization_effort=-1",
    "optimization_level=O1",
    "xla_llvm_disable_expensive_passes=true",
    "xla_jf_llvm_use_fast_opt=true",
    "xla_backend_optimization_level=0",
)


def parse_option_set(text: str) -> dict[str, str]:
    """Parses "a=1,b=2" into {"a": "1", "b": "2"}; "" is the defaults."""
    options = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"option {item!r} is not NAME=VALUE")
        options[name.strip()] = value.strip()
    return options


def plan_key(plan: CompiledMemory) -> tuple:
    """What makes two memory plans the same plan (the code is compared separately)."""
    buffers = sorted((b.size_bytes, b.shape, b.kind) for b in plan.peak_buffers)
    return plan.parameter_bytes, plan.output_bytes, plan.temp_bytes, tuple(buffers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="v5e", help="TPU chip (v4, v5e, v5p, v6e)")
    parser.add_argument("--model", default="stack", choices=MODELS)
    parser.add_argument("--setting", default="nothing_saveable", help="remat policy, or none")
    parser.add_argument(
        "--option_sets",
        default=";".join(OPTION_SETS),
        help="option sets to try, ';'-separated, each 'NAME=VALUE,...' (the defaults always first)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="compilations per option set")
    parser.add_argument("--quick", action="store_true", help="the tiny model, for a smoke test")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args()
    try:
        chip = tpu.tpu_chip(args.target)
        option_sets = [""] + [s.strip() for s in args.option_sets.split(";") if s.strip()]
        parsed = [parse_option_set(s) for s in option_sets]
    except ValueError as error:
        parser.error(str(error))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    spec: ModelSpec = model_spec(args.model, args.quick)
    started = datetime.datetime.now()
    model = build_model(spec, args.setting)
    x, y = spec.batch()
    hlo = train_step(spec, model).experimental_get_compiler_ir(x, y)(stage="hlo_serialized")

    # libtpu starts once per process, with the first compilation: not part of any option's time.
    jax_internals.tpu_device(chip.topology, chip.chip_config)
    seconds: list[list[float]] = [[] for _ in option_sets]
    plans: list[CompiledMemory | str] = ["" for _ in option_sets]
    for _ in range(args.repeats):  # in turn, so that drift on a shared host weighs on all alike
        for i, options in enumerate(parsed):
            start = time.perf_counter()
            try:
                plans[i] = tpu.compile_for_chip(hlo, chip, options)
            except Exception as error:  # an option libtpu rejects comes back as a runtime error
                plans[i] = str(error).splitlines()[0][:160]
            seconds[i].append(time.perf_counter() - start)

    base = plans[0]
    if isinstance(base, str):
        raise SystemExit(f"error: the step does not compile for {chip.name}: {base}")
    base_time = statistics.median(seconds[0])
    lines = [
        "Command: `python " + " ".join(["benchmarks/tpu_compile_options.py", *sys.argv[1:]]) + "`",
        f"Date: {started:%Y-%m-%d %H:%M}; TensorFlow {tf.__version__}; {base.compiler}",
        f"Model: {spec.description}; remat: {args.setting}. Compiled for one {chip.name} chip, "
        f"nothing run; median of {args.repeats} compilations per option set, in turn.",
        "",
        "| options | compile s | time / defaults | same plan | temp MiB | code MiB "
        "| FLOPs / defaults |",
        "|---|---|---|---|---|---|---|",
    ]
    for text, plan, times in zip(option_sets, plans, seconds):
        median = statistics.median(times)
        name = f"`{text}`" if text else "defaults"
        if isinstance(plan, str):
            lines.append(f"| {name} | {median:.1f} | | fails: {plan} | | | |")
            continue
        same = "yes" if plan_key(plan) == plan_key(base) else "**no**"
        cells = [
            f"{median:.1f}",
            f"{median / base_time:.2f}",
            same,
            mib(plan.temp_bytes),
            mib(plan.generated_code_bytes),
            f"{plan.flops / base.flops:.3f}" if plan.flops and base.flops else "-",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
