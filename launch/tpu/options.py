"""The launcher's command line as frozen records: `launch/tpu_pod.py` parses it once into a
`Launch`, and each subcommand is handed the parts it reads (the TPU, what `create` makes, how to
wait). What a step works out on the way (the runtime `create` picks, the accelerator type gcloud
reports, what the TPU's record adds) comes back as a new record: nothing is written into the
command line after it is parsed, so what a subcommand reads is what it was given."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tpu:
    """Which TPU gcloud acts on: `project` None is gcloud's configured project."""

    name: str
    zone: str
    project: str | None


@dataclass(frozen=True)
class SliceSpec:
    """What `create` makes. The TPU's record keeps it, so that `resume` can make the same slice
    again; a field is None when neither the command line nor the record gives it."""

    accelerator_type: str | None = None
    runtime_version: str | None = None
    spot: bool | None = None
    reserved: bool | None = None
    queued: bool | None = None


@dataclass(frozen=True)
class Polling:
    """How the launcher waits on Cloud TPU: seconds between state checks, minutes a queued
    resource may wait for capacity, and how many resumes `run --until_done` makes at most."""

    poll_seconds: float
    wait_minutes: float
    max_resumes: int


@dataclass(frozen=True)
class TrainingJob:
    """What `run`, `resume` and `run --until_done` work from: the TPU, the slice to make again if
    it is preempted (`accelerator_type` known), the flags for framework.train, how to wait, and
    the libtpu flags a remade slice is set up with (None: as the image has them)."""

    tpu: Tpu
    spec: SliceSpec
    train_args: tuple[str, ...]
    polling: Polling
    libtpu_flags: tuple[str, ...] | None


@dataclass(frozen=True)
class Launch:
    """The whole command line, parsed and checked (the flags are in `tpu_pod.py --help`).

    `name` is None only for `versions`, the one subcommand that acts on no TPU. `train_args` are
    the flags for framework.train after `--`; `libtpu_flags` None leaves the pod hosts' setting
    as it is, an empty tuple removes it.
    """

    subcommand: str
    name: str | None
    zone: str
    project: str | None
    spec: SliceSpec
    train_args: tuple[str, ...]
    polling: Polling
    wait: bool
    until_done: bool
    libtpu_flags: tuple[str, ...] | None
    worker: str
    lines: int
    follow: bool
    stop_timeout: int
    dry_run: bool

    @property
    def tpu(self) -> Tpu:
        """The TPU the subcommand acts on (`tpu_pod.parse_args` requires --name for it)."""
        return Tpu(self.name, self.zone, self.project)

    @property
    def job(self) -> TrainingJob:
        """The training job the command line describes (`run`, `resume`)."""
        return TrainingJob(self.tpu, self.spec, self.train_args, self.polling, self.libtpu_flags)
