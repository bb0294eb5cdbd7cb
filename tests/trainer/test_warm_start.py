"""Warm start from another run's checkpoint: a new head, resuming, and clear errors."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import tensorflow as tf

from framework.trainer import Trainer, warm_start
from tests import tiny


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny 4-class run trained 5 steps: its model_dir and final weights by path."""
    model_dir = tmp_path_factory.mktemp("pretrained")
    run = Trainer(str(model_dir), **{**tiny.TRAINER_ARGS, "train_steps": 5})
    run.train()
    return model_dir, [v.numpy() for v in run.model.weights]  # in the model's own order


def finetune(model_dir, init, **model):
    """A run of the same ViT with `model` overrides, warm started from `init`."""
    model_fn = functools.partial(tiny.model_fn, **model)
    data = functools.partial(tiny.dataset_fn, num_classes=model.get("num_classes", 4))
    args = {**tiny.TRAINER_ARGS, "model_fn": model_fn, "dataset_fn": data, "train_steps": 5}
    return Trainer(str(model_dir) if model_dir else None, **args, init_checkpoint=str(init))


def test_a_new_head_is_reinitialised_and_everything_else_taken(pretrained, tmp_path, caplog):
    source, weights = pretrained
    with caplog.at_level(logging.INFO):
        run = finetune(tmp_path / "ft", source, num_classes=8)
    assert run.step == 0 and int(run.optimizer.iterations.numpy()) == 0
    taken, fresh = [], []
    for variable, before in zip(run.model.weights, weights, strict=True):
        if before.shape == tuple(variable.shape):
            np.testing.assert_array_equal(variable.numpy(), before)
            taken.append(variable.path)
        else:
            fresh.append(variable.path)
    assert len(fresh) == 2 and all("head" in path for path in fresh), fresh
    assert len(taken) > 10
    (line,) = [r.getMessage() for r in caplog.records if "warm start from" in r.getMessage()]
    assert "2 re-initialised" in line and "(8,) here" in line


def test_a_run_with_its_own_checkpoints_resumes_instead(pretrained, tmp_path, caplog):
    source, _ = pretrained
    first = finetune(tmp_path / "ft", source, num_classes=8)
    first.train()
    saved = [v.numpy() for v in first.model.weights]
    with caplog.at_level(logging.INFO):
        again = finetune(tmp_path / "ft", source, num_classes=8)
    assert again.step == 5
    for variable, value in zip(again.model.weights, saved, strict=True):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert any("init_checkpoint not used" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("where", ["local", "ram"])
def test_a_checkpoint_prefix_works_without_a_model_dir(pretrained, where):
    """Also where a prefix lists as a directory (`ram://`, some object stores), which
    `tf.train.load_checkpoint` takes for a directory without checkpoints."""
    source, weights = pretrained
    prefix = source / "checkpoints" / "ckpt-5"
    if where == "ram":
        for path in tf.io.gfile.glob(f"{prefix}.*"):
            tf.io.gfile.copy(path, f"ram://warm_start/ckpt-5{path[len(str(prefix)) :]}", True)
        prefix = "ram://warm_start/ckpt-5"
        assert tf.io.gfile.isdir(prefix)
    run = finetune(None, prefix)
    for variable, before in zip(run.model.weights, weights, strict=True):
        np.testing.assert_array_equal(variable.numpy(), before)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"depth": 3}, r"lacks 12 of the model's weights \(block_2/attention.*is it a checkpoint"),
        ({"dim": 32, "mlp_dim": 64}, "differ in shape, more than half the model"),
    ],
)
def test_another_model_is_an_error_naming_the_weights(pretrained, model, message):
    source, _ = pretrained
    with pytest.raises(warm_start.WarmStartError, match=message):
        finetune(None, source, **model)


def test_a_path_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(warm_start.WarmStartError, match="neither a checkpoint"):
        warm_start.resolve(str(tmp_path))
