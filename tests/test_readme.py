"""The README is a first document that stays true: its commands, files and configs exist."""

import re

from framework import cli
from tests.subprocesses import REPO_DIR

README = (REPO_DIR / "README.md").read_text()


def test_the_readme_test_command_is_what_ci_runs():
    (tests,) = re.findall(r"^python -m pytest .*$", README, re.M)
    ci_lines = (REPO_DIR / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines, f"{tests!r} is not a line of .ci/run"


def test_every_file_and_config_the_readme_names_exists():
    paths = set(re.findall(r"`((?:docs|benchmarks|framework|launch)/[\w/.-]+)", README))
    paths |= set(re.findall(r"(launch/[\w.]+)", README))
    assert paths, "the README names no file"
    missing = [p for p in sorted(paths) if not (REPO_DIR / p.rstrip("/")).exists()]
    assert not missing, f"the README names files that do not exist: {missing}"
    configs = set(re.findall(r"--gin_file=([\w/.]+\.gin)", README))
    assert {"vit_b16.gin", "lm_quickstart.gin"} <= configs
    missing = [c for c in sorted(configs) if not (cli.CONFIGS_DIR / c).exists()]
    assert not missing, f"the README names configs that do not exist: {missing}"


def test_the_readme_stays_a_first_document():
    """Under ~10 KB, no issue numbers; measurements live in benchmarks/results/ and docs/."""
    assert len(README.encode()) <= 10_500, len(README.encode())
    assert not re.search(r"\bissue \d", README, re.I)
