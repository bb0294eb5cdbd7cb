"""What the binaries share: one runner, their flags, gin parsing, the model directory.

Each binary (`framework.train`, `framework.planner`, `framework.sample`, `framework.export`)
defines the flags it uses with the `define_*` functions (`flags.py`) and hands its `main(argv) ->
exit status` to `run` (`runner.py`), which:

- rewrites t5x-style `--gin.NAME=VALUE` into `--gin_bindings` inside absl's flag parsing;
- reports bad input - a bad or unknown flag, a gin file or binding, a `UserError` raised by
  `main` - as one `error:` line on stderr and exit status 2 (absl would print its usage);
- turns Ctrl-C before `main` handled it into status 130, as a shell's interrupted command;
- keeps TensorFlow's start-up banners, its CUDA probes on machines without GPUs, its C++ INFO
  lines and known-harmless Python warnings out of the console (`tensorflow_noise.py`):
  `--verbosity=1` (or `-v 1`) brings them back.

`main` parses the gin files and bindings (`gin_config.py`, which also puts what a run learns from
its data, a text vocabulary, in the model directory) and checks what the other flags and the
model directory say (`checks.py`). `--help` lists every flag the binary takes and imports no
TensorFlow.
"""

from framework.cli.checks import (
    gin_inputs,
    memory_budget_flag,
    model_dir_flag,
    policies_flag,
    prepare_model_dir,
    shard_states_flag,
)
from framework.cli.flags import (
    CONFIGS_DIR,
    define_budget_flags,
    define_config_flags,
    define_model_dir_flag,
    define_trusted_imports_flag,
    require_a_number,
    rewrite_gin_shorthand,
)
from framework.cli.gin_config import (
    VOCAB_FILE,
    bind_run_files,
    binding_name,
    bound_value,
    parse_gin,
    parse_run_config,
    vocab_path_names,
)
from framework.cli.runner import first_line, raise_if_interrupted, run
from framework.core.errors import UsageError

__all__ = [
    "CONFIGS_DIR",
    "UsageError",
    "VOCAB_FILE",
    "bind_run_files",
    "binding_name",
    "bound_value",
    "define_budget_flags",
    "define_config_flags",
    "define_model_dir_flag",
    "define_trusted_imports_flag",
    "first_line",
    "gin_inputs",
    "memory_budget_flag",
    "model_dir_flag",
    "require_a_number",
    "parse_gin",
    "parse_run_config",
    "policies_flag",
    "prepare_model_dir",
    "raise_if_interrupted",
    "rewrite_gin_shorthand",
    "run",
    "shard_states_flag",
    "vocab_path_names",
]
