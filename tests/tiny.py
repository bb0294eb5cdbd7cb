"""A tiny ViT run on the shapes task, small enough for a unit test to train in seconds."""

import functools

from framework.data import synthetic_images
from framework.models import VisionTransformer

IMAGE_SIZE = 8

model_fn = functools.partial(
    VisionTransformer,
    image_size=IMAGE_SIZE,
    patch_size=4,
    num_classes=4,
    dim=16,
    depth=2,
    num_heads=2,
    mlp_dim=32,
)
dataset_fn = functools.partial(
    synthetic_images.shapes, image_size=IMAGE_SIZE, num_classes=4, eval_examples=64
)

TRAINER_ARGS = dict(
    model_fn=model_fn,
    dataset_fn=dataset_fn,
    global_batch_size=16,
    steps_per_loop=5,
    learning_rate=3e-3,
    warmup_steps=2,
)
