import numpy as np
import pytest
import tensorflow as tf

from framework.data.images import synthetic


def batches(dataset, count):
    return [tuple(x.numpy() for x in batch) for batch in dataset.take(count)]


def test_stream_is_deterministic_and_static():
    first = batches(synthetic.shapes("train", global_batch_size=8, image_size=16), 2)
    again = batches(synthetic.shapes("train", global_batch_size=8, image_size=16), 2)
    for (a_images, a_labels), (b_images, b_labels) in zip(first, again):
        np.testing.assert_array_equal(a_images, b_images)
        np.testing.assert_array_equal(a_labels, b_labels)
    spec = synthetic.shapes("train", global_batch_size=8, image_size=16).element_spec
    assert spec[0].shape == (8, 16, 16, 3) and spec[1].shape == (8,)


def test_start_step_continues_the_stream():
    stream = batches(synthetic.shapes("train", global_batch_size=4, image_size=8), 3)
    resumed = batches(synthetic.shapes("train", global_batch_size=4, image_size=8, start_step=2), 1)
    np.testing.assert_array_equal(stream[2][0], resumed[0][0])


def test_pipelines_split_each_global_batch_without_overlap():
    one = batches(synthetic.shapes("train", global_batch_size=8, image_size=8), 2)
    shards = [
        batches(
            synthetic.shapes(
                "train",
                tf.distribute.InputContext(
                    num_input_pipelines=2, input_pipeline_id=p, num_replicas_in_sync=4
                ),
                global_batch_size=8,
                image_size=8,
            ),
            4,
        )
        for p in range(2)
    ]
    for step in range(2):
        parts = [shards[p][2 * step + r][1] for p in range(2) for r in range(2)]
        np.testing.assert_array_equal(np.concatenate(parts), one[step][1])


def test_held_out_split_is_fixed_and_differs_from_train():
    held_out = batches(
        synthetic.shapes("eval", global_batch_size=16, image_size=8, eval_examples=40), 10
    )
    assert len(held_out) == 2
    train = batches(synthetic.shapes("train", global_batch_size=16, image_size=8), 1)
    assert not np.allclose(held_out[0][0], train[0][0])


def test_classes_are_balanced_and_learnable_signal_exists():
    images, labels = next(
        iter(synthetic.shapes("train", global_batch_size=512, image_size=16).unbatch().batch(512))
    )
    counts = np.bincount(labels.numpy(), minlength=8)
    assert counts.min() > 512 / 8 * 0.6
    # A disk covers more pixels than a ring of the same radius: class means must differ.
    bright = tf.reduce_mean(tf.cast(images > 0.45, tf.float32), axis=[1, 2, 3]).numpy()
    labels = labels.numpy()
    assert bright[labels == 0].mean() > bright[labels == 2].mean()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"split": "test"}, ValueError, "split must be"),
        ({"num_classes": 9}, ValueError, "num_classes must be"),
        ({"num_classes": 0}, ValueError, "shapes.num_classes must be a positive integer, got 0"),
        ({"image_size": "8"}, TypeError, "shapes.image_size must be a positive integer, got '8'"),
        ({"eval_examples": 64.0}, TypeError, "shapes.eval_examples must be a positive integer"),
        ({"split": "eval", "eval_examples": 3}, ValueError, "held-out set would be empty"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    args = {"split": "train", "global_batch_size": 4, **kwargs}
    with pytest.raises(error, match=message):
        synthetic.shapes(**args)
