"""Reproducible runs. A resumed run is the run that was never interrupted: the same weights, bit
for bit on CPU; and the determinism check finds where two copies of a run part, if they do.

Each case trains a model with dropout straight to the end, and again with an interruption: a
crash between two periodic saves (the steps after the last save are trained again) and, for
the ViT, a SIGTERM (the preemption path saves where it stops). The resumed runs must end on the
weights and random state of the straight run - under `one_device` and `mirrored` over 2 logical
CPUs, for the ViT, the scanned ViT and the decoder LM. Without the model's random state in the
checkpoints, a restart draws other dropout masks and the weights end up to 6e-3 apart.
"""

import functools
import itertools

import pytest

from framework.models import VisionTransformer
from framework.trainer import Trainer, determinism
from tests import tiny
from tests.subprocesses import run_binary, run_python

pytestmark = pytest.mark.slow  # subprocesses: the full tier only

SCRIPT = """
    import functools, json, os, signal, tempfile
    import numpy as np
    from framework.runtime import distribute
    from framework.data import text
    from framework.models import VisionTransformer
    from framework.models.language import DecoderLM
    from framework.runtime import Runtime
    from framework.trainer import Trainer
    from tests import tiny

    distribute.split_cpu(2)  # before TensorFlow initialises its devices
    work = tempfile.mkdtemp()
    corpus_file = os.path.join(work, "corpus.txt")
    with open(corpus_file, "w") as f:
        f.write("\\n".join(f"the quick brown fox jumps over the dog {{i % 7}}" for i in range(60)))
    corpus = text.TextCorpus(
        files=corpus_file, vocab_path=os.path.join(work, "vocab.txt"), vocab_size=128,
        sequence_length=16, document_per="line", eval_fraction=0.3, log_stats=False,
    )
    MODELS = {{
        "vit": dict(model_fn=functools.partial(VisionTransformer, **tiny.MODEL, dropout=0.1),
                    dataset_fn=tiny.dataset_fn),
        "scanned": dict(model_fn=functools.partial(
            VisionTransformer, **tiny.MODEL, dropout=0.1, scan_layers=True),
            dataset_fn=tiny.dataset_fn),
        "decoder": dict(model_fn=functools.partial(
            DecoderLM, vocab_size=128, max_length=16, dim=32, depth=2, num_heads=4, mlp_dim=48,
            dropout=0.1), dataset_fn=functools.partial(text.text_lm, corpus=corpus)),
    }}

    class Crash(Exception):
        pass

    def crash_at(step):
        def action(loop, metrics):
            if loop.step == step:
                raise Crash()
        return action

    def sigterm_at(step):
        def action(loop, metrics):
            if loop.step == step:
                os.kill(os.getpid(), signal.SIGTERM)
        return action

    def state(trainer):
        return [v.numpy() for v in trainer.model.variables]

    def run(model, strategy, model_dir, **settings):
        args = {{**tiny.TRAINER_ARGS, **MODELS[model], "steps_per_loop": 2, "checkpoint_every": 4,
                 "train_steps": 12, "runtime": Runtime(strategy, cpu_devices=2), **settings}}
        return Trainer(model_dir, **args)

    def differences(a, b):
        return max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b))

    result = {{}}
    for model in [{model!r}]:
        for strategy in ("one_device", "mirrored"):
            case = f"{{model}}/{{strategy}}"
            straight = run(model, strategy, None)
            straight.train()
            want = state(straight)
            crashed = os.path.join(work, case, "crash")
            try:
                run(model, strategy, crashed, actions=[crash_at(6)]).train()
            except Crash:
                pass
            resumed = run(model, strategy, crashed)
            result[case + "/crash_restored"] = resumed.step
            saved = resumed.run_state.saved_data_position
            result[case + "/crash_position"] = None if saved is None else saved.tolist()
            resumed.train()
            result[case + "/crash"] = differences(state(resumed), want)
            if not {sigterm}:
                continue
            stopped = os.path.join(work, case, "sigterm")
            try:
                run(model, strategy, stopped, actions=[sigterm_at(6)]).train()
            except Exception as error:
                result[case + "/sigterm_error"] = type(error).__name__
            resumed = run(model, strategy, stopped)
            result[case + "/sigterm_restored"] = resumed.step
            resumed.train()
            result[case + "/sigterm"] = differences(state(resumed), want)
    print(json.dumps(result))
"""


@pytest.mark.parametrize("model", ["vit", "scanned", "decoder"])
def test_interrupted_and_resumed_runs_equal_the_uninterrupted_one_bit_for_bit(model):
    # One process per model: TensorFlow's collectives mix up the ops of many mirrored
    # strategies built in one process. SIGTERM on the ViT only (the same save path).
    sigterm = model == "vit"
    result = run_python(SCRIPT.format(model=model, sigterm=sigterm), timeout=600)
    for strategy in ("one_device", "mirrored"):
        case = f"{model}/{strategy}"
        assert result[f"{case}/crash_restored"] == 4, result  # the save before the crash
        assert result[f"{case}/crash"] == 0.0, result
        # The text stream resumed from its saved position (step 4's), not by reading up to it.
        if model == "decoder":
            [(step, *where)] = result[f"{case}/crash_position"]
            assert step == 4 and min(where[:5]) >= 0, result
        else:  # image streams are addressed by the step: no position is saved
            assert result[f"{case}/crash_position"] is None, result
        if sigterm:
            assert result[f"{case}/sigterm_error"] == "PreemptedError", result
            assert 6 < result[f"{case}/sigterm_restored"] < 12, result  # saved after SIGTERM
            assert result[f"{case}/sigterm"] == 0.0, result


def tiny_run(**overrides) -> Trainer:
    model_fn = functools.partial(VisionTransformer, **tiny.MODEL, dropout=0.1)
    return Trainer(None, **{**tiny.TRAINER_ARGS, "model_fn": model_fn, **overrides})


def test_two_copies_of_a_run_are_bit_identical_and_a_difference_is_found():
    assert determinism.first_difference(tiny_run, 3) is None
    rates = itertools.cycle([3e-3, 3.0001e-3])  # the second copy: another learning rate
    found = determinism.first_difference(lambda: tiny_run(learning_rate=next(rates)), 3)
    assert found is not None and found.step <= 2 and found.max_abs > 0, found  # (warm-up)


def test_the_binary_checks_determinism_and_says_so():
    flags = [*tiny.GIN_FLAGS, "--gin.models.VisionTransformer.dropout=0.1"]
    run = run_binary(*flags, "--check_determinism=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "determinism check: 2 steps of two copies of the run: bit-identical" in run.stderr
