"""Sharded state over several replicas and workers trains as the unsharded run does, and its
checkpoints restore into other replica counts.

Each process trains the tiny ViT and a tiny decoder LM (dropout on, remat, micro-batches,
gradient clipping) sharded and unsharded on N logical CPUs (one process per N: the runs share
its strategy): every level on 2 replicas, "gradients" and "weights" on 4 (the decoder),
"weights" on 8 (the ViT, without remat and micro-batches: each replica traces and compiles its
own step, a minute per run on 2 cores). Tolerance: the clipping norm is summed in
another order (per part, then over replicas, instead of per weight), so a clipped step can
differ in float32's last bits; after 4 steps every value of the model and the optimizer (about
1 in magnitude) stays within 1e-5 of the unsharded run's. Without clipping the runs are bit
for bit the same (test_training.py). Several workers: test_workers.py.
"""

import pytest

from tests.subprocesses import run_python

pytestmark = pytest.mark.slow  # subprocesses: the full tier only

COMMON = """
    import json, os, tempfile
    import numpy as np
    from framework.runtime import Runtime, distribute
    from framework.trainer import Trainer
    from tests import tiny

    MODELS = {{
        "vit": tiny.vit_with_dropout(),
        "decoder": tiny.decoder_with_dropout(tempfile.mkdtemp(), lines=80),
    }}

    FULL_STEP = {{"remat_policy": "nothing_saveable", "microbatches": 2}}

    def trainer(model, model_dir=None, **settings):
        args = {{**tiny.TRAINER_ARGS, **MODELS[model], "global_batch_size": 16,
                 "train_steps": 4, "steps_per_loop": 4, "clip_norm": 0.05, "runtime": RUNTIME,
                 **settings}}
        return Trainer(model_dir, **args)

    def state(t):
        whole = t.sharded.checkpoint_replacements() if t.sharded else {{}}
        variables = t.model.variables + t.optimizer.variables
        return [np.asarray(whole[id(v)].read() if id(v) in whole else v.numpy())
                for v in variables]

    def difference(a, b):
        assert [x.shape for x in a] == [y.shape for y in b]
        return max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b))
"""

LEVELS_SCRIPT = (
    COMMON
    + """
    distribute.split_cpu({replicas})
    RUNTIME = Runtime("mirrored", cpu_devices={replicas})
    step = FULL_STEP if {full_step!r} else {{}}
    result = {{}}
    for model, levels in {runs!r}.items():
        plain = trainer(model, **step)
        plain.train()
        want = state(plain)
        for level in levels:
            model_dir = os.path.join({out!r}, f"{{model}}-{{level}}")
            sharded = trainer(model, model_dir, shard_state=level, **step)
            assert sharded.strategy.num_replicas_in_sync == {replicas}
            sharded.train()
            if level == "weights":  # one copy on the host, not one per replica's device
                kinds = {{type(v.value).__name__ for v in sharded.model.trainable_variables}}
                assert kinds == {{"ResourceVariable"}}, kinds
            got = state(sharded)
            result[f"{{model}}/{{level}}"] = difference(got, want)
            np.savez(model_dir + ".npz", *got)
    print(json.dumps(result))
"""
)

RESTORE_SCRIPT = (
    COMMON
    + """
    distribute.split_cpu({replicas})
    RUNTIME = Runtime("mirrored", cpu_devices={replicas})
    result = {{}}
    for case, level in {cases!r}:
        model = case.split("-")[0]
        saved = np.load(os.path.join({out!r}, case + ".npz"))
        restored = trainer(model, os.path.join({out!r}, case), shard_state=level, **FULL_STEP)
        result[f"{{case}}->{{level}}"] = [
            restored.step, difference(state(restored), [saved[k] for k in saved.files])
        ]
    print(json.dumps(result))
"""
)


def levels(replicas: int, runs: dict, out, full_step: bool = True) -> dict:
    script = LEVELS_SCRIPT.format(replicas=replicas, runs=runs, out=str(out), full_step=full_step)
    return run_python(script, timeout=900)


def test_two_replicas_train_every_level_as_the_unsharded_run(tmp_path):
    every = ["optimizer", "gradients", "weights"]
    result = levels(2, {"vit": every, "decoder": every}, tmp_path)
    assert len(result) == 6 and max(result.values()) < 1e-5, result


def test_four_replicas_train_as_the_unsharded_run_and_their_checkpoints_restore_into_two(
    tmp_path,
):
    result = levels(4, {"decoder": ["gradients", "weights"]}, tmp_path)
    assert len(result) == 2 and max(result.values()) < 1e-5, result
    # The 4-replica checkpoints, into 2 replicas: unsharded, and at other levels.
    cases = [
        ("decoder-weights", "none"),
        ("decoder-weights", "optimizer"),
        ("decoder-gradients", "weights"),
    ]
    script = RESTORE_SCRIPT.format(replicas=2, cases=cases, out=str(tmp_path))
    restored = run_python(script, timeout=600)
    assert len(restored) == 3
    for case, (step, difference) in restored.items():
        assert step == 4 and difference == 0.0, (case, restored)


def test_eight_replicas_gather_their_weights_as_the_unsharded_run(tmp_path):
    result = levels(8, {"vit": ["weights"]}, tmp_path, full_step=False)
    assert result["vit/weights"] < 1e-5, result


KERAS_OPTIMIZER_SCRIPT = (
    COMMON
    + """
    import keras
    from framework.trainer import optim
    distribute.split_cpu(2)
    RUNTIME = Runtime("mirrored", cpu_devices=2)
    result = {{}}
    for level in ("none", "weights"):
        states = []
        for make in (lambda rate, _: optim.sgd(rate, momentum=0.5),
                     lambda rate, _: keras.optimizers.SGD(rate, momentum=0.5)):
            run = trainer("vit", shard_state=level, optimizer_fn=make, clip_norm=None)
            run.train()
            states.append(state(run))
        result[level] = difference(*states)
    print(json.dumps(result))
"""
)


def test_a_keras_optimizer_trains_as_the_trainers_own_on_two_replicas():
    """`keras.optimizers.SGD` as `optimizer_fn`, against `optim.sgd`: Keras' own classes would sum
    the trainer's summed gradients again (twice as large on 2 replicas; sharded, the sum of
    different replicas' parts)."""
    result = run_python(KERAS_OPTIMIZER_SCRIPT.format(), timeout=600)
    assert result == {"none": 0.0, "weights": 0.0}, result


UNBUILT_SCRIPT = """
    import json
    import keras
    import numpy as np
    from framework.runtime import Runtime, distribute
    from framework.trainer import Trainer
    from tests import tiny
    distribute.split_cpu(2)
    RUNTIME = Runtime("mirrored", cpu_devices=2)

    def sequential(given_input):
        layers = [keras.layers.Flatten(), keras.layers.Dense(16, "relu"), keras.layers.Dense(4)]
        return keras.Sequential([keras.Input((8, 8, 3)), *layers] if given_input else layers)

    states = {}
    for level, given_input in (("none", True), ("weights", False)):
        run = Trainer(None, **{**tiny.TRAINER_ARGS, "train_steps": 4, "runtime": RUNTIME,
                               "model_fn": lambda: sequential(given_input), "shard_state": level})
        run.train()
        whole = run.sharded.checkpoint_replacements() if run.sharded else {}
        states[level] = [np.asarray(whole[id(v)].read() if id(v) in whole else v.numpy())
                         for v in run.model.trainable_variables]
    pairs = list(zip(states["none"], states["weights"]))
    print(json.dumps({"weights": len(pairs),
                      "difference": max(float(np.max(np.abs(a - b))) for a, b in pairs)}))
"""


def test_a_model_without_weights_is_built_where_sharded_weights_live():
    """A `keras.Sequential` without an `Input`, built by the trainer on the data's features,
    sharded at "weights" on 2 replicas (its weights made on the host), trains as the same model
    given its input shape, unsharded (clipped by the norm: the module docstring's tolerance)."""
    result = run_python(UNBUILT_SCRIPT, timeout=600)
    assert result["weights"] == 4 and result["difference"] < 1e-5, result
