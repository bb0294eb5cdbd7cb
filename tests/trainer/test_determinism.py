"""Reproducible runs: the determinism check finds where two copies of a run part, if they do,
through the library and through the binary's `--check_determinism`."""

import itertools

import pytest

from framework.trainer import Trainer, determinism
from tests import tiny
from tests.subprocesses import run_binary

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def tiny_run(**overrides) -> Trainer:
    return Trainer(None, **{**tiny.TRAINER_ARGS, **tiny.vit_with_dropout(), **overrides})


def test_two_copies_of_a_run_are_bit_identical_and_a_difference_is_found():
    assert determinism.first_difference(tiny_run, 3) is None
    rates = itertools.cycle([3e-3, 3.0001e-3])  # the second copy: another learning rate
    found = determinism.first_difference(lambda: tiny_run(learning_rate=next(rates)), 3)
    assert found is not None and found.step <= 2 and found.max_abs > 0, found  # (warm-up)


def test_the_binary_checks_determinism_and_says_so():
    flags = [*tiny.GIN_FLAGS, "--gin.models.VisionTransformer.dropout=0.1"]
    run = run_binary(*flags, "--check_determinism=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "determinism check: 2 steps of two copies of the run: bit-identical" in run.stderr
