"""Model FLOPs counted in XLA's program, MFU in the trainer's metrics, and its profiles."""

from __future__ import annotations

import glob
import os

import keras
import pytest
import tensorflow as tf

from framework.core.tf_internals import xplane_pb2
from framework.models import vit
from framework.runtime import flops
from framework.trainer import Trainer
from tests import tiny

VIT = dict(image_size=16, patch_size=4, num_classes=8, dim=32, depth=3, num_heads=2, mlp_dim=64)


def test_dense_layers_count_two_flops_per_multiply_add_three_times():
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(10)])
    assert flops.model_flops_per_step(model, tf.ones([8, 32])) == (
        3 * 2 * 8 * (32 * 64 + 64 * 10),
        True,
    )


def test_a_convolution_counts_its_window_and_input_channels():
    model = keras.Sequential([keras.Input((10, 10, 3)), keras.layers.Conv2D(5, 3, padding="same")])
    forward, _ = flops.model_flops_per_step(model, tf.ones([2, 10, 10, 3]))
    assert forward == 3 * 2 * (2 * 10 * 10 * 5) * (3 * 3 * 3)


@pytest.mark.slow
def test_a_scanned_model_counts_every_trip_of_its_loop():
    images = tf.ones([4, 16, 16, 3])
    unrolled = flops.model_flops_per_step(vit.VisionTransformer(**VIT), images)
    scanned = flops.model_flops_per_step(vit.VisionTransformer(**VIT, scan_layers=True), images)
    assert scanned == unrolled and unrolled[1]
    one_block_less = flops.model_flops_per_step(
        vit.VisionTransformer(**{**VIT, "depth": 2}), images
    )
    assert one_block_less[0] < unrolled[0]


def test_a_loop_of_unknown_length_is_reported_as_a_lower_bound():
    w = tf.ones([4, 4])

    @tf.function(jit_compile=True)
    def forward(x):
        _, y = tf.while_loop(
            lambda i, y: tf.reduce_sum(y) < 1e6, lambda i, y: (i + 1, y @ w), (0, x)
        )
        return y

    count, exact = flops.forward_flops(forward, tf.ones([2, 4]))
    assert count == 2 * 2 * 4 * 4 and not exact


@pytest.mark.slow
def test_training_logs_mfu_and_writes_a_profile(tmp_path, caplog):
    trainer = Trainer(
        str(tmp_path),
        **{**tiny.TRAINER_ARGS, "train_steps": 15, "profile_steps": (5, 10), "count_flops": True},
    )
    with caplog.at_level("INFO"):
        metrics = trainer.train()
    assert metrics["tflops_per_sec"] > 0 and 0 < metrics["mfu"] < 1
    assert any("MFU" in r.getMessage() for r in caplog.records)
    (path,) = glob.glob(os.path.join(tmp_path, "train", "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace.FromString(open(path, "rb").read())
    events = [e for plane in space.planes for line in plane.lines for e in line.events]
    assert events  # the trace viewer has something to show


def test_bad_profile_steps_are_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"profile_steps must be \(first, last\)"):
        Trainer(str(tmp_path), **tiny.TRAINER_ARGS, profile_steps=(10, 5))
