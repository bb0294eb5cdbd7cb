"""The model of a training run, rebuilt from its model_dir: what `framework.sample` and
`framework.export` read.

The model is built the way the run built it, from the run's own `config.gin` (`Trainer.model_fn`),
bound with this project's registrations only: a gin file is code, and a model directory may come
from anywhere, so its `import` and `include` lines are refused rather than run
(`cli.parse_run_config`), but for imports of the modules the user names as trusted. What the
trainer adds around the model is left out on purpose:

- no remat policy: the trainer attaches it to the model it builds (`Trainer.remat_policy`), and
  it only changes how gradients are computed, which inference never asks for;
- float32 variables and compute, whatever `Runtime.precision` the run trained with: under
  `mixed_bfloat16` the trainer keeps float32 variables, so its checkpoints restore unchanged
  into a float32 model, and a model built for inference should not inherit the dtype policy
  this process happens to have set.

The weights come from the newest checkpoint that restores (as the trainer resumes: a damaged
newest one is skipped for the one before it, saying so) or from a chosen one. Only the model is
restored (the optimizer's slots are not needed), and every weight of the model must be found
in the checkpoint: a config that no longer matches its checkpoints is an error, not a model
with freshly initialised weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import gin
import keras
import tensorflow as tf

import framework.configurables  # noqa: F401  (registers the names config.gin uses)
from framework import cli
from framework.core import files
from framework.core.errors import TrainerError, UsageError
from framework.rundir import checkpoints
from framework.trainer import settings


@dataclasses.dataclass(frozen=True)
class TrainedModel:
    """A run's model with the weights of `checkpoint` (a prefix `.../ckpt-N`), and the text of
    the run's config.gin it was built from."""

    model: keras.Model
    checkpoint: str
    config: str

    @property
    def step(self) -> int:
        return checkpoints.step_of(self.checkpoint)


def read_config(model_dir: str, trusted_imports: Collection[str] = ()) -> str:
    """Binds the run's `config.gin` in gin (replacing what gin held), its imports of
    `trusted_imports` run and every other import refused; returns its text."""
    path = files.join(model_dir, "config.gin")
    if not tf.io.gfile.exists(path):
        raise UsageError(f"{path} not found: is {model_dir!r} the model_dir of a training run?")
    try:
        text = files.read_text(path)
    except ValueError as error:
        raise UsageError(f"cannot read the run's config: {error}") from None
    gin.clear_config()
    cli.parse_run_config(text, path, trusted_imports)
    return text


def build_model() -> keras.Model:
    """`Trainer.model_fn` of the bound config, called with float32 as Keras' dtype policy."""
    name = cli.binding_name(settings.TrainerSettings, "model_fn")
    try:
        model_fn = gin.query_parameter(name)
    except ValueError:
        raise UsageError(
            f"the run's config.gin binds no {name}: it is not the one training wrote; copy "
            "that back, or write the bindings the run trained with"
        ) from None
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        return model_fn.scoped_configurable_fn()
    except (ValueError, TypeError) as error:
        raise UsageError(f"cannot build the run's model: {cli.first_line(error)}") from None
    finally:
        keras.config.set_dtype_policy(previous)


def checkpoint_prefix(model_dir: str, checkpoint: str) -> str:
    """The prefix `checkpoint` names: a step N of the run (`model_dir/checkpoints/ckpt-N`) or a
    checkpoint prefix of its own (`.../ckpt-N`, whose `.index` file must exist)."""
    if checkpoint.isdigit():
        listing = checkpoints.list_checkpoints(files.join(model_dir, "checkpoints"))
        by_step = {checkpoints.step_of(prefix): prefix for prefix in listing.committed}
        if int(checkpoint) not in by_step:
            steps = ", ".join(map(str, sorted(by_step))) or "none"
            raise UsageError(
                f"no checkpoint of step {checkpoint} in {listing.directory} (steps there: {steps})"
            )
        return by_step[int(checkpoint)]
    if not tf.io.gfile.exists(checkpoint + ".index"):
        raise UsageError(
            f"checkpoint {checkpoint!r} not found: give a step of the run or a checkpoint "
            "prefix such as model_dir/checkpoints/ckpt-100 (its .index file must exist)"
        )
    return checkpoint


def load(
    model_dir: str, checkpoint: str | None = None, trusted_imports: Collection[str] = ()
) -> TrainedModel:
    """The run's model (see the module docstring) with the weights of `checkpoint` (a step or a
    prefix, see `checkpoint_prefix`), or of the newest checkpoint that restores when None; the
    config's imports of `trusted_imports` run (`cli.parse_run_config`).

    Leaves the run's config bound in gin, for what else the caller reads of it.
    """
    config = read_config(model_dir, trusted_imports)
    model = build_model()

    def restore(prefix: str) -> None:
        status = tf.train.Checkpoint(model=model).read(prefix)
        try:
            status.assert_existing_objects_matched()
        except AssertionError:
            raise ValueError(
                "it lacks weights of the model config.gin builds (was the config changed after "
                "training?)"
            ) from None
        status.expect_partial()  # the optimizer's values are not read

    if checkpoint is not None:
        prefix = checkpoint_prefix(model_dir, checkpoint)
        try:
            files.with_retries(lambda: restore(prefix), f"restoring {prefix}")
        except Exception as error:  # noqa: BLE001 (TF raises many types for a bad file)
            raise TrainerError(
                f"cannot restore {prefix}: {cli.first_line(error)}. Choose another checkpoint "
                "(a step of the run, or a prefix) or leave out --checkpoint for the newest"
            ) from None
        return TrainedModel(model, prefix, config)
    listing = checkpoints.list_checkpoints(files.join(model_dir, "checkpoints"))
    try:
        prefix = checkpoints.restore_newest(listing, restore)
    except checkpoints.CheckpointError as error:
        raise TrainerError(str(error)) from None
    if prefix is None:
        raise UsageError(f"no checkpoint in {listing.directory}: train first")
    return TrainedModel(model, prefix, config)
