"""Image folders: labels, deterministic and resumable streams, sharding, eval counted exactly."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf

from framework.data.images import pipeline
from framework.models import VisionTransformer
from framework.trainer import Trainer
from tests import tiny
from tests.data.images.folders import write_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    return write_folder(root / "train", per_class=4), write_folder(
        root / "eval", per_class=3, seed=1
    )


def data(folders, split="train", context=None, batch=4, **kwargs):
    train, eval_ = folders
    return pipeline.image_folder(
        split,
        context,
        global_batch_size=batch,
        train_directory=train,
        eval_directory=eval_,
        image_size=16,
        **kwargs,
    )


def batches(dataset, count=None):
    dataset = dataset if count is None else dataset.take(count)
    return [tuple(x.numpy() for x in batch) for batch in dataset]


def test_classes_are_sorted_sub_directories(folders):
    files, labels, classes = pipeline.folder_examples(folders[0])
    assert classes == ["class_0", "class_1", "class_2"] and len(files) == 12
    assert all(f"class_{label}/" in path for path, label in zip(files, labels))


def test_train_batches_are_static_normalised_and_deterministic(folders):
    dataset = data(folders)
    assert dataset.element_spec[0].shape == (4, 16, 16, 3)
    first, again = batches(dataset, 4), batches(data(folders), 4)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a[0], b[0])
    assert -3 < first[0][0].min() < 0 < first[0][0].max() < 3  # normalised, not [0, 255]


def test_a_resumed_stream_draws_the_same_crops(folders):
    stream = batches(data(folders), 5)  # more than an epoch: 20 of 12 images
    resumed = batches(data(folders, start_step=4), 1)
    np.testing.assert_array_equal(resumed[0][0], stream[4][0])
    np.testing.assert_array_equal(resumed[0][1], stream[4][1])


def test_pipelines_split_each_global_batch(folders):
    whole = batches(data(folders, batch=4), 2)
    parts = [
        batches(data(folders, context=tf.distribute.InputContext(2, p, 2), batch=4), 2)
        for p in range(2)
    ]
    for step in range(2):
        joined = np.concatenate([parts[0][step][0], parts[1][step][0]])
        np.testing.assert_array_equal(joined, whole[step][0])


@pytest.mark.parametrize("pipelines", [1, 3])
def test_eval_counts_every_example_once(folders, pipelines):
    per_pipeline = [
        batches(data(folders, "eval", tf.distribute.InputContext(pipelines, p, pipelines), batch=6))
        for p in range(pipelines)
    ]
    assert len({len(b) for b in per_pipeline}) == 1  # every replica runs the same steps
    weights = np.concatenate([b[2] for bs in per_pipeline for b in bs])
    labels = np.concatenate([b[1] for bs in per_pipeline for b in bs])
    assert weights.sum() == 9 and len(weights) == 12  # 9 images, padded to 2 global batches
    assert sorted(labels[weights > 0]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"train_directory": "/no/such/dir"}, "image folder '/no/such/dir' not found"),
        ({"dtype": "float16"}, "data.image_folder.dtype must be"),
        ({"image_size": 0}, "data.image_folder.image_size must be a positive integer"),
    ],
)
def test_bad_arguments_are_clear_errors(folders, tmp_path, kwargs, message):
    train, eval_ = folders
    args = {"global_batch_size": 4, "train_directory": train, "eval_directory": eval_, **kwargs}
    with pytest.raises(ValueError, match=message):
        pipeline.image_folder("train", **args)


def test_eval_classes_must_match(folders, tmp_path):
    other = write_folder(tmp_path / "other", per_class=1, classes=2)
    (tmp_path / "other" / "class_9").mkdir()  # the error names only the differing classes
    missing = r"only in eval: \['class_9'\]; only in train: \['class_2'\]"
    with pytest.raises(ValueError, match="eval folder's classes differ .*" + missing):
        pipeline.image_folder(
            "eval", global_batch_size=2, train_directory=folders[0], eval_directory=other
        )


@pytest.mark.slow
def test_a_quick_run_learns_from_a_folder_of_image_files(tmp_path):
    train = write_folder(tmp_path / "train", per_class=48, classes=4, size=24)
    eval_ = write_folder(tmp_path / "eval", per_class=16, classes=4, size=24, seed=1)
    trainer = Trainer(
        None,
        model_fn=functools.partial(
            VisionTransformer, **{**tiny.MODEL, "image_size": 16, "dim": 32, "mlp_dim": 64}
        ),
        dataset_fn=functools.partial(
            pipeline.image_folder, train_directory=train, eval_directory=eval_, image_size=16
        ),
        global_batch_size=32,
        train_steps=150,
        steps_per_loop=50,
        learning_rate=3e-3,
        warmup_steps=10,
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["accuracy"] > 0.5  # chance is 0.25; 0.64 when measured
