"""framework.trainer.actions: the built-in loop actions and the user's own, in Python and gin."""

from __future__ import annotations

import logging
import os
import types

import gin
import pytest

from framework.core.errors import TrainerError
from framework.trainer import Trainer, actions
from tests import tiny


class RecordLoops:
    """A user's action: remembers the step, the metrics and the checkpoints it saw."""

    def __init__(self):
        self.seen = []

    def __call__(self, loop, metrics):
        directory = os.path.join(loop.model_dir, "checkpoints")
        saved = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        self.seen.append((loop.step, set(metrics), [f for f in saved if f.endswith(".index")]))


@pytest.mark.slow
def test_actions_run_after_every_loop_in_order(tmp_path, caplog):
    record = RecordLoops()
    trainer = Trainer(
        str(tmp_path),
        **{**tiny.TRAINER_ARGS, "train_steps": 15, "checkpoint_every": 10, "eval_every": 5},
        actions=[record],
    )
    with caplog.at_level(logging.INFO):
        trainer.train()
    steps = [step for step, _, _ in record.seen]
    assert steps == [5, 10, 15]
    assert all({"loss", "accuracy", "steps_per_sec"} <= keys for _, keys, _ in record.seen)
    # Built-in actions ran first: the checkpoint of step 10 exists when the user's action runs.
    assert [saved for _, _, saved in record.seen] == [[], ["ckpt-10.index"], ["ckpt-10.index"]]
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "ckpt-15.index"  # the loop's end
    evaluated = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval at")]
    assert [m.split(":")[0] for m in evaluated] == ["eval at step 5", "eval at step 10"]
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [m.split(":")[0] for m in progress] == ["step 5/15", "step 10/15", "step 15/15"]
    assert all("ETA 0:00:" in m for m in progress)


@gin.configurable(module="test")
class StopAt:
    """A user's action bound by gin: asks the loop to stop at a step (early stopping)."""

    def __init__(self, step: int = gin.REQUIRED):
        self.step = step

    def __call__(self, loop, metrics):
        if loop.step >= self.step:
            loop.stop(f"reached step {self.step}")


@pytest.mark.slow
def test_an_action_bound_by_gin_stops_the_run_which_saves_where_it_stopped(tmp_path, caplog):
    gin.clear_config()
    try:
        gin.parse_config(["Trainer.actions = [@test.StopAt()]", "test.StopAt.step = 10"])
        trainer = Trainer(str(tmp_path), **{**tiny.TRAINER_ARGS, "train_steps": 20})
    finally:
        gin.clear_config()
    with caplog.at_level(logging.INFO):
        trainer.train()
    assert trainer.step == 10
    assert "stopped at step 10: reached step 10" in caplog.text
    saved = {f for f in os.listdir(tmp_path / "checkpoints") if f.endswith(".index")}
    assert saved == {"ckpt-5.index", "ckpt-10.index"}


def test_save_checkpoints_and_evaluate_follow_their_intervals():
    class Fake:
        step, saved, evaluated = 0, 0, 0
        settings = types.SimpleNamespace(train_steps=20)

        def save(self):
            self.saved += 1

        def evaluate(self):
            self.evaluated += 1

    fake = Fake()
    save, evaluate = actions.SaveCheckpoints(4), actions.Evaluate(10)
    for fake.step in range(1, 21):
        save(fake, {})
        evaluate(fake, {})
    assert fake.saved == 5  # steps 4, 8, 12, 16, 20
    assert fake.evaluated == 1  # step 10 (20 is the last step: train_and_evaluate evaluates it)


@pytest.mark.parametrize("latest", [None, "ckpt-5"])
def test_a_loss_never_finite_points_at_the_data_before_the_learning_rate(latest):
    """Labels outside the model's classes give a nan loss from the first step; the error only
    named the learning rate. Once a finite checkpoint exists, the data hint is left out."""

    class Diverged:
        step = 5

        def state_is_finite(self):
            return True

        def newest_finite_checkpoint(self):
            return latest

    with pytest.raises(TrainerError) as raised:
        actions.StopDivergence()(Diverged(), {"loss": float("nan")})
    assert ("labels outside the model's classes" in str(raised.value)) == (latest is None)
    assert "Lower Trainer.learning_rate" in str(raised.value)
