"""The binaries run in the test's own process, where the subprocess is not what is tested."""

import logging

import gin

from framework import cli, train

# Flags of a two-step run, one loop, then an eval: how the data tests train each source.
TWO_STEPS = [
    "--gin.Trainer.train_steps=2",
    "--gin.Trainer.steps_per_loop=2",
    "--gin.Trainer.global_batch_size=4",
    "--gin.Trainer.count_flops=False",
    "--mode=train_and_eval",
]


def train_binary(flags, model_dir, caplog) -> str:
    """The log of `python -m framework.train` with `flags`, run in this process."""
    gin.clear_config()
    try:
        train.FLAGS(cli.rewrite_gin_shorthand(["train", *flags, f"--model_dir={model_dir}"]))
        with caplog.at_level(logging.INFO):
            assert train.main(["train"]) == 0
    finally:
        train.FLAGS.unparse_flags()
        gin.clear_config()
    return caplog.text
