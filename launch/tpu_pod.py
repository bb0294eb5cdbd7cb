"""Creates a Cloud TPU VM or pod slice, installs the project on it, and trains there detached.

    python launch/tpu_pod.py create   --name=NAME --zone=ZONE --accelerator_type=v4-32 [--spot]
                                      [--queued [--no_wait]]
    python launch/tpu_pod.py setup    --name=NAME --zone=ZONE
    python launch/tpu_pod.py run      --name=NAME --zone=ZONE [--until_done] -- \
        --gin_file=vit_b16.gin --model_dir=gs://BUCKET/runs/vit_b16
    python launch/tpu_pod.py logs     --name=NAME --zone=ZONE [--follow] [--worker=all]
    python launch/tpu_pod.py status   --name=NAME --zone=ZONE
    python launch/tpu_pod.py stop     --name=NAME --zone=ZONE
    python launch/tpu_pod.py resume   --name=NAME --zone=ZONE
    python launch/tpu_pod.py delete   --name=NAME --zone=ZONE
    python launch/tpu_pod.py versions --zone=ZONE [--accelerator_type=v4-32]

Every step is a `gcloud` (or `git`) command; `--dry_run` prints them exactly and runs nothing.
Otherwise they run one after the other and the first failure stops the launcher with that
command's exit status (nothing is retried silently).

How a TPU runs TensorFlow decides the shape of `run`. A single-host TPU VM (v4-8, v5litepod-8,
v6e-8, ...) runs the client itself: `tpu='local'` with the PJRT plug-in (libtpu). A multi-host
slice (v4-16 and up, v5litepod-16 and up, v5p-16 and up) runs the image's TPU worker service on
every host, and ONE TensorFlow client on worker 0 drives all of them through
`TPUClusterResolver(tpu=NAME)`; a client per host would be several chiefs writing one model_dir.
`run` therefore always starts a single training process, on worker 0, detached from the ssh
session (it outlives a dropped connection); `logs`, `status` and `stop` look at it later, and
`resume` recreates a preempted Spot slice and restarts the recorded command. What `create` and
`run` were given is kept in a small record per TPU under ~/.cache/framework/tpu_pod/ so that
`resume` can repeat it.

No TPU is reachable from this project's CI: the tests drive this launcher against a stand-in
`gcloud` (tests/fake_gcloud.py) that plays TPU states and runs the remote scripts in local
directories; what only a real TPU can show is listed in docs/launch.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

# Run as a script (`python launch/tpu_pod.py`), the launcher finds its modules from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch import usage
from launch.tpu.commands import (
    create,
    delete,
    flag_values,
    logs,
    resume,
    run,
    setup,
    status,
    stop,
    unknown_gin_files,
    versions,
)
from launch.tpu.errors import LaunchError
from launch.tpu.gcloud import Runner, with_accelerator_type
from launch.tpu.options import Launch, Polling, SliceSpec
from launch.tpu.records import with_record

SUBCOMMANDS = ("create", "setup", "run", "logs", "status", "stop", "resume", "delete", "versions")


def _split_at_double_dash(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's own arguments, and the training flags after the first `--`."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _parser() -> argparse.ArgumentParser:
    parser = usage.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="run/resume: ... -- FLAGS FOR framework.train"
    )
    parser.add_argument("subcommand", choices=SUBCOMMANDS)
    parser.add_argument("--name", help="the TPU VM (and queued resource) name")
    parser.add_argument("--zone", required=True, help="e.g. us-central2-b")
    parser.add_argument("--project", help="GCP project (default: gcloud's configured one)")
    parser.add_argument("--accelerator_type", help="e.g. v4-8, v4-32, v5litepod-16, v5p-32")
    parser.add_argument("--runtime_version", help="default: tpu-vm-tf-2.20.0[-pod]-pjrt")
    tier = parser.add_mutually_exclusive_group()
    tier.add_argument("--spot", action="store_true", default=None, help="preemptible capacity")
    tier.add_argument("--reserved", action="store_true", default=None, help="a reservation")
    parser.add_argument("--queued", action="store_true", default=None, help="a queued resource")
    parser.add_argument("--no_wait", action="store_true", help="create --queued: do not wait")
    parser.add_argument("--wait_minutes", type=float, default=60, help="create --queued: bound")
    parser.add_argument("--poll_seconds", type=float, default=30, help="between state checks")
    parser.add_argument("--until_done", action="store_true", help="run: resume until finished")
    parser.add_argument("--max_resumes", type=int, default=10, help="run --until_done: bound")
    parser.add_argument("--libtpu_flags", help="setup on a pod: LIBTPU_INIT_ARGS of the hosts")
    parser.add_argument("--worker", default="0", help="logs: a worker index or 'all'")
    parser.add_argument("--lines", type=int, default=100, help="logs: lines of the tail")
    parser.add_argument("--follow", action="store_true", help="logs: keep streaming")
    parser.add_argument("--stop_timeout", type=int, default=600, help="stop: seconds to wait")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    return parser


def _model_dir(train_args: Sequence[str]) -> str | None:
    """The last --model_dir among the training flags."""
    values = flag_values(train_args, "model_dir")
    return values[-1][1] if values else None


def parse_args(argv: Sequence[str]) -> Launch:
    """The command line, checked (a usage error exits with status 2), with what it leaves out of
    a TPU's options taken from the TPU's record (every subcommand but `create` and `versions`)."""
    parser = _parser()
    own, train_args = _split_at_double_dash(argv)
    args = parser.parse_args(own)
    if train_args and args.subcommand not in ("run", "resume"):
        parser.error(f"`{args.subcommand}` takes no training flags")
    if args.subcommand == "run" and not train_args:
        parser.error("`run` needs the flags for framework.train after --")
    model_dir = _model_dir(train_args)
    if model_dir is not None and "://" not in model_dir and not os.path.isabs(model_dir):
        parser.error(
            f"--model_dir={model_dir} is relative: the trainer runs on the TPU VM, where it would "
            "name a directory on the VM's disk (lost with the VM), not one under this directory; "
            "use gs://BUCKET/... (or an absolute path on the VM)"
        )
    unknown = unknown_gin_files(train_args)
    if unknown:
        parser.error(
            f"--gin_file={unknown[0]} is neither a file here nor one of the package's configs "
            "(configs/): the launcher copies files from this machine to the TPU VM"
        )
    if args.subcommand != "versions" and not args.name:
        parser.error(f"`{args.subcommand}` needs --name")
    if args.worker != "all" and not args.worker.isdigit():
        parser.error(f"--worker must be 'all' or a worker index, got {args.worker!r}")
    for flag in (args.libtpu_flags or "").split():
        if not flag.startswith("--") or re.search(r"[\"'\\|$%`&]", flag):
            parser.error(f"--libtpu_flags: {flag!r} must be a plain --flag=value")
    launch = Launch(
        subcommand=args.subcommand,
        name=args.name,
        zone=args.zone,
        project=args.project,
        spec=SliceSpec(
            args.accelerator_type, args.runtime_version, args.spot, args.reserved, args.queued
        ),
        train_args=tuple(train_args),
        polling=Polling(args.poll_seconds, args.wait_minutes, args.max_resumes),
        wait=not args.no_wait,
        until_done=args.until_done,
        libtpu_flags=None if args.libtpu_flags is None else tuple(args.libtpu_flags.split()),
        worker=args.worker,
        lines=args.lines,
        follow=args.follow,
        stop_timeout=args.stop_timeout,
        dry_run=args.dry_run,
    )
    if launch.subcommand in ("create", "versions"):  # `create` starts a new record
        return launch
    return with_record(launch)


def perform(launch: Launch, runner: Runner) -> None:
    """Runs the subcommand, handing it the parts of the command line it reads."""
    match launch.subcommand:
        case "create":
            create(
                launch.tpu,
                launch.spec,
                launch.train_args,
                runner,
                polling=launch.polling,
                wait=launch.wait,
            )
        case "setup":
            spec = with_accelerator_type(launch.tpu, launch.spec, runner)
            setup(launch.tpu, spec.accelerator_type, launch.libtpu_flags, runner)
        case "run":
            run(launch.job, runner, until_done=launch.until_done)
        case "logs":
            logs(launch.tpu, launch.worker, launch.lines, launch.follow, runner)
        case "status":
            status(launch.tpu, launch.spec, runner)
        case "stop":
            stop(launch.tpu, launch.stop_timeout, runner)
        case "resume":
            resume(launch.job, runner)
        case "delete":
            delete(launch.tpu, launch.spec.queued, runner)
        case "versions":
            versions(launch.zone, launch.project, launch.spec.accelerator_type, runner)


def main(argv: Sequence[str] | None = None) -> int:
    launch = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        perform(launch, Runner(launch.dry_run))
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.status
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
