"""A model_dir that is not a local path: train, resume, plan and sample, all through tf.io.gfile.

TPU pods keep their runs on Cloud Storage. TensorFlow's GCS filesystem cannot be pointed at a
local emulator, so this uses its `ram://` filesystem, which takes the same `tf.io.gfile` paths
(and lives in one process: the whole life of the run happens in one child process). Anything
still written with `open`, `os` or `pathlib` would create a local directory named `ram:`.

The planner's measurements run in processes of their own that never touch the model_dir; what
`framework.planner` does there (`prepare_model_dir`, `write_plan`) is done here on a plan judged
from given measurements.
"""

import pytest

from tests.subprocesses import REPO_DIR, run_python

pytestmark = pytest.mark.slow  # subprocesses: the full tier only

SCRIPT = """
import json, os
import gin
import tensorflow as tf
from absl import flags
from framework import cli, planner, sample, train

MODEL_DIR = "ram://runs/lm"
BINDINGS = [
    "Trainer.train_steps = 4",
    "Trainer.steps_per_loop = 2",
    "Trainer.global_batch_size = 4",
    "Trainer.eval_every = None",
    "Trainer.count_flops = False",
    "SEQUENCE_LENGTH = 32",
    "VOCAB_SIZE = 256",
    "data.TextCorpus.vocab_documents = 20",
    f"data.TextCorpus.vocab_path = '{MODEL_DIR}/vocab.txt'",
]
flags.FLAGS(["test", "--gin_file=lm_quickstart.gin", f"--model_dir={MODEL_DIR}", "--mode=train"])
before = sorted(os.listdir("."))

flags.FLAGS.gin_bindings = BINDINGS
assert train.main(["test"]) == 0
gin.clear_config()
flags.FLAGS.gin_bindings = [*BINDINGS, "Trainer.train_steps = 6"]  # resumes from step 4
assert train.main(["test"]) == 0
gin.clear_config()
cli.prepare_model_dir(MODEL_DIR)
measured = planner.Measurement("none", 4, peak_bytes=2**20, live_before_bytes=0, step_seconds=1)
planner.write_plan(planner.choose([measured], 2**30), MODEL_DIR)
model, vocab = sample.load_run(MODEL_DIR)
text = sample.generate(model, vocab, "the", max_tokens=3, temperature=0)

names = ["config.gin", "command", "vocab.txt", "LOCK", "plan.json", "plan.png"]
print(json.dumps({
    "files": {name: tf.io.gfile.exists(f"{MODEL_DIR}/{name}") for name in names},
    "checkpoints": sorted(tf.io.gfile.listdir(f"{MODEL_DIR}/checkpoints")),
    "summaries": bool(tf.io.gfile.listdir(f"{MODEL_DIR}/train")),
    "sampled": isinstance(text, str) and text.startswith("the"),
    "new_local_entries": sorted(set(os.listdir(".")) - set(before)),
}))
"""


def test_train_resume_plan_and_sample_on_a_non_local_filesystem():
    result = run_python(f"import os; os.chdir({str(REPO_DIR)!r})\n" + SCRIPT, timeout=600)
    assert all(result["files"].values()), result["files"]
    assert {"ckpt-4.index", "ckpt-6.index", "checkpoint"} <= set(result["checkpoints"]), result
    assert result["summaries"] and result["sampled"], result
    assert result["new_local_entries"] == [], result
