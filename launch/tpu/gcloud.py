"""Running the launcher's commands (`Runner`: one at a time, the first failure stops, `--dry_run`
prints them) and the `gcloud compute tpus` commands it runs: create, delete, ssh, describe."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from collections.abc import Sequence

from launch.tpu.errors import LaunchError
from launch.tpu.options import SliceSpec, Tpu

READY = "READY"
RECREATE_STATES = {"PREEMPTED", "TERMINATED", "NOT_FOUND", "SUSPENDED", "FAILED"}
TRANSIENT_STATES = {
    "CREATING",
    "STARTING",
    "RESTARTING",
    "REPAIRING",
    "ACCEPTED",
    "PROVISIONING",
    "WAITING_FOR_RESOURCES",
    "SUSPENDING",
    "DELETING",
}
QUEUED_WAITING = {"CREATING", "ACCEPTED", "PROVISIONING", "WAITING_FOR_RESOURCES"}


class Runner:
    """Runs commands one at a time and stops at the first failure; `dry_run` only prints them."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run

    def _announce(self, command: Sequence[str]) -> None:
        print(("would run: " if self.dry_run else "running: ") + shlex.join(command), flush=True)

    def run(self, command: Sequence[str]) -> None:
        """Runs `command` with its output on the terminal; a failure raises with its status."""
        self._announce(command)
        if not self.dry_run:
            _check(command, _execute(command, capture=False))

    def capture(self, command: Sequence[str]) -> subprocess.CompletedProcess | None:
        """Runs `command` for its output (None in a dry run); the caller checks its status."""
        self._announce(command)
        return None if self.dry_run else _execute(command, capture=True)

    def output(self, command: Sequence[str]) -> str | None:
        """The standard output of a command that must succeed (None in a dry run)."""
        result = self.capture(command)
        if result is None:
            return None
        _check(command, result)
        return result.stdout


def _execute(command: Sequence[str], capture: bool) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, check=False, capture_output=capture, text=True)
    except FileNotFoundError:
        raise LaunchError(
            f"{command[0]} is not installed (the Google Cloud SDK provides gcloud)", 127
        ) from None


def _check(command: Sequence[str], result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        if result.stderr:
            sys.stderr.write(result.stderr)
        raise LaunchError(
            f"`{shlex.join(command[:6])} ...` failed with status {result.returncode}",
            result.returncode,
        )


def project_flag(project: str | None) -> list[str]:
    """`--project=...`, or nothing for gcloud's configured project."""
    return [f"--project={project}"] if project else []


def tpus(tpu: Tpu, resource: str, verb: str) -> list[str]:
    """`gcloud compute tpus RESOURCE VERB NAME --zone=... [--project=...]`."""
    return [
        "gcloud",
        "compute",
        "tpus",
        resource,
        verb,
        tpu.name,
        f"--zone={tpu.zone}",
        *project_flag(tpu.project),
    ]


def ssh(tpu: Tpu, worker: str, script: str) -> list[str]:
    """`gcloud ... ssh` running the shell `script` on one worker (an index) or on `all`."""
    return [*tpus(tpu, "tpu-vm", "ssh"), f"--worker={worker}", f"--command={script}"]


def create_command(tpu: Tpu, spec: SliceSpec) -> list[str]:
    """A TPU VM directly (gcloud waits until it is READY), or a queued resource request."""
    tier = ["--spot"] if spec.spot else ["--reserved"] if spec.reserved else []
    if spec.queued:
        return [
            *tpus(tpu, "queued-resources", "create"),
            f"--node-id={tpu.name}",
            f"--accelerator-type={spec.accelerator_type}",
            f"--runtime-version={spec.runtime_version}",
            *tier,
        ]
    return [
        *tpus(tpu, "tpu-vm", "create"),
        f"--accelerator-type={spec.accelerator_type}",
        f"--version={spec.runtime_version}",
        *tier,
    ]


def delete_command(tpu: Tpu, queued: bool | None) -> list[str]:
    """Deletes the TPU; `--force` also deletes a queued resource's TPU."""
    if queued:
        return [*tpus(tpu, "queued-resources", "delete"), "--force", "--quiet"]
    return [*tpus(tpu, "tpu-vm", "delete"), "--quiet"]


def with_accelerator_type(tpu: Tpu, spec: SliceSpec, runner: Runner) -> SliceSpec:
    """`spec` with the TPU's accelerator type: as given, as recorded at `create`, or else as
    gcloud reports it (asked once, here, by the subcommands that need it)."""
    if spec.accelerator_type:
        return spec
    if runner.dry_run:
        raise LaunchError(
            f"no record of {tpu.name}: pass --accelerator_type (a dry run asks gcloud nothing)", 2
        )
    output = runner.output([*tpus(tpu, "tpu-vm", "describe"), "--format=value(acceleratorType)"])
    return dataclasses.replace(spec, accelerator_type=output.strip())


def described_state(runner: Runner, command: list[str]) -> str | None:
    """The state a `describe` prints; NOT_FOUND when the resource does not exist."""
    result = runner.capture(command)
    if result is None:
        return None
    if result.returncode != 0 and "NOT_FOUND" in result.stderr:
        return "NOT_FOUND"
    _check(command, result)
    return result.stdout.strip()


def slice_state(tpu: Tpu, queued: bool | None, runner: Runner) -> str | None:
    """READY, PREEMPTED, ...; for a queued resource its own state until it is ACTIVE."""
    if queued:
        queued_state = described_state(
            runner, [*tpus(tpu, "queued-resources", "describe"), "--format=value(state.state)"]
        )
        if queued_state != "ACTIVE":
            return queued_state
    return described_state(runner, [*tpus(tpu, "tpu-vm", "describe"), "--format=value(state)"])
