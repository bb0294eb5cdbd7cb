"""Creates a Cloud TPU VM (or pod slice), installs the project on it, runs training, cleans up.

    python launch/tpu_pod.py create --name=NAME --zone=ZONE --accelerator_type=v4-32 [--spot]
    python launch/tpu_pod.py setup  --name=NAME --zone=ZONE
    python launch/tpu_pod.py run    --name=NAME --zone=ZONE -- --gin_file=vit_b16.gin \
        --gin_file=runtime/tpu_pod.gin --model_dir=gs://BUCKET/runs/vit_b16
    python launch/tpu_pod.py logs   --name=NAME --zone=ZONE
    python launch/tpu_pod.py delete --name=NAME --zone=ZONE

Every subcommand is a short list of `gcloud` commands; `--dry_run` prints them exactly and runs
nothing. Without `--dry_run` they run one after the other and the first failure stops the launcher
with that command's exit status (nothing is retried silently). No TPU is reachable from this
project's CI: the tests check the commands built here, not a live pod.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
REMOTE_DIR = "~/framework"
ARCHIVE = "/tmp/framework.tar.gz"
LOG_FILE = "~/framework-train.log"
DEFAULT_RUNTIME = "tpu-vm-tf-2.21.0-pjrt"


def _project(args: argparse.Namespace) -> list[str]:
    return [f"--project={args.project}"] if args.project else []


def _tpus(args: argparse.Namespace, resource: str, verb: str) -> list[str]:
    """`gcloud compute tpus RESOURCE VERB NAME --zone=... [--project=...]`."""
    return [
        "gcloud",
        "compute",
        "tpus",
        resource,
        verb,
        args.name,
        f"--zone={args.zone}",
        *_project(args),
    ]


def _tpu_vm(args: argparse.Namespace, verb: str) -> list[str]:
    """`gcloud compute tpus tpu-vm VERB NAME --zone=...` (create, ssh, delete)."""
    return _tpus(args, "tpu-vm", verb)


def _on_workers(args: argparse.Namespace, remote_command: str) -> list[str]:
    """`gcloud ... ssh` running `remote_command` on the selected workers of the TPU VM."""
    return [*_tpu_vm(args, "ssh"), f"--worker={args.worker}", f"--command={remote_command}"]


def create_commands(args: argparse.Namespace) -> list[list[str]]:
    """A TPU VM directly, or a queued resource that waits for capacity."""
    tier = ["--spot"] if args.spot else ["--reserved"] if args.reserved else []
    if args.queued:
        return [
            [
                *_tpus(args, "queued-resources", "create"),
                f"--node-id={args.name}",
                f"--accelerator-type={args.accelerator_type}",
                f"--runtime-version={args.runtime_version}",
                *tier,
            ]
        ]
    return [
        [
            *_tpu_vm(args, "create"),
            f"--accelerator-type={args.accelerator_type}",
            f"--version={args.runtime_version}",
            *tier,
        ]
    ]


def setup_commands(args: argparse.Namespace) -> list[list[str]]:
    """Packs the committed project, copies it to every worker and installs it there."""
    install = (
        f"rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR} && "
        f"tar -xzf {Path(ARCHIVE).name} -C {REMOTE_DIR} && "
        f"cd {REMOTE_DIR} && python3 -m pip install -e ."
    )
    return [
        [
            "git",
            "-C",
            str(PROJECT_DIR),
            "archive",
            "--format=tar.gz",
            f"--output={ARCHIVE}",
            "HEAD",
        ],
        [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "scp",
            ARCHIVE,
            f"{args.name}:~/",
            f"--zone={args.zone}",
            f"--worker={args.worker}",
            *_project(args),
        ],
        _on_workers(args, install),
    ]


def run_commands(args: argparse.Namespace) -> list[list[str]]:
    """`python -m framework.train` with the user's flags on the workers, output kept in a log.

    The flags are quoted for the remote shell, so gin bindings with quotes and spaces arrive as
    typed; `pipefail` makes the command fail when training fails, not when `tee` succeeds.
    """
    train = shlex.join(["python3", "-m", "framework.train", *args.train_args])
    return [
        _on_workers(args, f"set -o pipefail; cd {REMOTE_DIR} && {train} 2>&1 | tee -a {LOG_FILE}")
    ]


def logs_commands(args: argparse.Namespace) -> list[list[str]]:
    return [_on_workers(args, f"tail -n {args.lines} {LOG_FILE}")]


def delete_commands(args: argparse.Namespace) -> list[list[str]]:
    if args.queued:
        return [[*_tpus(args, "queued-resources", "delete"), "--force", "--quiet"]]
    return [[*_tpu_vm(args, "delete"), "--quiet"]]


SUBCOMMANDS = {
    "create": create_commands,
    "setup": setup_commands,
    "run": run_commands,
    "logs": logs_commands,
    "delete": delete_commands,
}


def _split_at_double_dash(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's own arguments, and the training flags after the first `--`."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="run: ... -- FLAGS FOR framework.train"
    )
    parser.add_argument("subcommand", choices=SUBCOMMANDS)
    parser.add_argument("--name", required=True, help="the TPU VM (and queued resource) name")
    parser.add_argument("--zone", required=True, help="e.g. us-central2-b")
    parser.add_argument("--project", help="GCP project (default: gcloud's configured one)")
    parser.add_argument("--accelerator_type", default="v4-32", help="e.g. v4-8, v4-32, v5p-64")
    parser.add_argument("--runtime_version", default=DEFAULT_RUNTIME)
    tier = parser.add_mutually_exclusive_group()
    tier.add_argument("--spot", action="store_true", help="preemptible capacity")
    tier.add_argument("--reserved", action="store_true", help="the project's reservation")
    parser.add_argument(
        "--queued", action="store_true", help="create/delete through a queued resource"
    )
    parser.add_argument("--worker", default="all", help="'all' or a worker index for ssh/scp")
    parser.add_argument("--lines", type=int, default=100, help="log lines for `logs`")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    own, train_args = _split_at_double_dash(argv)
    args = parser.parse_args(own)
    args.train_args = train_args
    if args.train_args and args.subcommand != "run":
        parser.error(f"`{args.subcommand}` takes no training flags")
    if args.subcommand == "run" and not args.train_args:
        parser.error("`run` needs the flags for framework.train after --")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for command in SUBCOMMANDS[args.subcommand](args):
        print(("would run: " if args.dry_run else "running: ") + shlex.join(command), flush=True)
        if args.dry_run:
            continue
        try:
            status = subprocess.run(command, check=False).returncode
        except FileNotFoundError:
            print(
                f"error: {command[0]} is not installed (the Google Cloud SDK provides gcloud)",
                file=sys.stderr,
            )
            return 127
        if status != 0:
            print(
                f"error: `{shlex.join(command[:6])} ...` failed with status {status}",
                file=sys.stderr,
            )
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
