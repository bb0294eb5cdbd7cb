"""Sharded state on 2 replicas trains as the unsharded run does, at every level, with a Keras
optimizer and with a model the trainer builds (how and to what tolerance: replica_runs.py)."""

import pytest

from tests.shard.replica_runs import COMMON, levels
from tests.subprocesses import run_python

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def test_two_replicas_train_every_level_as_the_unsharded_run(tmp_path):
    every = ["optimizer", "gradients", "weights"]
    result = levels(2, {"vit": every, "decoder": every}, tmp_path)
    assert len(result) == 6 and max(result.values()) < 1e-5, result


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
