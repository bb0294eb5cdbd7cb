"""`python -m framework.planner --target=<GPU>`: XLA's GPU compiler plans each setting for the
card named, on this CPU host; and a plan that fits only because that compiler rematerialized by
itself says so."""

import json

import pytest

from framework import planner
from framework.memory import gpu
from framework.planner import Measurement
from tests.planner.test_plan import POLICIES, TINY, measurements, run_module


@pytest.mark.slow
def test_a_gpu_target_plans_every_setting_with_the_gpu_compiler(tmp_path):
    """--target=a100-40gb: the card's memory is the budget, its TensorFloat-32 peak times the
    float32 step, the table names the compiler, and recomputation shows in the FLOPs."""
    result = run_module(
        "framework.planner",
        *TINY,
        POLICIES,
        "--target=a100-40gb",
        "--search_budget=false",
        f"--model_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan_json = json.loads((tmp_path / "plan.json").read_text())
    assert plan_json["budget_bytes"] == gpu.gpu_card("a100-40gb").memory_bytes
    none, full = measurements(plan_json)
    for m in (none, full):
        assert m.ok and m.measure == "compile" and m.compiler.startswith("XLA:GPU a100-40gb sm_80")
        assert m.peak_flops == 156e12 and m.compiled_step_bytes > m.state_bytes > 0
        assert m.unlimited_peak_bytes is None  # megabytes on a 40 GB card: nothing to recompute
    assert full.step_flops > none.step_flops > 0
    assert full.compiled_temp_bytes < none.compiled_temp_bytes
    assert plan_json["pick"]["policy"] == "none"
    assert "planned by XLA:GPU a100-40gb sm_80 (jax-cuda12-plugin " in result.stdout


def _compiled(policy: str, peak: int, unlimited: int | None = None) -> Measurement:
    return Measurement(
        policy,
        64,
        compiled_peak_bytes=peak,
        compiled_total_bytes=peak,
        compiled_temp_bytes=peak // 2,
        measure="compile",
        state_bytes=2**30,
        step_flops=1e12,
        peak_flops=10e12,
        compiler="XLA:GPU p100 sm_60 (jax-cuda12-plugin 0.10.2)",
        unlimited_peak_bytes=unlimited,
    )


def test_a_pick_that_fits_by_the_compilers_own_remat_says_so():
    rematerialized = _compiled("none", 12 * 2**30, unlimited=20 * 2**30)
    plan = planner.choose([rematerialized, _compiled("full", 6 * 2**30)], 16 * 2**30, 0.1, 0.05)
    assert plan.pick is rematerialized
    assert plan.pick.compiler_remat_bytes == 8 * 2**30
    assert planner.verdict(plan).endswith(
        "; it fits because XLA:GPU p100 sm_60 rematerializes by itself (without a memory limit "
        "it plans 21.00 GiB)"
    )
    rows = planner.table(plan).splitlines()
    assert rows[2].endswith("PICK (the compiler recomputes 8192.0 MiB of it)")
    assert rows[3].endswith("yes")


def test_a_plan_the_compiler_left_alone_says_nothing_of_it():
    plan = planner.choose([_compiled("none", 12 * 2**30, unlimited=12 * 2**30)], 16 * 2**30)
    assert plan.pick.compiler_remat_bytes == 0
    assert "rematerializes" not in planner.verdict(plan)


def test_a_gpu_host_plans_for_its_own_card(monkeypatch):
    """Without --target a plan that compiles is the host's GPU's, chosen by the name CUDA
    reports (this host has none: TensorFlow's device listing is replaced); a plan that runs
    measures on the GPU itself."""
    assert gpu.local_card() is None  # no GPU here: plans compile for this host, as before
    assert planner.plan_target(None, "compile") is None
    monkeypatch.setattr(gpu, "local_card", lambda: gpu.gpu_card("Tesla V100-SXM2-32GB"))
    assert planner.plan_target(None, "compile") == "v100-32gb"
    assert planner.plan_target(None, "auto") == "v100-32gb"
    assert gpu.gpu_card("v100-32gb").memory_bytes == 2 * gpu.gpu_card("v100").memory_bytes
    assert planner.plan_target(None, "run") is None
    assert planner.plan_target("v5e", "auto") == "v5e"  # a named device wins
    with pytest.raises(ValueError, match="a plan for p100 is compiled, not run"):
        planner.plan_target("p100", "run")
