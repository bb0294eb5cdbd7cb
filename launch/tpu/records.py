"""The small local record of each TPU (under ~/.cache/framework/tpu_pod/): what `create` and `run`
were given, so that `resume` can repeat them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from launch.tpu.gcloud import Runner
from launch.tpu.options import Launch, SliceSpec, Tpu


def record_path(tpu: Tpu) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (
        cache / "framework" / "tpu_pod" / f"{tpu.project or 'default'}.{tpu.zone}.{tpu.name}.json"
    )


def load_record(tpu: Tpu) -> dict:
    path = record_path(tpu)
    return json.loads(path.read_text()) if path.is_file() else {}


def save_record(tpu: Tpu, runner: Runner, replace: bool = False, **fields: object) -> None:
    """Adds `fields` to the TPU's record (what `resume` repeats), or starts a new record with
    them (`replace`); nothing in a dry run."""
    if runner.dry_run:
        return
    path = record_path(tpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {} if replace else load_record(tpu)
    path.write_text(json.dumps({**record, **fields}, indent=1) + "\n")


def with_record(launch: Launch) -> Launch:
    """The command line with what it leaves out taken from the TPU's record: each field of the
    slice `create` made, and the training flags of the last `run`."""
    record = load_record(launch.tpu)
    given = dataclasses.asdict(launch.spec)
    spec = SliceSpec(
        **{field: record.get(field) if value is None else value for field, value in given.items()}
    )
    train_args = launch.train_args or tuple(record.get("train_args", ()))
    return dataclasses.replace(launch, spec=spec, train_args=train_args)
