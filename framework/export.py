"""Exports a trained model as a TensorFlow SavedModel for serving:
`python -m framework.export --model_dir=DIR --export_dir=OUT [--checkpoint=STEP_OR_PREFIX]`.

The model is rebuilt from the run's `DIR/config.gin` with the weights of the newest checkpoint
that restores, or of `--checkpoint` (a step of the run or a checkpoint prefix), by
`framework.trained_model`: float32 variables and compute whatever precision the run trained in, no
remat policy. Its serving functions are traced without the tags remat policies read
(`remat.without_checkpoint_names`), so the SavedModel is plain TensorFlow: loading it needs
neither this package nor anything registered at run time (op callbacks, custom gradients).

Signatures (all outputs float32):

- image classifiers (`models.VisionTransformer`): `serving_default`, images float32
  [batch, size, size, channels] -> `logits` and `probabilities` [batch, classes];
- language models (`models.DecoderLM`, `models.BertEncoder`): `serving_default`, `tokens` int32
  [batch, length] (each row one document from position 0) -> `logits` [batch, length, vocab];
  and `packed`, the trainer's packed rows (`tokens`, `segment_ids`, `positions`) -> `logits`.

`OUT` must not exist or be empty: the SavedModel is written beside it and renamed into place,
so an export that fails leaves nothing, and nothing of the user's is ever overwritten.
`OUT/assets.extra/` (which TensorFlow Serving leaves alone) records where the export came from:
the run's config.gin and `export.json` (model_dir, checkpoint, step, signatures).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from absl import flags

from framework import cli
from framework.core.errors import UsageError

if TYPE_CHECKING:  # TensorFlow loads only once a binary runs: `--help` stays quick
    import keras

cli.define_model_dir_flag("The training run's model directory (required).")
cli.define_trusted_imports_flag()
flags.DEFINE_string(
    "export_dir", None, "Where to write the SavedModel; must not exist or be empty (required)."
)
flags.DEFINE_string(
    "checkpoint",
    None,
    "A step of the run (e.g. 500) or a checkpoint prefix (.../ckpt-500); default: the newest "
    "checkpoint that restores.",
)
flags.adopt_module_key_flags(cli)
flags.declare_key_flag("verbosity")
FLAGS = flags.FLAGS

EXTRA_DIR = "assets.extra"  # files beside a SavedModel that TensorFlow Serving does not read


def check_export_dir(export_dir: str) -> bool:
    """Refuses an `export_dir` that holds anything; returns whether it exists (empty)."""
    import tensorflow as tf

    if not tf.io.gfile.exists(export_dir):
        return False
    if not tf.io.gfile.isdir(export_dir) or tf.io.gfile.listdir(export_dir):
        raise UsageError(
            f"export_dir {export_dir!r} already exists and is not an empty directory: give a "
            "new one (nothing there was changed)"
        )
    return True


def serving_functions(model: keras.Model) -> dict[str, tuple[Callable, list]]:
    """The signatures of `model`: name -> (function, input specs); see the module docstring."""
    import tensorflow as tf

    from framework.models import language, vit

    if isinstance(model, vit.VisionTransformer):
        size, channels = model.image_size, model.channels

        def classify(images):
            logits = model(images, training=False)
            return {"logits": logits, "probabilities": tf.nn.softmax(logits, axis=-1)}

        images = tf.TensorSpec([None, size, size, channels], tf.float32, name="images")
        return {"serving_default": (classify, [images])}
    if isinstance(model, (language.DecoderLM, language.BertEncoder)):

        def packed(tokens, segment_ids, positions):
            # Positions past the table would be an index error on a CPU and zeros on a GPU.
            check = tf.debugging.assert_less_equal(
                tf.shape(tokens)[1],
                model.max_length,
                message=f"rows are longer than max_length={model.max_length}, the positions "
                "the model has",
            )
            # An id outside the table would wrap around (a negative one) or fail on a CPU and
            # read zeros on a GPU: a wrong answer served without an error.
            checks = [
                check,
                _assert_in_range(tokens, model.vocab_size, "token ids", "the vocabulary's size"),
                _assert_in_range(positions, model.max_length, "positions", "max_length"),
            ]
            with tf.control_dependencies(checks):
                rows = {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}
                return {"logits": model(rows, training=False)}

        def documents(tokens):
            positions = tf.broadcast_to(tf.range(tf.shape(tokens)[1]), tf.shape(tokens))
            return packed(tokens, tf.ones_like(tokens), positions)

        rows = [
            tf.TensorSpec([None, None], tf.int32, name=name)
            for name in ("tokens", "segment_ids", "positions")
        ]
        return {"serving_default": (documents, rows[:1]), "packed": (packed, rows)}
    raise UsageError(
        f"cannot export a {type(model).__name__}: framework.export knows image classifiers "
        "(models.VisionTransformer) and language models (models.DecoderLM, models.BertEncoder)"
    )


def save(
    model: keras.Model, export_dir: str, record: dict | None = None, config: str | None = None
) -> dict:
    """Writes `model` as a SavedModel with `serving_functions(model)` to `export_dir` (which
    must not exist or be empty). `assets.extra/` gets `export.json`, which is `record` with each
    signature's inputs and outputs added (`"signatures"`), and `config` as `config.gin` when
    given. Returns what export.json holds."""
    import keras
    import tensorflow as tf

    from framework import remat
    from framework.core import files

    existed = check_export_dir(export_dir)
    functions = serving_functions(model)
    archive = keras.export.ExportArchive()
    record = dict(record or {}, signatures={})
    # Written beside export_dir, then renamed into place (which fails rather than replace a
    # directory that is no longer empty): a failed export leaves no partial SavedModel.
    staging = f"{export_dir.rstrip('/')}.partial-{uuid.uuid4().hex[:8]}"
    extra = files.join(staging, EXTRA_DIR)
    try:
        with remat.without_checkpoint_names():  # traced here, and saved as traced
            for name, (function, specs) in functions.items():
                traced = archive.add_endpoint(name, function, input_signature=specs)
                concrete = traced.get_concrete_function()
                record["signatures"][name] = {
                    "inputs": {
                        s.name: _describe(s) for s in concrete.structured_input_signature[0]
                    },
                    "outputs": sorted(concrete.structured_outputs),
                }
            archive.write_out(staging, verbose=False)
        tf.io.gfile.makedirs(extra)
        files.write_bytes(files.join(extra, "export.json"), json.dumps(record, indent=2) + "\n")
        if config is not None:
            files.write_bytes(files.join(extra, "config.gin"), config)
        tf.io.gfile.rename(staging, export_dir, overwrite=existed)
    except BaseException:
        if tf.io.gfile.exists(staging):
            tf.io.gfile.rmtree(staging)
        raise
    return record


def _assert_in_range(values, limit: int, what: str, name: str):
    """An op that fails unless 0 <= values < limit, with a message a client can act on."""
    import tensorflow as tf

    return tf.debugging.Assert(
        tf.logical_and(tf.reduce_all(values >= 0), tf.reduce_all(values < limit)),
        [f"{what} must be in [0, {limit}) ({name})", tf.reduce_min(values), tf.reduce_max(values)],
        summarize=1,
    )


def _describe(spec) -> str:
    dims = ",".join("None" if d is None else str(d) for d in spec.shape)
    return f"{spec.dtype.name}[{dims}]"


def export_run(
    model_dir: str,
    export_dir: str,
    checkpoint: str | None = None,
    trusted_imports: Sequence[str] = (),
) -> dict:
    """Exports the model of the run in `model_dir` (from `checkpoint`, a step or a prefix, or
    the newest) to `export_dir`; returns what `assets.extra/export.json` records. The run's
    config may import `trusted_imports` (`--trusted_imports`)."""
    import gin

    from framework import trained_model

    check_export_dir(export_dir)  # before the model is built: the cheap error first
    loaded = trained_model.load(model_dir, checkpoint, trusted_imports)
    gin.clear_config()  # the run's bindings are not the caller's
    record = {
        "model_dir": model_dir,
        "checkpoint": loaded.checkpoint,
        "step": loaded.step,
        "model": type(loaded.model).__name__,
    }
    return save(loaded.model, export_dir, record, config=loaded.config)


def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for name in ("model_dir", "export_dir"):
        if not FLAGS[name].value:
            raise UsageError(f"--{name} is required")
    import tensorflow as tf

    try:
        record = export_run(
            FLAGS.model_dir, FLAGS.export_dir, FLAGS.checkpoint, FLAGS.trusted_imports
        )
    except (OSError, tf.errors.OpError) as error:
        raise UsageError(
            f"cannot write the export to {FLAGS.export_dir}: {cli.first_line(error)}"
        ) from None
    logging.info(
        "exported step %d (%s) to %s", record["step"], record["checkpoint"], FLAGS.export_dir
    )
    for name, signature in record["signatures"].items():
        inputs = ", ".join(f"{key} {value}" for key, value in signature["inputs"].items())
        print(f"{FLAGS.export_dir}: {name}({inputs}) -> {', '.join(signature['outputs'])}")
    return 0


def console_main() -> None:
    """Entry point: `python -m framework.export`, `framework-export`."""
    cli.run(main)


if __name__ == "__main__":
    console_main()
