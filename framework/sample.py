"""Generates text from a trained decoder LM: `python -m framework.sample --model_dir=DIR`.

The model is rebuilt the way the run built it, from the run's own `DIR/config.gin`, with the
weights of the newest checkpoint in `DIR/checkpoints` (`framework.trained_model`, which refuses the
config's `import` and `include` lines rather than run them, but for imports of the modules given
to `--trusted_imports`). Text is tokenized with the run's
vocabulary: `DIR/vocab.txt` (where the trainer learns it), else the file the run's config names
(`data.TextCorpus.vocab_path` or `data.TfdsText.vocab_path`).

Each new token costs one forward pass over a fixed window of `max_length` tokens (one compiled
program, no retracing); longer contexts keep their last `max_length` tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from absl import flags

from framework import cli
from framework.core.errors import UsageError, UserError

cli.define_model_dir_flag("The training run's model directory (required).")
cli.define_trusted_imports_flag()
flags.DEFINE_string("prompt", "", "Text to continue; empty starts a new document.")
flags.DEFINE_float(
    "temperature", 0.8, "Sampling temperature; 0 picks the likeliest token.", lower_bound=0.0
)
cli.require_a_number("temperature")
flags.DEFINE_integer(
    "max_tokens", 64, "Tokens to generate (fewer if [EOS] comes first).", lower_bound=1
)
flags.DEFINE_integer("seed", 0, "Seed of the sampling.")
flags.adopt_module_key_flags(cli)
flags.declare_key_flag("verbosity")
FLAGS = flags.FLAGS


class SampleError(UserError):
    """The run is not a decoder LM, or has no vocabulary that fits its model."""


def load_run(model_dir: str, trusted_imports: Sequence[str] = ()):
    """(model with the newest checkpoint's weights, vocabulary) of the run in `model_dir`; the
    run's config may import `trusted_imports`."""
    import tensorflow as tf

    from framework import trained_model
    from framework.data.text import vocab as vocab_lib
    from framework.models.language import DecoderLM

    model = trained_model.load(model_dir, trusted_imports=trusted_imports).model
    if not isinstance(model, DecoderLM):
        raise SampleError(
            f"the run in {model_dir} trained a {type(model).__name__}, not a decoder language "
            "model (DecoderLM, as lm_quickstart.gin trains): framework.sample cannot continue "
            "text with it"
        )
    vocab_path = os.path.join(model_dir, cli.VOCAB_FILE)
    if not tf.io.gfile.exists(vocab_path):  # another file: the run's config names it
        named = [cli.bound_value(name) for name in cli.vocab_path_names()]
        vocab_path = next((path for path in named if path is not None), vocab_path)
    if not tf.io.gfile.exists(vocab_path):
        raise SampleError(f"the run's vocabulary {vocab_path} is missing")
    vocab = vocab_lib.load_vocab(vocab_path)
    if len(vocab) > model.vocab_size:
        raise SampleError(
            f"the vocabulary {vocab_path} has {len(vocab)} tokens, more than the model's "
            f"{model.vocab_size}: it is not the run's (a relative vocab_path is read from the "
            "current directory; run from the directory the run was trained in)"
        )
    return model, vocab


def generate(
    model,
    vocab: list[str],
    prompt: str = "",
    *,
    max_tokens: int = 64,
    temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """`prompt` continued by up to `max_tokens` tokens, stopping at [EOS] (spaces normalized)."""
    import tensorflow as tf

    from framework.data import text
    from framework.data.text import vocab as vocab_lib

    ids = vocab_lib.special_ids(vocab)
    tokenizer = text.make_tokenizer(vocab)
    context = [ids[vocab_lib.BOS], *text.tokenize(tokenizer, [prompt])[0].numpy().tolist()]
    length = model.max_length
    rng = tf.random.Generator.from_seed(seed)

    @tf.function(jit_compile=True)
    def next_logits(tokens, last):
        inputs = {
            "tokens": tokens,
            "segment_ids": tf.ones_like(tokens),
            "positions": tf.range(length)[None],
        }
        return model(inputs, training=False)[0, last]

    for _ in range(max_tokens):
        window = context[-length:]
        tokens = tf.constant([window + [ids[vocab_lib.PAD]] * (length - len(window))], tf.int32)
        # The model's vocabulary may be larger than the learned one (lm_quickstart.gin's 1024
        # against the tokens the corpus gave): ids past it have no text.
        logits = next_logits(tokens, tf.constant(len(window) - 1))[: len(vocab)]
        if temperature > 0:
            seed_pair = rng.make_seeds(1)[:, 0]
            token = int(tf.random.stateless_categorical([logits / temperature], 1, seed_pair)[0, 0])
        else:
            token = int(tf.argmax(logits))
        if token == ids[vocab_lib.EOS]:
            break
        context.append(token)
    # [UNK] stays in the text: a word of the prompt the vocabulary lacks, or one the model chose.
    markers = tuple(i for token, i in ids.items() if token != vocab_lib.UNK)
    return text.detokenize(tokenizer, [context], markers)[0].numpy().decode("utf-8")


def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.model_dir:
        raise UsageError("--model_dir is required")
    try:
        FLAGS.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("--prompt is not valid UTF-8 text: pass the prompt as UTF-8") from None
    try:
        model, vocab = load_run(FLAGS.model_dir, FLAGS.trusted_imports)
    except ValueError as error:
        raise UsageError(cli.first_line(error)) from None
    completion = generate(
        model,
        vocab,
        FLAGS.prompt,
        max_tokens=FLAGS.max_tokens,
        temperature=FLAGS.temperature,
        seed=FLAGS.seed,
    )
    print(completion)
    return 0


def console_main() -> None:
    """Entry point: `python -m framework.sample`, `framework-sample`."""
    cli.run(main)


if __name__ == "__main__":
    console_main()
