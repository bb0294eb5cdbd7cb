"""Strategies: `mirrored` over logical CPU devices must train exactly like `one_device`."""

import pytest

from framework import distribute
from tests.subprocesses import run_python

EQUALITY_SCRIPT = """
    import json, tempfile
    from framework import distribute
    from framework.trainer import Trainer
    from tests import tiny

    distribute.split_cpu({devices})  # before TensorFlow initialises its devices
    losses = {{}}
    for strategy in ("one_device", "mirrored"):
        trainer = Trainer(tempfile.mkdtemp(), strategy=strategy, cpu_devices={devices},
                          train_steps=10, **tiny.TRAINER_ARGS)
        trainer.train()
        losses[strategy] = float(trainer.evaluate()["loss"])
        losses[strategy + "_replicas"] = trainer.strategy.num_replicas_in_sync
    print(json.dumps(losses))
"""


@pytest.mark.parametrize("devices", [2, 4])
def test_mirrored_reaches_the_same_loss_as_one_device(devices):
    losses = run_python(EQUALITY_SCRIPT.format(devices=devices))
    assert losses["mirrored_replicas"] == devices and losses["one_device_replicas"] == 1
    relative = abs(losses["mirrored"] - losses["one_device"]) / losses["one_device"]
    assert relative < 1e-4, losses


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ValueError, match="one_device, mirrored"):
        distribute.create_strategy("tpu_v9")
