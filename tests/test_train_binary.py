"""`python -m framework.train`: flags, gin, the run record, and one-line errors for bad input."""

import subprocess
import sys

import gin
import pytest

import framework.configurables  # noqa: F401  (registers the gin names)
from framework import cli, trainer  # noqa: F401  (registers Trainer)
from tests.subprocesses import REPO_DIR, child_env

TINY_RUN = [
    "--gin_file=quickstart.gin",
    "--gin.Trainer.train_steps=4",
    "--gin.Trainer.steps_per_loop=2",
    "--gin.Trainer.global_batch_size=8",
    "--gin.data.shapes.image_size=8",
    "--gin.data.shapes.eval_examples=16",
    "--gin.models.VisionTransformer.image_size=8",
    "--gin.models.VisionTransformer.depth=1",
    "--gin_param=models.VisionTransformer.dim = 16",
    "--gin_bindings=models.VisionTransformer.mlp_dim = 16",
]


def run_binary(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "framework.train", *args],
        cwd=REPO_DIR,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_run_writes_config_command_checkpoints_and_resumes(tmp_path):
    first = run_binary(*TINY_RUN, f"--model_dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    config = (tmp_path / "config.gin").read_text()
    assert "Trainer.train_steps = 4" in config and "VisionTransformer.dim = 16" in config
    assert "--gin.Trainer.train_steps=4" in (tmp_path / "command").read_text()
    assert "step 4/4" in first.stderr and "eval at step 4" in first.stderr
    second = run_binary(*TINY_RUN, "--gin.Trainer.train_steps=6", f"--model_dir={tmp_path}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "restored step 4" in second.stderr and "step 6/6" in second.stderr
    assert list(tmp_path.glob("config-*.gin")), "the first run's config.gin was not kept"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gin_file=missing.gin"], "gin file 'missing.gin' not found"),
        (["--gin.Trainer.no_such_setting=1"], "bad gin configuration"),
        (["--gin.Trainer.strategy='tpu_v9'"], "unknown strategy"),
        (["--gin.Trainer.train_steps"], "should look like --gin.NAME=VALUE"),
        (["--mode=sing"], "--mode"),
        (["--model_dir=/proc/not_writable"], "not writable"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    if not any(a.startswith("--model_dir") for a in args):
        args = [*args, f"--model_dir={tmp_path / 'run'}"]
    result = run_binary(*TINY_RUN[1:], *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_gin_file_is_required_to_name_a_model_dir():
    result = run_binary("--gin_file=quickstart.gin")
    assert result.returncode == 2 and "--model_dir is required" in result.stderr


def test_existing_model_dir_is_untouched_by_a_bad_config(tmp_path):
    keep = tmp_path / "checkpoints" / "checkpoint"
    keep.parent.mkdir()
    keep.write_text("precious")
    result = run_binary(*TINY_RUN, "--gin.Trainer.nope=1", f"--model_dir={tmp_path}")
    assert result.returncode == 2
    assert keep.read_text() == "precious" and not (tmp_path / "config.gin").exists()


def test_gin_shorthand_becomes_bindings():
    rest, bindings = cli.split_gin_shorthand(["prog", "--gin.A.b=3", "--mode=train"])
    assert rest == ["prog", "--mode=train"] and bindings == ["A.b = 3"]


def test_parse_gin_finds_files_on_the_search_path():
    gin.clear_config()
    try:
        cli.parse_gin(["vit_b16.gin"], [], [str(cli.CONFIGS_DIR)])
        assert gin.query_parameter("Trainer.global_batch_size") == 8
    finally:
        gin.clear_config()
