"""TFRecord and TFDS image sources, and the augmentations all image sources share.

TFRecords are written by the tests; TFDS data sets are a tiny builder prepared into a temporary
directory (the real reading path: sub-splits, sizes, encoded images) and `tfds.testing.mock_data`
for a data set by name. Each example carries its index, so coverage and exact counts are checked
example by example.
"""

from __future__ import annotations

import functools
import re
import sys
from contextlib import nullcontext

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from framework.core.errors import MissingDependency
from framework.data import sharding, streams
from framework.data.images import augment, pipeline
from framework.data.images import tfds as tfds_source
from framework.data.images import tfrecord as tfrecord_source
from tests.binaries.in_process import TWO_STEPS, train_binary
from tests.data.images.folders import write_folder

SIZE = 8  # the images the pipelines make
TRAIN, EVAL = 20, 7  # examples written
CLASSES = 3


def _pixels(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, (12, 12, 3), dtype=np.uint8)


def write_tfrecords(
    directory, count: int, files: int, start: int = 0, image_key: str = "image/encoded"
) -> str:
    """`count` examples over `files` files in the ImageNet layout (labels from 1; the image
    under `image_key`), each with its index under 'index'; returns the glob."""
    directory.mkdir(parents=True)
    writers = [tf.io.TFRecordWriter(str(directory / f"part-{i:02d}")) for i in range(files)]
    for i in range(count):
        index = start + i
        feature = {
            image_key: tf.train.Feature(
                bytes_list=tf.train.BytesList(value=[tf.io.encode_png(_pixels(index)).numpy()])
            ),
            "image/class/label": tf.train.Feature(
                int64_list=tf.train.Int64List(value=[index % CLASSES + 1])
            ),
            "index": tf.train.Feature(int64_list=tf.train.Int64List(value=[index])),
        }
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        writers[i % files].write(example.SerializeToString())
    for writer in writers:
        writer.close()
    return str(directory / "part-*")


class FrameworkTestShapes(tfds.core.GeneratorBasedBuilder):
    """A tiny TFDS image data set made without a download; 'index' numbers its examples."""

    # A one-part module name: TFDS looks for the code of builders in packages through
    # `importlib_resources`, a back-port it installs only for Python < 3.9.
    __module__ = "framework_test_shapes"
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(12, 12, 3)),
                    "label": tfds.features.ClassLabel(num_classes=CLASSES),
                    "index": tfds.features.Scalar(dtype=np.int64),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        return {
            "train": self._generate_examples(TRAIN, 0),
            "test": self._generate_examples(EVAL, 100),
        }

    def _generate_examples(self, count, start):
        for index in range(start, start + count):
            yield index, {"image": _pixels(index), "label": index % CLASSES, "index": index}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    return write_tfrecords(root / "train", TRAIN, files=4), write_tfrecords(
        root / "eval", EVAL, files=2, start=100
    )


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    FrameworkTestShapes(data_dir=data_dir).download_and_prepare()
    return data_dir


def from_records(records, split="train", context=None, batch=4, **kwargs):
    args = dict(
        train_files=records[0],
        eval_files=records[1],
        image_size=SIZE,
        shuffle_block=8,
        cycle_length=2,
        num_classes=CLASSES,
    )
    return tfrecord_source.tfrecord(split, context, global_batch_size=batch, **{**args, **kwargs})


def from_tfds(data_dir, split="train", context=None, batch=4, **kwargs):
    args = dict(image_size=SIZE, shuffle_block=8)
    return tfds_source.tfds(
        split,
        context,
        global_batch_size=batch,
        name="framework_test_shapes",
        data_dir=data_dir,
        **{**args, **kwargs},
    )


@pytest.fixture(params=["tfrecord", "tfds"])
def source(request, records, tfds_dir):
    """Each of the two sources, with each example's index as its label."""
    if request.param == "tfrecord":
        return functools.partial(
            from_records, records, label_key="index", label_offset=0, num_classes=None
        )
    return functools.partial(from_tfds, tfds_dir, label_key="index")


def batches(dataset, count=None):
    dataset = dataset if count is None else dataset.take(count)
    return [tuple(x.numpy() for x in batch) for batch in dataset]


def context(pipelines, pipeline):
    return tf.distribute.InputContext(pipelines, pipeline, pipelines)


@pytest.mark.parametrize("sharding", ["read_own", "read_all"])
def test_a_resumed_stream_continues_exactly(source, sharding):
    """Step 7 of the second of two pipelines is step 7 of its stream resumed there: past an
    epoch (5 steps), so whole epochs are skipped."""
    make = lambda **k: source(context=context(2, 1), sharding=sharding, **k)  # noqa: E731
    stream = batches(make(), 8)
    resumed = batches(make(start_step=7), 1)[0]
    np.testing.assert_array_equal(resumed[0], stream[7][0])
    np.testing.assert_array_equal(resumed[1], stream[7][1])
    if sharding == "read_all":  # the order is the seed's
        other = batches(make(seed=1), 5)
        assert [b[1].tolist() for b in other] != [b[1].tolist() for b in stream[:5]]


def test_pipelines_reading_their_own_data_read_disjoint_parts_that_cover_it(source):
    """Two pipelines, one epoch (10 examples each): disjoint, together every example once."""
    seen = [
        np.concatenate(
            [b[1] for b in batches(source(context=context(2, p), sharding="read_own"), 5)]
        )
        for p in range(2)
    ]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(np.concatenate(seen)) == list(range(TRAIN))


def test_pipelines_reading_everything_split_each_global_batch(source):
    """'read_all': the rows of the pipelines, joined, are the one-pipeline stream."""
    whole = batches(source(sharding="read_all"), 6)
    parts = [batches(source(context=context(2, p), sharding="read_all"), 6) for p in range(2)]
    for step in range(6):
        for i in range(2):  # images, labels
            joined = np.concatenate([parts[0][step][i], parts[1][step][i]])
            np.testing.assert_array_equal(joined, whole[step][i])


@pytest.mark.tf_compat
def test_eval_counts_every_example_once(source, pipelines=3):
    per_pipeline = [
        batches(source("eval", context(pipelines, p), batch=6)) for p in range(pipelines)
    ]
    assert len({len(b) for b in per_pipeline}) == 1  # every replica runs the same steps
    weights = np.concatenate([b[2] for bs in per_pipeline for b in bs])
    indices = np.concatenate([b[1] for bs in per_pipeline for b in bs])
    assert len(weights) == 12 and weights.sum() == EVAL  # 7 examples in 2 global batches of 6
    assert sorted(indices[weights > 0]) == list(range(100, 100 + EVAL))


@pytest.mark.parametrize("count, batch, pipelines", [(7, 7, 1), (7, 2, 2), (0, 2, 1)])
def test_eval_rows_pad_the_last_global_batch_only(count, batch, pipelines):
    """A split filling its last global batch gets no padding batch; an empty one no batch."""
    records = tf.data.Dataset.range(count)
    rows = [
        list(streams.eval_rows(records, sharding.share(batch, context(pipelines, p))))
        for p in range(pipelines)
    ]
    real = [int(r) for part in rows for r, weight in part if weight == 1.0]
    assert sorted(real) == list(range(count))
    assert sum(len(part) for part in rows) == -(-count // batch) * batch


def test_tfrecord_labels_take_the_offset_and_bfloat16_images(records):
    images_, labels = batches(from_records(records, dtype="bfloat16"), 1)[0]
    assert images_.dtype == tf.bfloat16.as_numpy_dtype and images_.shape == (4, SIZE, SIZE, 3)
    assert set(labels) <= {0, 1, 2}  # written 1 to 3
    eval_images = batches(from_records(records, "eval", dtype="bfloat16"), 1)[0][0]
    assert eval_images.dtype == tf.bfloat16.as_numpy_dtype


def test_a_wrong_label_offset_stops_at_the_first_batch(records):
    with pytest.raises(tf.errors.InvalidArgumentError, match="label_offset = 0 is outside"):
        batches(from_records(records, label_offset=0), 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"image_key": "image"}, "no bytes feature 'image' (data.tfrecord.image_key)"),
        ({"label_key": "label"}, "no int64 feature 'label' (data.tfrecord.label_key)"),
        ({"train_files": "/no/such/*.tfrecord"}, "data.tfrecord.train_files"),
        ({"sharding": "hosts"}, "data.tfrecord.sharding must be one of"),
        ({"num_classes": None, "mixup_alpha": 0.2}, "data.tfrecord.num_classes is needed"),
    ],
)
def test_tfrecord_settings_are_checked(records, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        from_records(records, **kwargs)


def test_tfrecord_reading_own_files_needs_one_per_pipeline(records):
    with pytest.raises(ValueError, match="4 files, 5 pipelines"):
        from_records(records, context=context(5, 0), batch=5, sharding="read_own")


def test_tfds_settings_are_checked(tfds_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="not prepared in data_dir"):
        from_tfds(str(tmp_path))
    with pytest.raises(ValueError, match="image_key 'img' is not a feature"):
        from_tfds(tfds_dir, image_key="img")
    with pytest.raises(ValueError, match="'no_such_set' is not a TensorFlow Datasets data set"):
        tfds_source.tfds("train", global_batch_size=2, name="no_such_set")
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # as if not installed
    with pytest.raises(MissingDependency, match=r"pip install 'framework\[tfds\]'"):
        from_tfds(tfds_dir)


@pytest.mark.tf_compat
def test_tfds_by_name_through_mock_data():
    """cifar10 by name, no download: TFDS's mock yields 10 random examples of its features."""
    with tfds.testing.mock_data(num_examples=10):
        train_batch = batches(
            tfds_source.tfds(
                "train", global_batch_size=4, name="cifar10", image_size=SIZE, mixup_alpha=0.5
            ),
            1,
        )[0]
        evaluated = batches(
            tfds_source.tfds("eval", global_batch_size=4, name="cifar10", image_size=SIZE)
        )
    assert train_batch[0].shape == (4, SIZE, SIZE, 3) and train_batch[1].shape == (4, 10)
    np.testing.assert_allclose(train_batch[1].sum(-1), 1.0, rtol=1e-6)  # mixed labels
    assert sum(b[2].sum() for b in evaluated) == 10 and len(evaluated) == 3


# Augmentation and mixing, through the image folder source (index-addressed files).


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    return write_folder(root / "train", per_class=4, size=12), write_folder(
        root / "eval", per_class=1, size=12, seed=1
    )


AUGMENTED = dict(randaugment_ops=2, randaugment_magnitude=9, mixup_alpha=0.8, cutmix_alpha=1.0)


def folder_data(folders, context=None, **kwargs):
    return pipeline.image_folder(
        "train",
        context,
        global_batch_size=4,
        train_directory=folders[0],
        eval_directory=folders[1],
        image_size=SIZE,
        **{**AUGMENTED, **kwargs},
    )


@pytest.mark.tf_compat
def test_mixed_batches_resume_exactly_and_do_not_depend_on_the_layout(folders):
    """RandAugment, mixup and cutmix are keyed by position: a resumed stream and two pipelines'
    rows give the very batches of one uninterrupted pipeline."""
    whole = batches(folder_data(folders), 5)  # past the 12-image epoch
    assert whole[0][1].shape == (4, CLASSES) and whole[0][1].dtype == np.float32
    np.testing.assert_allclose(np.concatenate([b[1] for b in whole]).sum(-1), 1.0, rtol=1e-6)
    assert any(0.01 < b[1].max(-1).min() < 0.99 for b in whole)  # some labels really mixed
    resumed = batches(folder_data(folders, start_step=4), 1)[0]
    np.testing.assert_array_equal(resumed[0], whole[4][0])
    np.testing.assert_array_equal(resumed[1], whole[4][1])
    second_half = batches(folder_data(folders, context=context(2, 1)), 5)  # rows 2 and 3
    for step in range(5):
        for i in range(2):
            np.testing.assert_allclose(second_half[step][i], whole[step][i][2:], atol=1e-6)


def test_mixing_needs_an_even_replica_batch(folders):
    with pytest.raises(ValueError, match="per-replica batch must be even, got 1"):
        folder_data(folders, context=context(4, 0))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"mixup_alfa": 0.2}, TypeError, "data.image_folder has no setting 'mixup_alfa'"),
        ({"mean": (0.5, 0.5)}, ValueError, "data.image_folder.mean must be 3 numbers"),
        ({"std": (0.5, 0.0, 0.5)}, ValueError, "data.image_folder.std must be 3 positive"),
        ({"randaugment_magnitude": 11}, ValueError, "randaugment_magnitude must be a number"),
        ({"cutmix_alpha": -1.0}, ValueError, "data.image_folder.cutmix_alpha must be"),
    ],
)
def test_preprocessing_settings_are_checked(folders, kwargs, error, message):
    with pytest.raises(error, match=message):
        folder_data(folders, **kwargs)


def test_normalisation_takes_mean_and_std(folders):
    plain = batches(
        folder_data(
            folders,
            randaugment_ops=0,
            mixup_alpha=0.0,
            cutmix_alpha=0.0,
            mean=(0.5,) * 3,
            std=(0.5,) * 3,
        ),
        3,
    )
    pixels = np.concatenate([b[0] for b in plain])
    assert -1.0 <= pixels.min() < -0.5 and 0.5 < pixels.max() <= 1.0  # [0, 1] -> [-1, 1]


def uneven_image(size: int = 32) -> tf.Tensor:
    """Whole pixel values in [60, 140): room for equalize and autocontrast to stretch."""
    return tf.constant(np.random.default_rng(0).integers(60, 140, (size, size, 3)), tf.float32)


@pytest.mark.parametrize("op", augment.OPS, ids=lambda op: op.__name__)
def test_each_randaugment_op_keeps_shape_and_range(op):
    image = uneven_image()
    for level in (0.0, 1.0):
        for sign in (-1.0, 1.0):
            out = op(image, level, tf.constant(sign)).numpy()
            assert out.shape == image.shape and out.dtype == np.float32
            assert 0.0 <= out.min() and out.max() <= 255.0
    if op is not augment.identity:
        assert not np.array_equal(op(image, 1.0, tf.constant(1.0)).numpy(), image.numpy())


def test_randaugment_op_values():
    image = uneven_image()
    one = tf.constant(1.0)
    np.testing.assert_allclose(augment.solarize(image, 1.0, one), 255.0 - image)  # all inverted
    assert np.all(augment.posterize(image, 1.0, one).numpy() % 16 == 0)  # 4 bits kept
    stretched = augment.autocontrast(image, 0.0, one).numpy()
    assert stretched.min() == 0.0 and abs(stretched.max() - 255.0) < 1e-3
    moved = augment.translate_x(image, 0.5, one).numpy()  # 7 of 32 columns: round(.5*.45*32)
    np.testing.assert_array_equal(moved[:, 7:], image.numpy()[:, :-7])
    assert np.all(moved[:, :7] == 128.0)
    equalized = augment.equalize(image, 0.0, one).numpy()  # 80 levels spread over [0, 255]
    assert equalized.min() == 0 and equalized.max() >= 250
    key = tf.constant([3, 5], tf.int64)
    draws = [augment.rand_augment(image, key, 2, 9.0).numpy() for _ in range(2)]
    np.testing.assert_array_equal(*draws)  # keyed, not stateful


def test_mixup_and_cutmix_mix_pairs_by_lambda():
    rng = np.random.default_rng(0)
    pixels = tf.constant(rng.uniform(size=(4, SIZE, SIZE, 3)), tf.float32)
    labels = tf.constant([0, 1, 2, 0])
    for mixup, cutmix in ((0.5, 0.0), (0.0, 1.0)):
        mix = tf.stack(
            [
                augment.pair_mix(tf.constant(p, tf.int64), 0, SIZE, mixup, cutmix)
                for p in (10, 11, 12, 13)
            ]
        )
        assert np.array_equal(mix[0], mix[1]) and np.array_equal(mix[2], mix[3])  # per pair
        out, soft = (x.numpy() for x in augment.mix_batch(pixels, labels, mix, CLASSES))
        lam = mix[0, 0].numpy()
        np.testing.assert_allclose(soft[0], [lam, 1 - lam, 0], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(soft[1], [1 - lam, lam, 0], rtol=1e-6, atol=1e-7)
        a, b = pixels[0].numpy(), pixels[1].numpy()
        if mixup:
            np.testing.assert_allclose(out[0], lam * a + (1 - lam) * b, rtol=1e-5)
        else:  # each pixel from one of the pair; b's share is 1 - lambda
            from_b = np.all(out[0] == b, axis=-1) & ~np.all(out[0] == a, axis=-1)
            assert np.all(np.all(out[0] == a, -1) | from_b)
            assert from_b.mean() == pytest.approx(1 - lam, abs=1e-6)
            np.testing.assert_array_equal(np.where(from_b[..., None], a, b), out[1])


# Each source through `python -m framework.train`, in this process: a tiny ViT, two steps, and
# the eval split counted exactly (the log's "on N targets").

TINY_VIT = [
    f"--gin.models.VisionTransformer.{name}={value}"
    for name, value in dict(image_size=SIZE, depth=1, dim=8, num_heads=2, mlp_dim=8).items()
]


@pytest.mark.slow
def test_each_source_trains_through_the_binary(records, folders, tmp_path, caplog):
    """TFRecords and an image folder on quickstart.gin's model; cifar10.gin as shipped (TFDS,
    RandAugment, mixup, cutmix) on TFDS's mock of CIFAR-10 (10 examples)."""
    quickstart = ["--gin_file=quickstart.gin", "--gin.models.VisionTransformer.num_classes=3"]
    runs = {
        "tfrecord": [
            *quickstart,
            "--gin.Trainer.dataset_fn=@data.tfrecord",
            f"--gin.data.tfrecord.train_files='{records[0]}'",
            f"--gin.data.tfrecord.eval_files='{records[1]}'",
            f"--gin.data.tfrecord.image_size={SIZE}",
            "--gin.data.tfrecord.shuffle_block=8",
        ],
        "image_folder": [
            *quickstart,
            "--gin.Trainer.dataset_fn=@data.image_folder",
            f"--gin.data.image_folder.train_directory='{folders[0]}'",
            f"--gin.data.image_folder.eval_directory='{folders[1]}'",
            f"--gin.data.image_folder.image_size={SIZE}",
        ],
        "cifar10": ["--gin_file=cifar10.gin", f"--gin.data.tfds.image_size={SIZE}"],
    }
    examples = {"tfrecord": EVAL, "image_folder": CLASSES, "cifar10": 10}
    for name, flags in runs.items():
        caplog.clear()
        mock = tfds.testing.mock_data(num_examples=10) if name == "cifar10" else nullcontext()
        with mock:
            log = train_binary([*flags, *TINY_VIT, *TWO_STEPS], tmp_path / name, caplog)
        assert "step 2/2" in log and f"on {examples[name]} targets" in log, (name, log[-2000:])
