"""Smoke tests of `benchmarks/`: each benchmark runs in `--quick` mode and prints its table.

The full runs take many minutes and their numbers depend on the machine; here only the plumbing is
checked (subprocess per setting, measuring, ratios, gradient check), on tiny models.
"""

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.subprocesses import REPO_DIR, child_env

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def run_benchmark(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs `benchmarks/SCRIPT ARGS` in a fresh interpreter; fails the test if it fails."""
    proc = subprocess.run(
        [sys.executable, str(REPO_DIR / "benchmarks" / script), *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def _table_rows(text: str, model: str) -> dict[str, list[str]]:
    """Table rows of `model`, keyed by setting, as lists of cells."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) > 2 and cells[0] == model:
            rows[cells[1]] = cells
    return rows


def _table_cells(text: str, width: int) -> list[list[str]]:
    """Rows of the markdown table with `width` columns, in order, as lists of cells."""
    lines = text.splitlines()
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    return [cells for cells in rows if len(cells) == width]


def _rows_by_first_cell(text: str, width: int) -> dict[str, list[str]]:
    """Rows of the markdown table with `width` columns, keyed by their first cell."""
    return {cells[0]: cells for cells in _table_cells(text, width)}


def test_remat_policies_quick(tmp_path):
    out = tmp_path / "remat_policies.md"
    run_benchmark(
        "remat_policies.py",
        "--quick",
        "--models=stack",
        "--settings=none,budget:0.2",
        f"--out={out}",
        f"--plot={tmp_path / 'remat_policies.png'}",
    )
    assert (tmp_path / "remat_policies.png").read_bytes().startswith(b"\x89PNG")
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/remat_policies.py --quick")
    assert "Machine: " in report and "TensorFlow 2." in report
    rows = _table_rows(report, "stack")
    assert set(rows) == {"no remat", "`budget:0.2`"}, report
    # Columns: model, setting, peak MiB, memory ratio, XLA temp, XLA total, step s, time ratio,
    # gradient error.
    base, full = rows["no remat"], rows["`budget:0.2`"]
    assert base[3] == "1.00" and base[7] == "1.00" and base[8] == "reference", base
    assert 0 < float(full[3]) < 1, full
    assert float(full[7]) > 0, full
    assert float(full[8]) < 1e-5, full


def test_remat_policies_compiled_for_a_tpu_quick(tmp_path):
    out = tmp_path / "remat_policies_tpu.md"
    run_benchmark(
        "remat_policies.py",
        "--quick",
        "--models=stack,decoder_lm",
        "--settings=none,nothing_saveable",
        "--target=v5e",
        "--compile_only",
        f"--out={out}",
    )
    report = out.read_text()
    assert "| XLA:CPU temp MiB | ratio | TPU v5e (libtpu 0.0.42" in report, report
    for model in ("stack", "decoder_lm"):
        rows = _table_rows(report, model)
        assert set(rows) == {"no remat", "`nothing_saveable`"}, report
        # Columns: model, setting, XLA:CPU temp MiB, ratio, TPU temp MiB, ratio (a tiny step's
        # scratch fits on chip: 0 MiB in HBM, no ratio), matmul FLOPs / no remat.
        base, full = rows["no remat"], rows["`nothing_saveable`"]
        assert base[3] == "1.00" and float(full[3]) < 1, report
        assert float(base[4]) >= 0 and float(full[4]) >= 0, report
        assert base[6] == "1.000" and float(full[6]) > 1, report  # the recomputed products
    assert "step s" not in report  # nothing ran


def test_tpu_xla_remat_quick():
    proc = run_benchmark(
        "tpu_xla_remat.py",
        "--quick",
        "--model=stack",
        "--fractions=0.5",
        "--policies=nothing_saveable",
    )
    rows = _rows_by_first_cell(proc.stdout, width=5)
    assert rows["no remat"][3] == "1.000", proc.stdout
    # Half the no-remat peak is below what this tiny step needs however XLA recomputes.
    (limited,) = [name for name in rows if name.startswith("no remat, XLA limit 0.5")]
    assert rows[limited][1].startswith("does not fit: RESOURCE_EXHAUSTED"), proc.stdout
    assert float(rows["`nothing_saveable`"][3]) > 1, proc.stdout  # the recomputed products


def test_tpu_compile_options_quick():
    proc = run_benchmark(
        "tpu_compile_options.py",
        "--quick",
        "--repeats=1",
        "--option_sets=xla_jf_llvm_use_fast_opt=true;exec_time_optimization_effort=-1",
    )
    rows = _rows_by_first_cell(proc.stdout, width=7)
    # Columns: options, compile s, time / defaults, same plan, temp MiB, code MiB, FLOPs.
    assert rows["defaults"][2:4] == ["1.00", "yes"], proc.stdout
    # Code generation's own switch leaves the memory plan as it is; XLA's lowest effort does not
    # (it fuses differently), which the comparison must be able to see.
    assert rows["`xla_jf_llvm_use_fast_opt=true`"][3] == "yes", proc.stdout
    assert rows["`exec_time_optimization_effort=-1`"][3] == "**no**", proc.stdout


def test_peak_buffers_names_what_the_plan_holds():
    proc = run_benchmark(
        "peak_buffers.py", "--gin_file=quickstart.gin", "--policy=nothing_saveable", "--top=3"
    )
    kinds = _rows_by_first_cell(proc.stdout, width=2)
    # The weights at the peak are the model's parameters in float32; the optimizer's state is
    # listed beside the program; the temporaries are grouped by the op they come from.
    assert float(kinds["weights"][1]) > 0 and float(kinds["gradients"][1]) > 0, proc.stdout
    assert "optimizer state (outside the program)" in kinds, proc.stdout
    assert len(_rows_by_first_cell(proc.stdout, width=3)) >= 2, proc.stdout  # header + groups


@pytest.mark.parametrize("layout", [[], ["--scan"]])
def test_jax_vit_memory_quick(layout):
    """JAX's own checkpointing on the same ViT, planned by jax's XLA:CPU (the TPU compile is the
    full run's): a step holds more than its temporaries, and full remat recomputes products."""
    proc = run_benchmark(
        "jax_vit_memory.py",
        "--quick",
        "--target=",
        "--policies=nothing_saveable",
        "--steps=1",
        *layout,
    )
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 6:
            rows[cells[0]] = cells
    base, full = rows["no remat"], rows["`nothing_saveable`"]
    assert float(base[1]) > float(base[2]) > 0, proc.stdout
    assert base[3] == "1.00" and float(full[3]) > 1.1, proc.stdout
    # The timed SGD step: seconds, and the ratio to no remat's.
    assert float(full[4]) > 0 and base[5] == "1.00" and float(full[5]) > 0, proc.stdout


def test_profile_step_quick():
    proc = run_benchmark(
        "profile_step.py",
        "--quick",
        "--model=stack",
        "--settings=none,nothing_saveable",
        "--steps=1",
    )
    assert "| operation kind | no remat ms | `nothing_saveable` ms |" in proc.stdout, proc.stdout
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3:
            rows[cells[0]] = [float(c) for c in cells[1:] if re.fullmatch(r"[\d.]+", c)]
    kinds = [name for name in rows if name.startswith("`")]
    assert kinds and all(len(rows[k]) == 2 for k in kinds), proc.stdout
    # Innermost operations only: the executable's `call` wrappers are never counted.
    assert "`call`" not in kinds, proc.stdout
    assert all(t > 0 for t in rows["all operations (summed over threads)"]), proc.stdout
    assert all(t > 0 for t in rows["step wall time, profiled"]), proc.stdout


def test_shard_levels_quick(tmp_path):
    out = tmp_path / "shard_levels.md"
    run_benchmark("shard_levels.py", "--quick", "--replicas=2", f"--out={out}", timeout=600)
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/shard_levels.py --quick")
    rows = _rows_by_first_cell(report, 7)
    levels = [r for r in rows if r.startswith("`")]
    assert levels == ["`none`", "`optimizer`", "`gradients`", "`weights`"], report
    assert rows["`none`"][2] == "1.00" and float(rows["`weights`"][1]) > 0
    # Unsharded, no all-gather; sharded, one, and less optimizer state kept per replica.
    assert rows["`none`"][4] == "0 B" and rows["`weights`"][4] != "0 B", report


def test_shard_plans_quick(tmp_path):
    out = tmp_path / "shard_plans.md"
    run_benchmark(
        "shard_plans.py", "--quick", "--policies=nothing_saveable", f"--out={out}", timeout=600
    )
    report = out.read_text()
    assert "libtpu's compiler (compile-only) for v5e-8" in report, report
    rows = {r[1]: r for r in _table_cells(report, 8) if r[1].startswith("`")}
    assert list(rows) == ["`none`", "`optimizer`", "`gradients`", "`weights`"], report
    kept = {level: float(row[5]) for level, row in rows.items()}
    # "program (temporaries; code)": what the program takes in and gives out is the rest.
    program = {
        level: [float(x) for x in re.findall(r"[\d.]+", row[4])] for level, row in rows.items()
    }
    inputs_and_outputs = {
        level: total - temp - code for level, (total, temp, code) in program.items()
    }
    # AdamW's two slots whole, against an eighth of them (plus the weights' shards); the
    # "weights" program takes (and gives back) shards where the others take whole weights.
    # Temporaries and code are left out: a tiny decoder's are the compiler's fixed costs.
    assert kept["`none`"] > 4 * kept["`optimizer`"] > 4 * kept["`weights`"], report
    assert inputs_and_outputs["`weights`"] < inputs_and_outputs["`gradients`"] / 2, report
    assert program["`none`"][0] > 0, report
    assert all(row[7] == "yes" for row in rows.values()), report


def test_scan_layers_quick(tmp_path):
    out = tmp_path / "scan_layers.md"
    run_benchmark("scan_layers.py", "--quick", f"--out={out}", "--steps=1", "--depths=2")
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/scan_layers.py --quick")
    assert "Step `trainer`" in report
    rows = [line for line in report.splitlines() if line.startswith("| 2 ")]
    assert len(rows) == 1, report
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        # depth, batch, policy, compile s (2), XLA temp (2) and ratio, peak (2), step s, ratio.
        assert cells[1] == "2" and all(float(c) >= 0 for c in cells[3:]), row


def test_scan_layers_plans_every_batch_quick(tmp_path):
    out = tmp_path / "scan_layers_plans.md"
    run_benchmark(
        "scan_layers.py",
        "--quick",
        f"--out={out}",
        "--depths=2",
        "--batches=1,2",
        "--compile_only",
        "--step=sgd",
    )
    report = out.read_text()
    assert "Plans for XLA:CPU" in report and "Step `sgd`" in report, report
    rows = [line for line in report.splitlines() if line.startswith("| 2 ")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    assert [c[1] for c in cells] == ["1", "2"], report
    # depth, batch, policy, compile s (2), temps (2) and their ratio, totals (2); XLA:CPU
    # reports no code size.
    assert all(float(c) > 0 for row in cells for c in row[7:10]), report
    assert all(row[10:] == ["-", "-"] for row in cells), report


def test_scan_layers_planned_for_a_tpu_quick(tmp_path):
    out = tmp_path / "scan_layers_tpu.md"
    run_benchmark("scan_layers.py", "--quick", f"--out={out}", "--depths=2", "--target=v5e")
    report = out.read_text()
    assert "TPU v5e (libtpu" in report, report
    rows = [line for line in report.splitlines() if line.startswith("| 2 ")]
    assert len(rows) == 1, report
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    # depth, batch, policy, compile s (2), temps (2) and their ratio, totals (2), code (2): a
    # plan, no step time. The tiny model's temporaries fit in the chip's on-chip memory, so its
    # HBM temps may be 0.
    assert len(cells) == 12, rows[0]
    compile_s, temps, totals_and_code = cells[3:5], cells[5:7], cells[8:12]
    assert all(float(c) > 0 for c in compile_s + totals_and_code), rows[0]
    assert all(float(c) >= 0 for c in temps), rows[0]


def test_faults_quick_kills_resumes_and_loses_nothing(tmp_path):
    """A SIGKILL while training: the restart takes over the lock and resumes, at most one
    checkpoint interval is lost, and every checkpoint left passes its checksum."""
    out = tmp_path / "faults.md"
    run_benchmark(
        "faults.py",
        "--quick",
        "--cycles=1",
        "--from_first_step",
        "--min_seconds=0.5",
        "--max_seconds=2",
        "--signals=KILL",
        f"--out={out}",
        timeout=600,
    )
    rows = dict(
        line.strip("|").split("|")[:2] for line in out.read_text().splitlines() if "|" in line
    )
    rows = {key.strip(): value.strip() for key, value in rows.items()}
    assert rows["runs resumed from a checkpoint"] == "1", rows
    assert rows["locks of killed runs taken over"] == "1", rows
    assert rows["fresh starts over existing checkpoints"] == "0", rows
    assert rows["checkpoints failing their checksum"].startswith("0 of "), rows
    assert rows["final step"] == "600 of 600", rows


@pytest.mark.skipif(
    importlib.util.find_spec("timm") is None, reason="PyTorch and timm are not installed"
)
def test_parity_timm_quick():
    report = run_benchmark("parity_timm.py", "--quick").stdout
    rows = [line for line in report.splitlines() if line.startswith("| ") and "case" not in line]
    assert len(rows) == 3 and all(row.endswith("| yes |") for row in rows), report


def test_vocab_sample_quick():
    report = run_benchmark("vocab_sample.py", "--quick").stdout
    assert re.search(r"\| corpus \| 0.2 MB of JSON lines in 2 files", report), report
    assert re.search(r"\| vocabulary \| [\d,]+ tokens \(vocab_size 1,000\) \|", report), report
    assert re.search(r"\| time to learn \| [\d.]+ s", report), report
    assert re.search(r"\| peak memory \| \+\d+ MiB", report), report


def test_text_resume_quick():
    report = run_benchmark("text_resume.py", "--quick").stdout
    rows = re.findall(r"^\| (\d+) \| ([\d,]+) \| ([\d.]+) s \| ([\d.]+) s \|$", report, re.M)
    assert [(step, tokens) for step, tokens, *_ in rows] == [("0", "0"), ("20", "81,920")], report


def test_remat_user_models_quick(tmp_path):
    out = tmp_path / "remat_user_models.md"
    run_benchmark("remat_user_models.py", "--quick", "--models=mixtral,mobilenetv3", f"--out={out}")
    report = out.read_text()
    assert report.startswith("Command: `python benchmarks/remat_user_models.py --quick")
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if "| " in line}
    assert "Segment" not in rows["mixtral"] and "Segments" in rows["mobilenetv3"], report
    for name in ("mixtral", "mobilenetv3"):  # Mixtral's blocks add losses: regions' results
        error = float(rows[name].strip("|").split("|")[-1])
        assert error < 1e-4, report


@pytest.mark.parametrize(
    "flag, said", [("--sizes=5b", "unknown size 5b"), ("--depths=x", "--depths takes block counts")]
)
def test_shard_plans_refuses_a_size_it_does_not_know(flag, said):
    proc = subprocess.run(
        [sys.executable, str(REPO_DIR / "benchmarks" / "shard_plans.py"), flag],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and f"error: {said}" in proc.stderr, proc.stderr


def test_long_sequences_quick(tmp_path):
    out = tmp_path / "long_sequences.md"
    run_benchmark("long_sequences.py", "--quick", f"--out={out}", timeout=600)
    report = out.read_text()
    assert "XLA:CPU and TPU v5e (libtpu, compile-only)" in report, report
    rows = {(r[0], r[1]): r for r in _table_cells(report, 7) if r[0] in ("256", "512")}
    assert set(rows) == {(s, w) for s in ("256", "512") for w in ("plain", "blockwise")}, report
    assert all(float(r[2]) > 0 and float(r[5]) > 0 for r in rows.values()), report
    losses = {r[1]: r for r in _table_cells(report, 4) if r[1] in ("whole", "chunked")}
    assert set(losses) == {"whole", "chunked"}, report


def test_long_sequences_times_the_settings_quick(tmp_path):
    out = tmp_path / "long_sequences_time.md"
    run_benchmark("long_sequences.py", "--quick", "--time", "--repeats=1", f"--out={out}")
    rows = [r for r in _table_cells(out.read_text(), 5) if r[0] in ("256", "512")]
    assert [r[1] for r in rows[:3]] == [
        "plain",
        "blockwise attention",
        "blockwise + chunked loss",
    ]
    assert all(float(r[2]) > 0 for r in rows), rows


def test_gpu_plans_quick(tmp_path):
    """One card (a plan for another is tests/planner/test_gpu_plan.py's): its plan, its plan
    with micro-batches, and XLA:GPU's own rematerialization under a limit."""
    out = tmp_path / "gpu_plans.md"
    run_benchmark(
        "gpu_plans.py",
        "--quick",
        "--cards=p100",
        "--microbatches=2",
        "--fractions=0.5",
        f"--out={out}",
        timeout=600,
    )
    report = out.read_text()
    assert "planned by XLA:GPU p100 sm_60" in report, report
    assert report.count("pick: remat policy none at batch size 64") == 2, report
    rows = _table_cells(report, 5)[2:]  # under the header and its rule
    assert [r[0] for r in rows] == ["unlimited", "its own", "0.5 of it"], report
