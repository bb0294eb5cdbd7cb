"""Trains a model from gin configs: `python -m framework.train [--gin_file=...] [--gin.NAME=VALUE]`.

With no `--gin_file` it runs the embedded default `quickstart.gin` (a small ViT on generated shapes,
on the CPU) into `runs/quickstart`. The resolved config and the command line are written to the
model directory (by the chief only, in a cluster). Problems the user can fix end in one line on
stderr and exit status 2; a preempted run (SIGTERM) saves a checkpoint and exits with status 42.

`Trainer.remat_policy = "auto"` with `--memory_budget` runs the planner (`framework.plan`) first,
over `--policies` at the config's batch size, and trains with its pick. The binary resolves "auto":
the Trainer and the remat library only ever see a real policy.
"""

from __future__ import annotations

import datetime
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import gin
from absl import app, flags

from framework import cli
from framework.cli import UsageError, parse_gin, prepare_model_dir, split_gin_shorthand

AUTO_POLICY = "auto"
PREEMPTED_EXIT_CODE = 42  # what TensorFlow's own preemption handling uses for "restart me"

flags.DEFINE_enum("mode", "train_and_eval", ["train", "eval", "train_and_eval"], "What to run.")
FLAGS = flags.FLAGS


def write_run_record(model_dir: str, config: str, command: str) -> None:
    """Writes config.gin and command; an earlier, different config.gin is kept, dated."""
    config_path = Path(model_dir, "config.gin")
    if config_path.exists() and config_path.read_text() != config:
        stamp = datetime.datetime.fromtimestamp(config_path.stat().st_mtime).strftime(
            "%Y%m%d-%H%M%S"
        )
        config_path.rename(config_path.with_name(f"config-{stamp}.gin"))
    config_path.write_text(config)
    Path(model_dir, "command").write_text(command + "\n")
    logging.info("command: %s", command)
    logging.info("operative gin config:\n%s", config)


def _wants_auto_policy() -> bool:
    try:
        policy = gin.query_parameter("Trainer.remat_policy")
    except ValueError:  # not bound
        return False
    return isinstance(policy, str) and policy.strip().lower() == AUTO_POLICY


def resolve_auto_policy(files: Sequence[str], bindings: Sequence[str], model_dir: str) -> None:
    """Replaces `Trainer.remat_policy = "auto"` by the planner's pick for --memory_budget.

    The plan (`plan.json`, `plan.png`) is written to model_dir beside the run, and the pick is
    bound in gin so that the `config.gin` of the run names the policy it trained with.
    """
    budget = cli.memory_budget_flag()
    if not _wants_auto_policy():
        if budget is not None:
            raise UsageError(
                "--memory_budget is only used with Trainer.remat_policy = 'auto'; drop it or set "
                "--gin.Trainer.remat_policy=\"'auto'\""
            )
        return
    if budget is None:
        raise UsageError("Trainer.remat_policy = 'auto' needs --memory_budget, e.g. 16GiB")
    from framework import planner

    config = planner.RunConfig(files, bindings, FLAGS.gin_search_paths)
    try:
        plan = planner.make_plan(
            config, budget, cli.policies_flag(), safety_margin=FLAGS.safety_margin
        )
    except planner.launch.ConfigError as error:
        raise UsageError(str(error)) from None
    planner.write_plan(plan, model_dir)
    logging.info("remat policy auto: plan\n%s", planner.table(plan))
    if plan.pick is None:
        raise UsageError(f"remat policy auto: {planner.verdict(plan)}")
    logging.info("remat policy auto: %s", planner.verdict(plan))
    with gin.unlock_config():
        gin.bind_parameter("Trainer.remat_policy", plan.pick.policy)


def run(argv: Sequence[str], gin_shorthand: Sequence[str]) -> dict[str, float]:
    """Configures and runs the trainer for the parsed flags; returns the final metrics."""
    files, bindings = cli.gin_inputs(argv, gin_shorthand)
    model_dir = cli.model_dir_flag()

    import framework.configurables  # noqa: F401  (registers the gin names)
    from framework import trainer

    parse_gin(files, bindings, FLAGS.gin_search_paths)
    prepare_model_dir(model_dir)
    resolve_auto_policy(files, bindings, model_dir)
    try:
        run_trainer = trainer.Trainer(model_dir)
    except (ValueError, TypeError) as error:
        raise UsageError(f"cannot build the run: {error}") from None
    if run_trainer.is_chief:  # one record per cluster
        write_run_record(model_dir, gin.operative_config_str(), shlex.join(sys.argv))
    if FLAGS.mode == "train":
        return run_trainer.train()
    if FLAGS.mode == "eval":
        return run_trainer.evaluate()
    return run_trainer.train_and_evaluate()


def main() -> None:
    """Entry point: `python -m framework.train`."""
    from framework.trainer import PreemptedError, TrainerError

    try:
        argv, shorthand = split_gin_shorthand(sys.argv)
    except UsageError as error:
        sys.exit(f"error: {error}")

    def app_main(args: Sequence[str]) -> None:
        logging.getLogger().setLevel(logging.INFO)
        try:
            run(args, shorthand)
        except (UsageError, TrainerError) as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        except PreemptedError as preempted:
            logging.info("%s", preempted)
            sys.exit(PREEMPTED_EXIT_CODE)

    app.run(app_main, argv=argv)


if __name__ == "__main__":
    main()
