"""Sharded state on 2 local workers (multi_worker_mirrored, real processes): the ViT at the
"weights" level and the decoder LM at the "gradients" level (dropout, remat, micro-batches,
clipping) train as the same runs unsharded, and their checkpoints are the unsharded runs' (keys,
shapes), gathered across the workers.

Same tolerance as on logical CPUs (test_replicas.py): the clipping norm is summed in another
order, so every saved value stays within 1e-5 of the unsharded run's after 4 steps.
"""

import pathlib

import numpy as np
import pytest
import tensorflow as tf

from framework.data import text
from tests import tiny
from tests.runtime.test_multi_worker import start_cluster

pytestmark = pytest.mark.slow  # subprocesses: the full tier only

STEP = [
    "--gin.Trainer.train_steps=4",
    "--gin.Trainer.steps_per_loop=2",
    "--gin.Trainer.remat_policy='nothing_saveable'",
    "--gin.Trainer.microbatches=2",
    "--gin.Trainer.clip_norm=0.05",
    "--gin.Trainer.eval_every=None",
]


def flags(model: str, work: pathlib.Path) -> list[str]:
    if model == "vit":
        return [*tiny.GIN_FLAGS, "--gin.models.VisionTransformer.dropout=0.1", *STEP]
    corpus = dict(files=text.SAMPLE_CORPUS, vocab_path=str(work / "vocab.txt"))
    text.TextCorpus(**corpus, vocab_size=256).vocab()  # learned once, not by both workers
    return [
        "--gin_file=lm_quickstart.gin",
        *(f"--gin.data.TextCorpus.{name}='{value}'" for name, value in corpus.items()),
        "--gin.VOCAB_SIZE=256",
        "--gin.SEQUENCE_LENGTH=32",
        "--gin.Trainer.global_batch_size=8",
        *STEP,
    ]


def train(model_dir: pathlib.Path, run: list[str], level: str) -> dict:
    cluster = start_cluster(model_dir, f"--gin.Trainer.shard_state='{level}'", run=run)
    output = cluster.communicate(timeout=600)[0]
    assert cluster.returncode == 0, output[-3000:]
    assert f"sharded state {level}" in output
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints" / "ckpt-4"))
    return {key: np.asarray(reader.get_tensor(key)) for key in reader.get_variable_to_shape_map()}


@pytest.mark.parametrize("model, level", [("vit", "weights"), ("decoder", "gradients")])
def test_two_workers_train_sharded_state_as_unsharded_and_save_it_whole(model, level, tmp_path):
    run = flags(model, tmp_path)
    unsharded = train(tmp_path / "plain", run, "none")
    sharded = train(tmp_path / "sharded", run, level)
    assert {k: v.shape for k, v in sharded.items()} == {k: v.shape for k, v in unsharded.items()}
    floats = [k for k, v in unsharded.items() if np.issubdtype(v.dtype, np.floating)]
    assert len(floats) > 10
    largest = max(float(np.max(np.abs(sharded[k] - unsharded[k]))) for k in floats)
    assert largest < 1e-5, largest
