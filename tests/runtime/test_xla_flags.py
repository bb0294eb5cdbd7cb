import pytest

from framework.core import tf_internals
from framework.runtime import Runtime, xla
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
        from framework.runtime import xla
        xla.set_xla_flags(["--xla_dump_to={tmp_path}"])
        tf.function(lambda x: tf.matmul(x, x), jit_compile=True)(tf.ones([2, 2]))
        print(json.dumps({{"dumps": len(glob.glob("{tmp_path}/*buffer-assignment.txt"))}}))
    """)
    assert result["dumps"] >= 1


def test_the_remat_memory_limit_becomes_each_platforms_flag():
    assert xla.remat_limit_flags("TPU", 14 * 2**30) == ([], ["--xla_tpu_max_hbm_size_mib=14336"])
    # 12 GiB of a 16 GiB GPU: 12 / (0.8 * 16) = 93.75%, rounded down to stay under the limit.
    flags, _ = xla.remat_limit_flags("GPU", 12 * 2**30, device_bytes=16 * 2**30)
    assert flags == ["--xla_gpu_memory_limit_slop_factor=93"]
    with pytest.raises(xla.XlaMemoryLimitError, match="memory size is unknown"):
        xla.remat_limit_flags("GPU", 2**30)
    with pytest.raises(xla.XlaMemoryLimitError, match="runs no rematerialization pass"):
        xla.remat_limit_flags("CPU", 2**30)


def test_an_xla_memory_limit_is_checked_when_the_runtime_is_made_and_started():
    with pytest.raises(ValueError, match="Runtime.xla_memory_limit"):
        Runtime(xla_memory_limit="lots")
    # This machine's runtime is a CPU: the setting would do nothing, so starting refuses it.
    with pytest.raises(xla.XlaMemoryLimitError, match="Trainer.remat_policy"):
        Runtime(xla_memory_limit="1GiB").start()


def test_device_memory_is_read_for_local_devices():
    assert tf_internals.device_memory_bytes("CPU") > 0
    assert tf_internals.device_memory_bytes("TPU") is None  # none on this machine
