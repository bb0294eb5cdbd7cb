"""A resumed run is the run that was never interrupted: the same weights, bit for bit on CPU.

Each case trains a model with dropout straight to the end, and again with an interruption: a
crash between two periodic saves (the steps after the last save are trained again) and, for
the ViT, a SIGTERM (the preemption path saves where it stops). The resumed runs must end on the
weights, optimizer state and random state of the straight run - under `one_device` and
`mirrored` over 2 logical CPUs, for the ViT, the scanned ViT and the decoder LM, and for the
ViT with its state sharded. Without the model's random state in the
checkpoints, a restart draws other dropout masks and the weights end up to 6e-3 apart.
"""

import pytest

from tests.subprocesses import run_python

pytestmark = pytest.mark.slow  # subprocesses: the full tier only

SCRIPT = """
    import json, os, signal, tempfile
    import numpy as np
    from framework.runtime import distribute
    from framework.runtime import Runtime
    from framework.trainer import Trainer
    from tests import tiny

    distribute.split_cpu(2)  # before TensorFlow initialises its devices
    work = tempfile.mkdtemp()
    MODELS = {{
        "vit": tiny.vit_with_dropout(),
        "scanned": tiny.vit_with_dropout(scan_layers=True),
        "decoder": tiny.decoder_with_dropout(work),
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
        whole = trainer.sharded.checkpoint_replacements() if trainer.sharded else {{}}
        variables = trainer.model.variables + trainer.optimizer.variables
        return [np.asarray(whole[id(v)].read() if id(v) in whole else v.numpy())
                for v in variables]

    def run(model, strategy, model_dir, **settings):
        args = {{**tiny.TRAINER_ARGS, **MODELS[model], "steps_per_loop": 2, "checkpoint_every": 4,
                 "train_steps": 12, "runtime": Runtime(strategy, cpu_devices=2),
                 "shard_state": {shard_state!r}, **settings}}
        return Trainer(model_dir, **args)

    def differences(a, b):
        return max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b))

    result = {{}}
    for model in [{model!r}]:
        for strategy in {strategies!r}:
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


def check_resumed(result: dict, model: str, strategies: tuple, sigterm: bool) -> None:
    for strategy in strategies:
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


@pytest.mark.parametrize("model", ["vit", "scanned", "decoder"])
def test_interrupted_and_resumed_runs_equal_the_uninterrupted_one_bit_for_bit(model):
    # One process per model: TensorFlow's collectives mix up the ops of many mirrored
    # strategies built in one process. SIGTERM on the ViT only (the same save path).
    sigterm, strategies = model == "vit", ("one_device", "mirrored")
    script = SCRIPT.format(model=model, sigterm=sigterm, strategies=strategies, shard_state="none")
    check_resumed(run_python(script, timeout=600), model, strategies, sigterm)


def test_a_sharded_run_resumes_bit_for_bit_after_a_crash_and_a_preemption():
    """Its checkpoints hold whole values, gathered from the replicas' parts at each save (the
    preemption handler's too), and a restore gives each replica its part again."""
    strategies = ("mirrored",)
    script = SCRIPT.format(model="vit", sigterm=True, strategies=strategies, shard_state="weights")
    check_resumed(run_python(script, timeout=600), "vit", strategies, sigterm=True)
