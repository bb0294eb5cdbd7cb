"""The flags the binaries share, defined in one place so each means the same in every binary.

The trainer and the planner name a run's config with the same flags and pick against the same
budget flags; sample and export take the model directory alone. `--gin.NAME=VALUE`, t5x's
shorthand for a binding, is rewritten here into the `--gin_bindings` flag it stands for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from absl import flags

from framework.core.errors import UsageError

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_GIN_FILE = "quickstart.gin"
DEFAULT_MODEL_DIR = "runs/quickstart"
GIN_SHORTHAND = "--gin."
DEFAULT_POLICIES = (
    "none",
    "dots_saveable+random_masks_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "random_masks_saveable",
    "nothing_saveable",
)
# The package owns these flags, not this module: a binary adopts them with
# `flags.adopt_module_key_flags(cli)`, and `--helpfull` lists them under framework.cli.
_OWNER = __package__
FLAGS = flags.FLAGS


def define_config_flags() -> None:
    """The flags that name a run's config: gin files, bindings, search paths, model_dir.

    The `define_*` functions define each flag once per process (tests import several binaries);
    a binary then adopts them as its own (`flags.adopt_module_key_flags(cli)`) so that `--help`
    lists them."""
    if "gin_file" in FLAGS:
        return
    flags.DEFINE_multi_string(
        "gin_file",
        None,
        f"Gin config files, found on --gin_search_paths (default {DEFAULT_GIN_FILE}).",
        module_name=_OWNER,
    )
    flags.DEFINE_multi_string(
        "gin_bindings",
        None,
        "Gin bindings, e.g. 'Trainer.train_steps = 100'; --gin.Trainer.train_steps=100 is the "
        "same.",
        module_name=_OWNER,
    )
    flags.DEFINE_alias("gin_param", "gin_bindings", module_name=_OWNER)
    flags.DEFINE_list(
        "gin_search_paths",
        [".", str(CONFIGS_DIR)],
        "Directories searched for --gin_file (the package's configs/ last).",
        module_name=_OWNER,
    )
    define_model_dir_flag(
        f"Output directory (default {DEFAULT_MODEL_DIR} with no --gin_file; required otherwise)."
    )


def define_model_dir_flag(help_text: str) -> None:
    """--model_dir, with the binary's own `help_text` (sample and export need no config flags)."""
    if "model_dir" not in FLAGS:
        flags.DEFINE_string("model_dir", None, help_text, module_name=_OWNER)


def define_trusted_imports_flag() -> None:
    """--trusted_imports: what a run's config.gin may import when sample or export read it."""
    if "trusted_imports" not in FLAGS:
        flags.DEFINE_list(
            "trusted_imports",
            [],
            "Modules the run's config.gin may import (its `import my_data` lines); a gin file "
            "is code, so name only modules you trust. Its other import lines are refused.",
            module_name=_OWNER,
        )


def define_budget_flags(memory_budget_help: str) -> None:
    """--memory_budget, --safety_margin and --policies: what the planner picks against."""
    if "memory_budget" in FLAGS:
        return
    flags.DEFINE_string(
        "memory_budget",
        None,
        "Memory per device the step must fit in, e.g. 16GiB (powers of 1024) or 16GB (of 1000). "
        + memory_budget_help,
        module_name=_OWNER,
    )
    flags.DEFINE_float(
        "safety_margin",
        0.1,
        "Fraction of --memory_budget kept free: a pick's peak must stay below budget * (1 - "
        "margin).",
        lower_bound=0.0,
        upper_bound=0.9,
        module_name=_OWNER,
    )
    require_a_number("safety_margin")
    flags.DEFINE_list(
        "policies",
        list(DEFAULT_POLICIES),
        "Remat policies to try, from the least recomputation to the most: equally fast ones are "
        "decided in this order.",
        module_name=_OWNER,
    )
    flags.DEFINE_enum(
        "measure",
        "auto",
        ["auto", "run", "compile"],
        "How each setting is measured: compile (XLA's plan of the step, nothing runs; time "
        "estimated from its FLOPs), run (the step runs: allocator peak and median time), or auto "
        "(run when XLA's plan fits this host's memory, else compile).",
        module_name=_OWNER,
    )
    flags.DEFINE_boolean(
        "search_budget",
        True,
        "Also search the largest memory-budget policy fraction that fits (budget:F, in steps "
        "of 0.02) on XLA's plan, one probe per compile worker at a time.",
        module_name=_OWNER,
    )
    flags.DEFINE_list(
        "shard_states",
        None,
        "Levels of Trainer.shard_state to plan every setting at (none, optimizer, gradients, "
        "weights), the lowest first: equally fast ones are decided in this order. Default: the "
        "config's own.",
        module_name=_OWNER,
    )
    flags.DEFINE_integer(
        "compile_processes",
        0,
        "Worker processes that read XLA's plans at once, each holding the weights and the "
        "optimizer state in host memory. 0 (the default): up to one per CPU core, each next one "
        "started once the others are ready and the host has twice a worker's peak memory "
        "available (1.25 times, once one has compiled).",
        lower_bound=0,
        module_name=_OWNER,
    )


def require_a_number(name: str) -> None:
    """Refuses nan for the float flag `name`: absl's bounds are comparisons, which nan passes."""
    flags.register_validator(name, lambda value: value == value, f"--{name} must be a number")


def rewrite_gin_shorthand(argv: Sequence[str]) -> list[str]:
    """`--gin.NAME=VALUE` as `--gin_bindings=NAME = VALUE` (t5x's shorthand)."""
    rewritten = []
    for arg in argv:
        if arg.startswith(GIN_SHORTHAND):
            if "gin_bindings" not in FLAGS:
                raise UsageError(f"{arg}: this command takes no gin bindings")
            name, sep, value = arg[len(GIN_SHORTHAND) :].partition("=")
            if not sep or not name:
                raise UsageError(f"{arg!r} should look like --gin.NAME=VALUE")
            arg = f"--gin_bindings={name} = {value}"
        rewritten.append(arg)
    return rewritten
