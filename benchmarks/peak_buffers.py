"""What a step's plan holds at its peak, by kind: the buffers live there, grouped and summed.

Builds the configured trainer from gin files, as the planner does, with a remat policy, and
compiles one device's forward and backward pass (the program the planner plans) with XLA:CPU or,
with `--target`, the compiler of a TPU chip or a GPU; nothing runs. The buffers live at the plan's
peak are grouped by what they are:

- weights: the program's parameters with the variables' shapes;
- the batch: its other parameters;
- gradients: its outputs (one per trainable variable, plus the loss);
- temporaries: by the TensorFlow op they come from, with layer numbers replaced by `*`, so that
  one row sums a value over every block (`block_*/mlp/dense_1/MatMul`); `gradient_tape/` rows
  are the backward pass, `remat/` rows a region's recomputation, others the forward pass.

The optimizer's state (its slots, e.g. AdamW's two moments) lives outside this program and is
listed apart, as the planner adds it.

    python benchmarks/peak_buffers.py --gin_file=plan/vit_b16_batch64_16gib.gin \\
        --policy=nothing_saveable --target=v5e
"""

from __future__ import annotations

import argparse
import collections
import datetime
import re
import sys

import tensorflow as tf
from reporting import mib, write_report

from framework import cli, memory, remat
from framework.core.errors import UsageError
from framework.planner import measurement
from framework.trainer import Trainer


def _dims(shape: str) -> tuple[int, ...]:
    """The dimensions of an XLA shape string such as "f32[768,3072]{1,0}"."""
    match = re.search(r"\[([\d,]*)\]", shape)
    return tuple(int(d) for d in match[1].split(",") if d) if match else ()


def group(buffer: memory.Buffer, weight_shapes: collections.Counter) -> tuple[str, str]:
    """(kind, group) of one buffer live at the peak."""
    if buffer.kind == "parameter":
        dims = _dims(buffer.shape)
        if weight_shapes[dims] > 0:
            weight_shapes[dims] -= 1
            return "weights", "variables"
        return "batch", buffer.shape
    if buffer.kind == "output":
        return "gradients", "outputs"
    name = re.sub(r"(_\d+)+(?=/|$)", "_*", buffer.op_name or f"({buffer.instruction})")
    parts = name.split("/")
    return "temporaries", "/".join(parts[:2] + ["..."] * (len(parts) > 4) + parts[-2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gin_file", action="append", required=True, help="gin config(s)")
    parser.add_argument("--gin", action="append", default=[], help="more gin bindings")
    parser.add_argument("--policy", default="nothing_saveable", help="remat policy, or none")
    parser.add_argument("--batch_size", type=int, help="the global batch (the config's)")
    parser.add_argument(
        "--target", help="a TPU chip (v4, v5e, ...; the tpu extra) or a GPU (p100, ...; gpu)"
    )
    parser.add_argument("--top", type=int, default=12, help="temporary groups listed")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args()
    started = datetime.datetime.now()
    try:
        policy = remat.get_policy(args.policy)
        cli.parse_gin(args.gin_file, args.gin, [".", str(cli.CONFIGS_DIR)])
    except (ValueError, UsageError) as error:
        parser.error(str(error))
    trainer = Trainer(None, remat_policy=None, count_flops=False)
    if policy is not remat.policies.everything_saveable:
        remat.set_grad_checkpointing(trainer.model, policy=policy)
    fn, step_args = trainer.compiled_step(args.batch_size)
    plan = memory.compiled_bytes(fn, *step_args, target=args.target)

    weight_shapes = collections.Counter(
        tuple(int(d) for d in v.shape) for v in trainer.model.trainable_variables
    )
    sums: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for buffer in plan.peak_buffers:
        entry = sums[group(buffer, weight_shapes)]
        entry[0] += 1
        entry[1] += buffer.size_bytes
    state = measurement.state_bytes(trainer.optimizer.variables)
    by_kind = collections.Counter()
    for (kind, _), (_, size) in sums.items():
        by_kind[kind] += size

    lines = [
        "Command: `python " + " ".join(["benchmarks/peak_buffers.py", *sys.argv[1:]]) + "`",
        f"Date: {started:%Y-%m-%d %H:%M}; TensorFlow {tf.__version__}; {plan.compiler}",
        f"Policy {args.policy}; the program's peak {mib(plan.peak_bytes)} MiB (temps "
        f"{mib(plan.temp_bytes)} MiB), the optimizer's state {mib(state)} MiB beside it.",
        "",
        "| kind | MiB at the peak |",
        "|---|---|",
        *[f"| {kind} | {mib(size)} |" for kind, size in by_kind.most_common()],
        f"| optimizer state (outside the program) | {mib(state)} |",
        "",
        f"The {args.top} largest groups of temporaries:",
        "",
        "| op (layer numbers as `*`) | buffers | MiB |",
        "|---|---|---|",
    ]
    temps = sorted(
        (
            (size, count, name)
            for (kind, name), (count, size) in sums.items()
            if kind == "temporaries"
        ),
        reverse=True,
    )
    lines += [f"| `{name}` | {count} | {mib(size)} |" for size, count, name in temps[: args.top]]
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
