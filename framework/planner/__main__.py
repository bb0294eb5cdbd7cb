"""Answers "will this config fit, and what is the fastest setting that does?" before a run:
`python -m framework.planner --gin_file=... --memory_budget=16GiB [--policies=...]
[--batch_sizes=...]`, or for a TPU chip or an NVIDIA GPU on any host: `--target=v5e`,
`--target=p100` (the budget defaults to the device's memory). On a host with a GPU, a plan that
compiles is that GPU's compiler's.

It takes the trainer's gin flags, measures the real train step of that config for each remat policy
and batch size (each in a fresh process, see `framework.planner`), prints a table and the pick,
and writes `plan.json` and `plan.png` to `--model_dir`. Exit status: 0 with a pick, 1 when nothing
fits, 2 for bad input (one `error:` line).
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from framework import cli
from framework.core.errors import UsageError

cli.define_config_flags()
cli.define_budget_flags(
    "The plan picks the fastest setting that fits it. Required, unless --target names a "
    "device or this host has a GPU (then its memory)."
)
flags.DEFINE_string(
    "target",
    None,
    "Plan for this device with its own compiler, on any host. A TPU (libtpu's compiler, the "
    "tpu extra): a chip (v4, v5e, v5p, v6e: the batch sizes are per chip) or a slice such as "
    "v5e-8 or v5litepod-16 (the global batch split over its chips; sharded state cut over "
    "them, its collectives compiled for all of them). An NVIDIA GPU (XLA's GPU compiler, the "
    "gpu extra; batch sizes per card): p100, v100, t4, a100-40gb, a100-80gb, l4, h100, h200, "
    "b200, or the name CUDA reports. Every setting is compiled, not run; times are the "
    "program's FLOPs at the device's peak.",
)
flags.DEFINE_list(
    "batch_sizes",
    None,
    "Global batch sizes to try (default: the config's Trainer.global_batch_size).",
)
flags.DEFINE_integer(
    "steps",
    5,
    "Timed steps per combination, after one warm-up and one measured step; the median counts.",
    lower_bound=1,
)
flags.DEFINE_float(
    "tie_tolerance",
    0.05,
    "Throughputs within this fraction of the best count as "
    "equally fast; the earlier policy in --policies wins.",
    lower_bound=0.0,
    upper_bound=1.0,
)
cli.require_a_number("tie_tolerance")
flags.adopt_module_key_flags(cli)
flags.declare_key_flag("verbosity")
FLAGS = flags.FLAGS


def _batch_sizes() -> list[int | None]:
    if not FLAGS.batch_sizes:
        return [None]
    sizes = []
    for text in FLAGS.batch_sizes:
        if not text.strip().isdigit() or int(text) < 1:
            raise UsageError(f"--batch_sizes: {text!r} is not a positive integer")
        sizes.append(int(text))
    return sizes


def _target() -> str | None:
    """The device --target names, or this host's GPU (None: this host's compiler), checked
    before any worker starts: an unknown name or a missing extra is one error line, not one per
    combination."""
    from framework import planner

    try:
        return planner.plan_target(FLAGS.target, FLAGS.measure)
    except ValueError as error:
        raise UsageError(f"--target: {error}") from None


def _check_config(target: str | None, batch_sizes: list[int | None]) -> None:
    """What the parsed config must give before any worker starts: a model and data, and for a
    TPU slice, global batch sizes that split over its chips."""
    from framework.memory import targets, tpu
    from framework.trainer.settings import TrainerSettings

    for setting in ("model_fn", "dataset_fn"):
        if cli.bound_value(cli.binding_name(TrainerSettings, setting)) is None:
            raise UsageError(
                f"the config binds no Trainer.{setting}: give a --gin_file that does (such as "
                "quickstart.gin)"
            )
    if target is None or targets.target_device(target).kind != "TPU":
        return
    devices = tpu.tpu_devices(target)
    name = cli.binding_name(TrainerSettings, "global_batch_size")
    config_batch = cli.bound_value(name) or TrainerSettings.global_batch_size
    for size in batch_sizes:
        size = config_batch if size is None else size
        if size % devices:
            raise UsageError(
                f"global batch size {size} does not split over the {devices} chips of {target}: "
                f"give --batch_sizes that are multiples of {devices}"
            )


def main(argv: Sequence[str]) -> int:
    """Plans for the parsed flags; returns the exit status (0 a pick, 1 nothing fits)."""
    files, bindings = cli.gin_inputs(argv)
    model_dir = cli.model_dir_flag()
    budget = cli.memory_budget_flag()
    target = _target()
    if budget is None and target is None:
        raise UsageError(
            "--memory_budget is required, e.g. --memory_budget=16GiB (or --target=v5e or "
            "--target=p100: its memory)"
        )
    if target is not None:
        from framework.memory import targets
        from framework.memory.units import format_bytes

        device = targets.target_device(target)
        if budget is not None and budget > device.memory_bytes:
            raise UsageError(
                f"--memory_budget={FLAGS.memory_budget} is more than the "
                f"{format_bytes(device.memory_bytes)} of {target}: leave it out to plan for "
                "the whole device, or give less"
            )
        budget = budget or device.memory_bytes
    policies = cli.policies_flag()
    batch_sizes = _batch_sizes()

    from framework import planner
    from framework.trainer import trainer  # noqa: F401  (registers the gin names)

    cli.parse_gin(files, bindings, FLAGS.gin_search_paths)
    _check_config(target, batch_sizes)
    shard_states = cli.shard_states_flag()
    cli.prepare_model_dir(model_dir)
    bindings = [*bindings, *cli.bind_run_files(model_dir)]
    config = planner.RunConfig(files, bindings, FLAGS.gin_search_paths)
    try:
        plan = planner.make_plan(
            config,
            budget,
            policies,
            batch_sizes,
            safety_margin=FLAGS.safety_margin,
            steps=FLAGS.steps,
            tie_tolerance=FLAGS.tie_tolerance,
            measure=FLAGS.measure,
            search_budget=FLAGS.search_budget,
            compile_processes=FLAGS.compile_processes,
            target=target,
            shard_states=shard_states,
        )
    except planner.ConfigError as error:
        raise UsageError(str(error)) from None
    json_path, png_path = planner.write_plan(plan, model_dir)
    print(planner.table(plan))
    print(planner.verdict(plan))
    print(f"wrote {json_path} and {png_path}")
    return 0 if plan.pick is not None else 1


def console_main() -> None:
    """Entry point: `python -m framework.planner`, `framework-plan`."""
    cli.run(main)


if __name__ == "__main__":
    console_main()
