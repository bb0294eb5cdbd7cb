"""Is the text pipeline fast enough? Tokens/s of the input pipeline alone against the train step.

    python benchmarks/input_pipeline.py [--gin_file=lm_quickstart.gin] [--steps=100]

Builds the run of the gin file (its vocabulary goes to a temporary directory), then times
(1) the training dataset alone - read, tokenize, pack, batch - and (2) the trainer's compiled
steps on the same batches (one host loop of `--steps`, as the trainer times it), after one warm-up
loop each. Prints both in row tokens per second
(batch x sequence length, padding included) and their ratio: above 1 the pipeline keeps up.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence

from absl import app, flags

from framework import cli  # the trainer's --gin_file and --gin_search_paths flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

flags.DEFINE_integer("steps", 100, "Steps timed for each of the two measurements.")
FLAGS = flags.FLAGS
DEFAULT_GIN_FILE = "lm_quickstart.gin"


def pipeline_tokens_per_second(dataset, batches: int) -> float:
    """Row tokens per second of iterating `dataset` (after one warm-up pass of `batches`)."""
    iterator = iter(dataset)
    for _ in range(batches):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        inputs = next(iterator)[0]
    seconds = time.perf_counter() - start
    return batches * int(inputs["tokens"].shape.num_elements()) / seconds


def main(argv: Sequence[str]) -> None:
    del argv

    from framework.trainer import trainer

    model_dir = tempfile.mkdtemp(prefix="input_pipeline_")
    bindings = [
        f"data.TextCorpus.vocab_path = '{model_dir}/vocab.txt'",
        f"Trainer.steps_per_loop = {FLAGS.steps}",
        f"Trainer.train_steps = {2 * FLAGS.steps}",
        "Trainer.eval_every = None",
    ]
    cli.parse_gin(FLAGS.gin_file or [DEFAULT_GIN_FILE], bindings, FLAGS.gin_search_paths)
    run = trainer.Trainer(model_dir)
    batch = run.settings.global_batch_size
    dataset = run.settings.dataset_fn("train", global_batch_size=batch)
    length = dataset.element_spec[0]["tokens"].shape[1]
    pipeline = pipeline_tokens_per_second(dataset, FLAGS.steps)
    run.train(max_steps=FLAGS.steps)  # warm-up: tracing and XLA compilation
    # The trainer times its host loop alone (no set-up, no checkpoint).
    step = run.train(max_steps=FLAGS.steps)["steps_per_sec"] * batch * length
    print(f"{FLAGS.gin_file}: batch {batch} x {length} tokens")
    print(f"input pipeline alone: {pipeline:,.0f} tokens/s")
    print(f"train step:           {step:,.0f} tokens/s")
    print(f"pipeline / step:      {pipeline / step:.1f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
