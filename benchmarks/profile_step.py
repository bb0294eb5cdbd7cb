"""Where a train step's time goes under each remat setting, per kind of XLA operation.

`step_models.py` says what a policy costs; this says where. It compiles the same train steps
(same models, settings and SGD step), runs each under the TensorFlow profiler and adds up, per
kind of compiled operation, how long its thunks ran: an XLA fusion's name without its number
(`select_bitcast_fusion`), a library call (`MatMul`). Only innermost operations are counted (a
`call` that wraps fusions is not counted twice) and time is summed over the threads they ran on,
so a column can exceed the step's wall time. The table lists the kinds whose time differs most
from the first setting's: the cost of the recomputation, op by op.

    python benchmarks/profile_step.py --model=vit_b16 \\
        --settings=none,dots_saveable+random_masks_saveable
    python benchmarks/profile_step.py --quick --model=stack --settings=none,nothing_saveable
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable

import reporting
import step_models
import tensorflow as tf

from framework.core.tf_internals import xplane_pb2

HLO_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ", re.MULTILINE)


def _leaf_events(space: xplane_pb2.XSpace, names: set[str]) -> list[tuple[str, float]]:
    """(name, milliseconds) of each profiled event named in `names` that contains no other one."""
    found = []
    for plane in space.planes:
        metadata = {key: value.name for key, value in plane.event_metadata.items()}
        for line in plane.lines:
            named = ((e, metadata.get(e.metadata_id, "")) for e in line.events)
            events = sorted(
                (e.offset_ps, e.offset_ps + e.duration_ps, n) for e, n in named if n in names
            )
            for i, (start, end, name) in enumerate(events):
                if i + 1 == len(events) or events[i + 1][0] >= end:
                    found.append((name, (end - start) / 1e9))
    return found


def profile(step: Callable, x: tf.Tensor, y: tf.Tensor, steps: int) -> tuple[dict, float]:
    """Milliseconds per step by operation kind, and the profiled step's wall milliseconds."""
    names = set(HLO_NAME.findall(step.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")))
    step(x, y).numpy()
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        start = time.perf_counter()
        for _ in range(steps):
            step(x, y).numpy()
        wall = time.perf_counter() - start
        tf.profiler.experimental.stop()
        (path,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
    per_kind: dict[str, float] = collections.Counter()
    for name, ms in _leaf_events(space, names):
        per_kind[re.sub(r"(\.\d+)+$", "", name)] += ms / steps
    return per_kind, 1000 * wall / steps


def format_table(settings: list[str], profiles: list[tuple[dict, float]], top: int) -> str:
    """Markdown: the `top` kinds that differ most from the first setting, then totals."""
    kinds = set().union(*(per_kind for per_kind, _ in profiles))
    first = profiles[0][0]

    def spread(kind: str) -> float:
        return max(abs(per_kind.get(kind, 0.0) - first.get(kind, 0.0)) for per_kind, _ in profiles)

    labels = [step_models.SETTING_LABELS[s] for s in settings]
    lines = [
        "| operation kind | " + " | ".join(f"{label} ms" for label in labels) + " |",
        "|---" * (len(settings) + 1) + "|",
    ]
    for kind in sorted(kinds, key=spread, reverse=True)[:top]:
        cells = [f"{per_kind.get(kind, 0.0):.1f}" for per_kind, _ in profiles]
        lines.append(f"| `{kind}` | " + " | ".join(cells) + " |")
    totals = [f"{sum(per_kind.values()):.1f}" for per_kind, _ in profiles]
    lines.append("| all operations (summed over threads) | " + " | ".join(totals) + " |")
    walls = [f"{wall:.1f}" for _, wall in profiles]
    lines.append("| step wall time, profiled | " + " | ".join(walls) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_b16", choices=step_models.MODELS)
    parser.add_argument(
        "--settings",
        default="none,dots_saveable+random_masks_saveable",
        help=f"comma-separated, the first is the reference; from {step_models.SETTINGS}",
    )
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per setting")
    parser.add_argument("--top", type=int, default=20, help="operation kinds to list")
    parser.add_argument("--quick", action="store_true", help="tiny models, for a smoke test")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    settings = args.settings.split(",")
    for setting in settings:
        if setting not in step_models.SETTINGS:
            parser.error(f"unknown setting {setting!r}; choose from {step_models.SETTINGS}")
    spec = step_models.model_spec(args.model, args.quick)
    x, y = spec.batch()
    steps = [step_models.train_step(spec, step_models.build_model(spec, s)) for s in settings]
    profiles = [profile(step, x, y, args.steps) for step in steps]
    command = "python " + " ".join(["benchmarks/profile_step.py", *sys.argv[1:]])
    print(f"Command: `{command}`")
    print(f"Machine: {reporting.machine()}")
    print(f"- {args.model}: {spec.description}; milliseconds per step, mean of {args.steps}\n")
    print(format_table(settings, profiles, args.top))


if __name__ == "__main__":
    main()
