"""A tiny ViT run on the shapes task, small enough for a unit test to train in seconds.

The same run is given two ways from one set of numbers: `TRAINER_ARGS` for an in-process `Trainer`,
and `GIN_FLAGS` for `python -m framework.train` (on top of quickstart.gin), so that tests can
compare a run of the binary with one built in the test.
"""

import functools
import os

from framework.data import text
from framework.data.images import synthetic
from framework.models import VisionTransformer
from framework.models.language import DecoderLM

MODEL = dict(image_size=8, patch_size=4, num_classes=4, dim=16, depth=2, num_heads=2, mlp_dim=32)
DATA = dict(image_size=8, num_classes=4, eval_examples=64)
# No FLOP counting (an XLA lowering and a CPU benchmark per run): test_flops.py tests it.
TRAINING = dict(
    global_batch_size=16, steps_per_loop=5, learning_rate=3e-3, warmup_steps=2, count_flops=False
)

model_fn = functools.partial(VisionTransformer, **MODEL)
dataset_fn = functools.partial(synthetic.shapes, **DATA)

TRAINER_ARGS = dict(model_fn=model_fn, dataset_fn=dataset_fn, **TRAINING)

GIN_FLAGS = [
    "--gin_file=quickstart.gin",
    *(f"--gin.Trainer.{name}={value}" for name, value in TRAINING.items()),
    *(f"--gin.data.shapes.{name}={value}" for name, value in DATA.items()),
    *(f"--gin.models.VisionTransformer.{name}={value}" for name, value in MODEL.items()),
]


def vit_with_dropout(**overrides) -> dict:
    """The tiny ViT with dropout 0.1 (`overrides` for the model): a Trainer's model and data."""
    model = functools.partial(VisionTransformer, **MODEL, dropout=0.1, **overrides)
    return dict(model_fn=model, dataset_fn=dataset_fn)


def decoder_with_dropout(work_dir: str, lines: int = 60) -> dict:
    """A tiny decoder LM with dropout 0.1 on `lines` lines of generated text written into
    `work_dir` (with the vocabulary learned from them): a Trainer's model and data."""
    corpus_file = os.path.join(work_dir, "corpus.txt")
    with open(corpus_file, "w") as f:
        f.write("\n".join(f"the quick brown fox jumps over the dog {i % 7}" for i in range(lines)))
    corpus = text.TextCorpus(
        files=corpus_file,
        vocab_path=os.path.join(work_dir, "vocab.txt"),
        vocab_size=128,
        sequence_length=16,
        document_per="line",
        eval_fraction=0.3,
        log_stats=False,
    )
    model = functools.partial(
        DecoderLM,
        vocab_size=128,
        max_length=16,
        dim=32,
        depth=2,
        num_heads=4,
        mlp_dim=48,
        dropout=0.1,
    )
    return dict(model_fn=model, dataset_fn=functools.partial(text.text_lm, corpus=corpus))
