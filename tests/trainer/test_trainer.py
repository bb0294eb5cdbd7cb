import functools
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import remat as framework_remat
from framework.core.errors import TrainerError
from framework.runtime import Runtime
from framework.trainer import Trainer
from tests import tiny


def make_trainer(model_dir, **overrides) -> Trainer:
    return Trainer(str(model_dir), **{**tiny.TRAINER_ARGS, **overrides})


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny run trained to step 10 once for the module: checkpoints ckpt-5 and ckpt-10."""
    model_dir = tmp_path_factory.mktemp("trained")
    make_trainer(model_dir, train_steps=10).train()
    return model_dir


def copy_run(run, model_dir):
    """A copy of `run` at `model_dir` (without the first run's lock); returns model_dir."""
    shutil.copytree(run, model_dir, ignore=shutil.ignore_patterns("LOCK"))
    return model_dir


@pytest.fixture
def run_copy(trained_run, tmp_path):
    """A copy of `trained_run` of this test's own."""
    return copy_run(trained_run, tmp_path / "run")


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A tiny run trained to step 2 a step per loop, once for the module: ckpt-1 and ckpt-2,
    the finite start of the divergence tests (each takes a copy)."""
    model_dir = tmp_path_factory.mktemp("two_steps")
    make_trainer(model_dir, train_steps=2, steps_per_loop=1).train()
    return model_dir


@pytest.mark.slow
@pytest.mark.tf_compat
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


@pytest.mark.slow
@pytest.mark.tf_compat
def test_resumed_run_restores_and_equals_uninterrupted_run(run_copy, tmp_path):
    # The uninterrupted run: `trained_run` (these settings, 10 steps), restored from its ckpt-10.
    straight = make_trainer(run_copy, train_steps=10)
    assert straight.step == 10
    first = make_trainer(tmp_path / "split", train_steps=10)
    first.train(max_steps=5)
    weights = [v.numpy() for v in first.model.trainable_variables]
    resumed = make_trainer(tmp_path / "split", train_steps=10)
    assert resumed.step == 5
    for restored, saved in zip(resumed.model.trainable_variables, weights):
        np.testing.assert_array_equal(restored.numpy(), saved)
    resumed.train()
    assert resumed.step == 10
    for a, b in zip(straight.model.trainable_variables, resumed.model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # bit for bit on CPU


@pytest.mark.slow
def test_hundred_steps_trace_the_step_at_most_twice(tmp_path):
    trainer = make_trainer(tmp_path, train_steps=100, steps_per_loop=10, checkpoint_every=100)
    trainer.train()
    assert trainer.step == 100
    assert 1 <= trainer.traces["train_step"] <= 2


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_checkpoint(run_copy):
    trainer = make_trainer(run_copy, train_steps=20, learning_rate=1e30, clip_norm=None)
    with pytest.raises(TrainerError, match="diverged.*ckpt-10 is kept"):
        trainer.train()
    assert tf.train.latest_checkpoint(run_copy / "checkpoints").endswith("ckpt-10")


def _non_finite_values(path: str) -> int:
    reader = tf.train.load_checkpoint(path)
    return sum(
        int(np.size(value) - np.isfinite(value).sum())
        for name in reader.get_variable_to_shape_map()
        if np.issubdtype((value := np.asarray(reader.get_tensor(name))).dtype, np.floating)
    )


@pytest.mark.slow
@pytest.mark.parametrize("earlier_steps", [0, 2])
def test_a_diverging_run_never_saves_a_non_finite_checkpoint(request, tmp_path, earlier_steps):
    model_dir = tmp_path / "run"
    if earlier_steps:  # 2: `two_step_run`'s steps
        copy_run(request.getfixturevalue("two_step_run"), model_dir)
    # A weight decay of 1e36 at a learning rate of 1e3 scales the weights by 1 - 1e39: they are
    # non-finite after the first update, whose loss (of the weights before it) is finite. The
    # state to save is broken and the loss does not show it.
    diverging = dict(steps_per_loop=1, checkpoint_every=1, warmup_steps=0, weight_decay=1e36)
    trainer = make_trainer(model_dir, train_steps=10, learning_rate=1e3, **diverging)
    with pytest.raises(TrainerError, match="diverged") as info:
        trainer.train()
    state = tf.train.get_checkpoint_state(model_dir / "checkpoints")
    saved = list(state.all_model_checkpoint_paths) if state else []
    assert [os.path.basename(p) for p in saved] == [f"ckpt-{i + 1}" for i in range(earlier_steps)]
    assert all(_non_finite_values(path) == 0 for path in saved), saved
    newest = f"ckpt-{earlier_steps} is kept" if earlier_steps else "no finite checkpoint"
    assert newest in str(info.value), info.value
    # A restart with a sane learning rate continues from the newest checkpoint.
    again = make_trainer(model_dir, train_steps=earlier_steps + 2, steps_per_loop=1)
    assert again.step == earlier_steps
    again.train()
    assert again.step == earlier_steps + 2


def _checkpoint_files(model_dir) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in (model_dir / "checkpoints").glob("ckpt-*") if p.is_file()
    }


# Adam moves each weight by about the learning rate per step: at 1e30 the first step leaves
# finite weights of 1e30 (not saved: no checkpoint is due), whose next forward pass overflows.
DIVERGING = dict(steps_per_loop=1, checkpoint_every=100, warmup_steps=0, learning_rate=1e30)


@pytest.mark.slow
def test_a_diverged_run_rolls_back_with_a_lower_learning_rate_when_asked(
    two_step_run, tmp_path, caplog
):
    model_dir = copy_run(two_step_run, tmp_path / "run")
    trainer = make_trainer(
        model_dir,
        train_steps=5,
        divergence_rollbacks=1,
        rollback_learning_rate_factor=1e-30,  # a learning rate of 1 after the rollback
        **DIVERGING,
    )
    trainer.train()
    assert trainer.step == 5
    assert "before step 4: rolled back to" in caplog.text and "ckpt-2 with" in caplog.text
    saved = checkpoints_on_disk(model_dir)
    assert [os.path.basename(p) for p in saved] == ["ckpt-1", "ckpt-2", "ckpt-5"]
    assert all(_non_finite_values(path) == 0 for path in saved)
    # The lowered learning rate is saved with the checkpoints: a restart keeps it.
    scale = trainer.learning_rate_scale.numpy()
    assert scale == np.float32(1e-30)
    assert make_trainer(model_dir, train_steps=5).learning_rate_scale.numpy() == scale


@pytest.mark.slow
def test_rollbacks_are_bounded_then_the_run_stops(two_step_run, tmp_path, caplog):
    model_dir = copy_run(two_step_run, tmp_path / "run")
    trainer = make_trainer(model_dir, train_steps=5, divergence_rollbacks=2, **DIVERGING)
    with pytest.raises(TrainerError, match="diverged.*ckpt-2 is kept"):
        trainer.train()
    assert caplog.text.count("rolled back to") == 2
    # Each rollback lowers the rate further, though both return to the same checkpoint.
    assert "(now 0.5 of the schedule)" in caplog.text
    assert "(now 0.25 of the schedule)" in caplog.text
    assert [os.path.basename(p) for p in checkpoints_on_disk(model_dir)] == ["ckpt-1", "ckpt-2"]


def checkpoints_on_disk(model_dir) -> list[str]:
    state = tf.train.get_checkpoint_state(model_dir / "checkpoints")
    return list(state.all_model_checkpoint_paths) if state else []


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_checkpoints_only_are_an_error_and_are_not_deleted(run_copy):
    for data in (run_copy / "checkpoints").glob("ckpt-*.data-*"):
        flip_a_byte(data)
    before = _checkpoint_files(run_copy)
    with pytest.raises(TrainerError, match="cannot be restored .*ckpt-10: .*Nothing was deleted"):
        make_trainer(run_copy, train_steps=10)
    assert _checkpoint_files(run_copy) == before


@pytest.mark.parametrize("entry", ["checkpoint", "ckpt-10.index"])
def test_a_directory_where_a_save_writes_a_file_stops_the_run_before_it_trains(run_copy, entry):
    """A directory named like the index file or a checkpoint's .index: the run restored (or
    skipped) around it, trained up to the save that writes there and failed with a traceback."""
    path = run_copy / "checkpoints" / entry
    path.unlink()
    path.mkdir()
    (path / "notes").write_text("kept")
    before = _checkpoint_files(run_copy)
    with pytest.raises(TrainerError, match=f"checkpoints/{entry}: a directory where checkpoint"):
        make_trainer(run_copy, train_steps=15)
    assert _checkpoint_files(run_copy) == before and (path / "notes").read_text() == "kept"


@pytest.mark.slow
def test_a_corrupted_newest_checkpoint_falls_back_to_the_one_before(run_copy, caplog):
    flip_a_byte(run_copy / "checkpoints" / "ckpt-10.data-00000-of-00001")
    older = {k: v for k, v in _checkpoint_files(run_copy).items() if k.startswith("ckpt-5.")}
    resumed = make_trainer(run_copy, train_steps=10)
    assert resumed.step == 5
    assert "skipping checkpoint" in caplog.text and "Checksum does not match" in caplog.text
    assert all(_checkpoint_files(run_copy)[k] == v for k, v in older.items())
    resumed.train()
    assert resumed.step == 10


@pytest.mark.slow
def test_a_lost_index_resumes_from_the_checkpoint_files(run_copy):
    index = run_copy / "checkpoints" / "checkpoint"
    before = _checkpoint_files(run_copy)
    for damage in ("garbled {", "", None):  # garbled, empty, deleted
        if damage is None:
            index.unlink()
        else:
            index.write_text(damage)
        resumed = make_trainer(run_copy, train_steps=15)
        assert resumed.step == 10, damage
        assert tf.train.latest_checkpoint(run_copy / "checkpoints").endswith("ckpt-10")
    resumed.train()
    after = _checkpoint_files(run_copy)
    assert all(after[name] == data for name, data in before.items())


def test_missing_checkpoint_files_are_an_error_not_a_fresh_start(run_copy):
    for path in (run_copy / "checkpoints").glob("ckpt-*"):
        path.unlink()
    with pytest.raises(TrainerError, match="index file names checkpoints"):
        make_trainer(run_copy, train_steps=10)


def test_an_interrupted_save_leaves_nothing_that_stops_the_next_start(run_copy):
    temp = run_copy / "checkpoints" / "ckpt-15_temp"
    temp.mkdir()
    (temp / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"half")
    resumed = make_trainer(run_copy, train_steps=15)
    assert resumed.step == 10 and not temp.exists()


def test_a_second_trainer_on_the_model_dir_stops_the_first_before_it_saves(tmp_path):
    first = make_trainer(tmp_path, train_steps=10)
    make_trainer(tmp_path, train_steps=10)
    with pytest.raises(TrainerError, match="a later Trainer of this process"):
        first.train()
    assert not list((tmp_path / "checkpoints").glob("ckpt-*"))


@pytest.mark.slow
def test_finite_training_data_is_a_clear_error(tmp_path):
    def short_dataset(split, input_context=None, **kwargs):
        return tiny.dataset_fn(split, input_context, **kwargs).take(3)

    trainer = make_trainer(tmp_path, train_steps=10, dataset_fn=short_dataset)
    with pytest.raises(TrainerError, match="training data ran out"):
        trainer.train()


def test_the_training_pipeline_is_built_once_per_start(tmp_path):
    """Built with the trainer (to check the data early), at the step the run starts at, and read
    by the first iterator; a later one (after a rollback) builds it again."""
    starts = []

    def counted(split, input_context=None, **kwargs):
        if split == "train":
            starts.append(kwargs.get("start_step", 0))
        return tiny.dataset_fn(split, input_context, **kwargs)

    trainer = make_trainer(tmp_path, dataset_fn=counted)
    next(trainer.train_iterator())
    assert starts == [0]
    next(trainer.train_iterator())
    assert starts == [0, 0]


def test_empty_eval_data_is_a_clear_error(tmp_path):
    def no_eval(split, input_context=None, **kwargs):
        return tiny.dataset_fn(split, input_context, **kwargs).take(0)

    with pytest.raises(TrainerError, match="eval data set is empty"):
        make_trainer(tmp_path, dataset_fn=no_eval).evaluate()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"runtime": {"precision": "float8"}}, "unknown precision"),
        ({"runtime": {"strategy": "magic"}}, "unknown strategy"),
        ({"train_steps": 0}, "Trainer.train_steps must be a positive integer, got 0"),
        ({"runtime": {"xla_flags": ["xla_dump_to=/tmp"]}}, "must start with '--'"),
    ],
)
def test_bad_settings_are_clear_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        if "runtime" in overrides:
            overrides = {"runtime": Runtime(**overrides["runtime"])}
        make_trainer(tmp_path, **overrides)


@pytest.mark.slow
def test_bfloat16_precision_trains(tmp_path):
    trainer = make_trainer(tmp_path, train_steps=5, runtime=Runtime(precision="bfloat16"))
    try:
        assert trainer.model.blocks[0].attention.qkv.compute_dtype == "bfloat16"
        assert np.isfinite(trainer.train()["loss"])
    finally:
        make_trainer(tmp_path / "reset", train_steps=1)  # restores the float32 policy


@pytest.mark.slow
def test_remat_policies_train_exactly_like_no_remat_with_dropout(tmp_path):
    model_fn = functools.partial(tiny.model_fn, dropout=0.2)
    plain = make_trainer(tmp_path / "plain", train_steps=5, model_fn=model_fn)
    plain.train()
    for policy in ("nothing_saveable",):  # (every policy's gradients: test_remat.py)
        remat = make_trainer(
            tmp_path / policy, train_steps=5, model_fn=model_fn, remat_policy=policy
        )
        assert len(framework_remat.checkpointed_layers(remat.model)) == 2
        remat.train()
        # Equal up to float rounding, which Adam amplifies for gradients near zero (up to 2e-6
        # here); a different dropout mask moves most weights by about the learning rate (3e-3)
        # per step.
        for a, b in zip(plain.model.trainable_variables, remat.model.trainable_variables):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


def test_unknown_remat_policy_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match="Unknown remat policy 'most'.*dots_saveable"):
        make_trainer(tmp_path, remat_policy="most")


@pytest.mark.slow
def test_weighted_targets_count_only_where_weight_is_one(tmp_path):
    def half_weighted(split, input_context=None, **kwargs):
        dataset = tiny.dataset_fn(split, input_context, **kwargs)
        return dataset.map(lambda x, y: (x, y, tf.cast(tf.range(tf.size(y)) % 2, tf.float32)))

    trainer = make_trainer(tmp_path, train_steps=5, dataset_fn=half_weighted)
    metrics = trainer.train()
    assert metrics["targets_per_sec"] == pytest.approx(metrics["examples_per_sec"] / 2)


@pytest.mark.slow
def test_a_resume_that_cannot_be_bit_exact_says_why(tmp_path, caplog):
    """A checkpoint saved before random states were saved, by a run of another replica count,
    still restores; the log says why the run goes on other than the uninterrupted one."""
    with_dropout = dict(model_fn=functools.partial(tiny.model_fn, dropout=0.1), steps_per_loop=2)
    trainer = make_trainer(tmp_path, train_steps=2, **with_dropout)
    trainer.train()
    assert trainer.run_state.random_state  # the dropout layers' seed generators
    prefix = str(tmp_path / "checkpoints" / "ckpt-2")
    names = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
    assert sum(name.startswith("random_state/") for name in names) == len(
        trainer.run_state.random_state
    )
    caplog.clear()
    make_trainer(tmp_path, train_steps=2, **with_dropout)
    assert "holds" not in caplog.text and "replicas" not in caplog.text
    old = tf.train.Checkpoint(
        model=trainer.model,
        optimizer=trainer.optimizer,
        learning_rate_scale=trainer.learning_rate_scale,
        replicas_in_sync=tf.Variable(8, dtype=tf.int64),
    )
    old.save_counter.assign(1)  # (created on first use; the trainer's checkpoints hold one)
    old.write(prefix)
    caplog.clear()
    resumed = make_trainer(tmp_path, train_steps=2, **with_dropout)
    assert resumed.step == 2
    assert "ckpt-2 holds no random state (an older save), the model has" in caplog.text
    assert "ckpt-2 was saved by a run of 8 replicas, this one has 1" in caplog.text


@pytest.mark.slow
def test_mfu_never_exceeds_one_when_the_peak_was_read_low(tmp_path, caplog):
    """A peak read on a busy CPU (here: set far too low) is raised to the fastest loop's rate."""
    low = 1e-9  # TFLOP/s
    trainer = make_trainer(
        tmp_path, train_steps=4, steps_per_loop=2, count_flops=True,
        runtime=Runtime(peak_tflops=low),
    )  # fmt: skip
    metrics = trainer.train()
    assert metrics["mfu"] <= 1.0
    assert "above the peak of 1e-09 TFLOP/s taken at start" in caplog.text
    assert trainer.flops[1] > 1e3 * low * 1e12


class TwoDense(keras.Model):
    """A subclassed model: no weights until its first call."""

    def __init__(self):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.logits = keras.layers.Dense(4)

    def call(self, images):
        return self.logits(self.hidden(self.flatten(images)))


def two_dense(given_input: bool) -> keras.Sequential:
    layers = [keras.layers.Flatten(), keras.layers.Dense(16, "relu"), keras.layers.Dense(4)]
    return keras.Sequential([keras.Input((8, 8, 3)), *layers] if given_input else layers)


def test_a_model_without_weights_is_built_on_the_datas_features_as_keras_fit_builds_it():
    """A `keras.Sequential` without an `Input` and a subclassed model have no weights until
    their first call: the trainer builds them on one example of the data, and they train to
    the weights of the same model given its input shape (same seed: bit for bit)."""
    weights = {}
    for name, model_fn in {
        "given its input": functools.partial(two_dense, True),
        "sequential": functools.partial(two_dense, False),
        "subclassed": TwoDense,
    }.items():
        run = Trainer(None, **{**tiny.TRAINER_ARGS, "model_fn": model_fn, "train_steps": 4})
        assert run.model.built and run.step == 0
        run.train()
        weights[name] = [v.numpy() for v in run.model.trainable_variables]
    for name in ("sequential", "subclassed"):
        assert len(weights[name]) == 4
        for got, want in zip(weights[name], weights["given its input"]):
            np.testing.assert_array_equal(got, want)
