import pytest

from framework import xla
from tests.subprocesses import run_python


def test_merge_replaces_flags_of_the_same_name():
    merged = xla.merge_flags("--a=1 --b=2", ["--b=3", "--c"])
    assert merged.split() == ["--a=1", "--b=3", "--c"]


def test_set_xla_flags_writes_the_environment(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    monkeypatch.delenv("TF_XLA_FLAGS", raising=False)
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    values = xla.set_xla_flags(
        ["--xla_dump_to=/tmp/d"], ["--tf_xla_auto_jit=2"], ["--xla_tpu_megacore_fusion=true"]
    )
    assert values == {
        "XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_dump_to=/tmp/d",
        "TF_XLA_FLAGS": "--tf_xla_auto_jit=2",
        "LIBTPU_INIT_ARGS": "--xla_tpu_megacore_fusion=true",
    }


def test_bad_flag_is_a_clear_error():
    with pytest.raises(ValueError, match="must start with '--'"):
        xla.set_xla_flags(["xla_dump_to=/tmp"])


@pytest.mark.slow
def test_flags_reach_xla_when_set_before_the_first_compile(tmp_path):
    result = run_python(f"""
        import glob, json
        import tensorflow as tf
        from framework import xla
        xla.set_xla_flags(["--xla_dump_to={tmp_path}"])
        tf.function(lambda x: tf.matmul(x, x), jit_compile=True)(tf.ones([2, 2]))
        print(json.dumps({{"dumps": len(glob.glob("{tmp_path}/*buffer-assignment.txt"))}}))
    """)
    assert result["dumps"] >= 1
