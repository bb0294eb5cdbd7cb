import functools
import os

import numpy as np
import pytest
import tensorflow as tf

from framework import remat as framework_remat
from framework.trainer import Trainer, TrainerError
from tests import tiny


def make_trainer(model_dir, **overrides) -> Trainer:
    return Trainer(str(model_dir), **{**tiny.TRAINER_ARGS, **overrides})


def test_trains_checkpoints_and_writes_summaries(tmp_path):
    trainer = make_trainer(tmp_path, train_steps=20)
    before = trainer.evaluate()["loss"]
    metrics = trainer.train()
    after = trainer.evaluate()["loss"]
    assert trainer.step == 20
    assert after < before
    assert set(metrics) >= {
        "loss",
        "accuracy",
        "grad_norm",
        "learning_rate",
        "steps_per_sec",
        "examples_per_sec",
    }
    assert tf.train.latest_checkpoint(tmp_path / "checkpoints").endswith("ckpt-20")
    for split in ("train", "eval"):
        assert os.listdir(tmp_path / split), f"no {split} summaries"


def test_resumes_where_it_stopped(tmp_path):
    first = make_trainer(tmp_path, train_steps=10)
    first.train()
    weights = [v.numpy() for v in first.model.trainable_variables]
    second = make_trainer(tmp_path, train_steps=15)
    assert second.step == 10
    for restored, saved in zip(second.model.trainable_variables, weights):
        np.testing.assert_array_equal(restored.numpy(), saved)
    second.train()
    assert second.step == 15


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    straight = make_trainer(tmp_path / "straight", train_steps=10)
    straight.train()
    make_trainer(tmp_path / "split", train_steps=10).train(max_steps=5)
    resumed = make_trainer(tmp_path / "split", train_steps=10)
    resumed.train()
    for a, b in zip(straight.model.trainable_variables, resumed.model.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_hundred_steps_trace_the_step_at_most_twice(tmp_path):
    trainer = make_trainer(tmp_path, train_steps=100, steps_per_loop=10, checkpoint_every=100)
    trainer.train()
    assert trainer.step == 100
    assert 1 <= trainer.traces["train_step"] <= 2


def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    make_trainer(tmp_path, train_steps=5).train()
    trainer = make_trainer(tmp_path, train_steps=10, learning_rate=1e30, clip_norm=None)
    with pytest.raises(TrainerError, match="diverged.*ckpt-5 is kept"):
        trainer.train()
    assert tf.train.latest_checkpoint(tmp_path / "checkpoints").endswith("ckpt-5")


def _non_finite_values(path: str) -> int:
    reader = tf.train.load_checkpoint(path)
    return sum(
        int(np.size(value) - np.isfinite(value).sum())
        for name in reader.get_variable_to_shape_map()
        if np.issubdtype((value := np.asarray(reader.get_tensor(name))).dtype, np.floating)
    )


@pytest.mark.parametrize("earlier_steps", [0, 2])
def test_a_diverging_run_never_saves_a_non_finite_checkpoint(tmp_path, earlier_steps):
    if earlier_steps:
        make_trainer(tmp_path, train_steps=earlier_steps, steps_per_loop=1).train()
    # An infinite learning rate makes the weights non-finite in the first update, whose loss (of
    # the weights before it) is finite: the state to save is broken, the loss does not show it.
    diverging = dict(steps_per_loop=1, checkpoint_every=1, clip_norm=None)
    trainer = make_trainer(tmp_path, train_steps=10, learning_rate=float("inf"), **diverging)
    with pytest.raises(TrainerError, match="diverged") as info:
        trainer.train()
    state = tf.train.get_checkpoint_state(tmp_path / "checkpoints")
    saved = list(state.all_model_checkpoint_paths) if state else []
    assert [os.path.basename(p) for p in saved] == [f"ckpt-{i + 1}" for i in range(earlier_steps)]
    assert all(_non_finite_values(path) == 0 for path in saved), saved
    newest = f"ckpt-{earlier_steps} is kept" if earlier_steps else "no finite checkpoint"
    assert newest in str(info.value), info.value
    # A restart with a sane learning rate continues from the newest checkpoint.
    again = make_trainer(tmp_path, train_steps=earlier_steps + 2, steps_per_loop=1)
    assert again.step == earlier_steps
    again.train()
    assert again.step == earlier_steps + 2


def test_corrupted_checkpoint_is_an_error_and_is_not_deleted(tmp_path):
    make_trainer(tmp_path, train_steps=5).train()
    data = [p for p in (tmp_path / "checkpoints").iterdir() if ".data-" in p.name][0]
    data.write_bytes(b"garbage")
    with pytest.raises(TrainerError, match="cannot restore checkpoint"):
        make_trainer(tmp_path, train_steps=10)
    assert data.read_bytes() == b"garbage"


def test_missing_checkpoint_files_are_an_error(tmp_path):
    make_trainer(tmp_path, train_steps=5).train()
    for path in (tmp_path / "checkpoints").iterdir():
        if path.name.startswith("ckpt-"):
            path.unlink()
    with pytest.raises(TrainerError, match="cannot restore checkpoint .*ckpt-5"):
        make_trainer(tmp_path, train_steps=10)


def test_finite_training_data_is_a_clear_error(tmp_path):
    def short_dataset(split, batch_size, **kwargs):
        return tiny.dataset_fn(split, batch_size, **kwargs).take(3)

    trainer = make_trainer(tmp_path, train_steps=10, dataset_fn=short_dataset)
    with pytest.raises(TrainerError, match="training data ran out"):
        trainer.train()


def test_empty_eval_data_is_a_clear_error(tmp_path):
    def no_eval(split, batch_size, **kwargs):
        return tiny.dataset_fn(split, batch_size, **kwargs).take(0)

    with pytest.raises(TrainerError, match="eval data set is empty"):
        make_trainer(tmp_path, dataset_fn=no_eval).evaluate()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"precision": "float8"}, "unknown precision"),
        ({"strategy": "magic"}, "unknown strategy"),
        ({"train_steps": 0}, "must be positive"),
        ({"xla_flags": ["xla_dump_to=/tmp"]}, "must start with '--'"),
    ],
)
def test_bad_settings_are_clear_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, **overrides)


def test_bfloat16_precision_trains(tmp_path):
    trainer = make_trainer(tmp_path, train_steps=5, precision="bfloat16")
    try:
        assert trainer.model.blocks[0].attention.qkv.compute_dtype == "bfloat16"
        assert np.isfinite(trainer.train()["loss"])
    finally:
        make_trainer(tmp_path / "reset", train_steps=1)  # restores the float32 policy


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_remat_policy_trains_exactly_like_no_remat_with_dropout(tmp_path, policy):
    model_fn = functools.partial(tiny.model_fn, dropout=0.2)
    plain = make_trainer(tmp_path / "plain", train_steps=5, model_fn=model_fn)
    plain.train()
    remat = make_trainer(tmp_path / policy, train_steps=5, model_fn=model_fn, remat_policy=policy)
    assert len(framework_remat.checkpointed_layers(remat.model)) == 2
    remat.train()
    # Equal up to float rounding, which Adam amplifies for gradients near zero (up to 2e-6 here);
    # a different dropout mask moves most weights by about the learning rate (3e-3) per step.
    for a, b in zip(plain.model.trainable_variables, remat.model.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


def test_unknown_remat_policy_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match="Unknown remat policy 'most'.*dots_saveable"):
        make_trainer(tmp_path, remat_policy="most")


def test_weighted_targets_count_only_where_weight_is_one(tmp_path):
    def half_weighted(split, batch_size, **kwargs):
        dataset = tiny.dataset_fn(split, batch_size, **kwargs)
        return dataset.map(lambda x, y: (x, y, tf.cast(tf.range(batch_size) % 2, tf.float32)))

    trainer = make_trainer(tmp_path, train_steps=5, dataset_fn=half_weighted)
    metrics = trainer.train()
    assert metrics["targets_per_sec"] == pytest.approx(metrics["examples_per_sec"] / 2)
