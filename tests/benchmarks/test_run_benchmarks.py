"""Smoke tests of the benchmarks of runs and their data (`faults.py`, `vocab_sample.py`,
`text_resume.py`)."""

import re

import pytest

from tests.benchmarks.tables import run_benchmark

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


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
