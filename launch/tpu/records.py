"""The small local record of each TPU (under ~/.cache/framework/tpu_pod/): what `create` and `run`
were given, so that `resume` can repeat them."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from launch.tpu.gcloud import Runner

RECORDED = ("accelerator_type", "runtime_version", "spot", "reserved", "queued")


def record_path(args: argparse.Namespace) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (
        cache
        / "framework"
        / "tpu_pod"
        / f"{args.project or 'default'}.{args.zone}.{args.name}.json"
    )


def load_record(args: argparse.Namespace) -> dict:
    path = record_path(args)
    return json.loads(path.read_text()) if path.is_file() else {}


def save_record(
    args: argparse.Namespace, runner: Runner, replace: bool = False, **fields: object
) -> None:
    """Adds `fields` to the TPU's record (what `resume` repeats), or starts a new record with
    them (`replace`); nothing in a dry run."""
    if runner.dry_run:
        return
    path = record_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {} if replace else load_record(args)
    path.write_text(json.dumps({**record, **fields}, indent=1) + "\n")


def apply_record(args: argparse.Namespace) -> None:
    """Fills the options not given on the command line from the TPU's record."""
    record = load_record(args)
    for field in RECORDED:
        if getattr(args, field) is None:
            setattr(args, field, record.get(field))
    if not args.train_args:
        args.train_args = record.get("train_args", [])
