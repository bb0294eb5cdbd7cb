"""What the planner hands its child processes (`child.py`): how to measure, the trainer's
configuration, and the combinations to measure, as records that cross the process boundary as
JSON (the spec on the command line, a compile worker's jobs one line each on stdin).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence


class Measure(str, enum.Enum):
    """How a plan measures its combinations (`--measure`); a string, so flag values compare
    equal and JSON keeps the word."""

    # Run the combinations when XLA's plan of the largest fits the host, else compile them.
    AUTO = "auto"
    # Each combination runs in a fresh process: its allocator peak and median step time.
    RUN = "run"
    # XLA's plan of each combination in compile workers, nothing run; times from its FLOPs.
    COMPILE = "compile"

    def __str__(self) -> str:
        """The word, not `Measure.RUN`: log lines and messages show what `--measure` takes."""
        return self.value


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The trainer's configuration as the binaries got it: gin files, bindings, search paths."""

    files: Sequence[str]
    bindings: Sequence[str]
    search_paths: Sequence[str]


@dataclasses.dataclass(frozen=True)
class Combination:
    """One setting to measure: a remat policy at a global batch size (None: the config's) and
    a level of `Trainer.shard_state`."""

    policy: str
    batch_size: int | None
    shard_state: str = "none"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Combination:
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a child process is started with. A run child (`Measure.RUN`) measures `combination`
    over `steps` timed steps; a compile worker (`Measure.COMPILE`) builds the trainer once and
    reads its combinations from stdin, compiling for `target` (a TPU chip or slice, or a GPU
    card: `memory.targets.target_device`; None: this host's device)."""

    config: RunConfig
    measure: Measure
    combination: Combination | None = None
    steps: int = 0
    target: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> WorkerSpec:
        combination = data["combination"]
        return cls(
            config=RunConfig(**data["config"]),
            measure=Measure(data["measure"]),
            combination=None if combination is None else Combination.from_json(combination),
            steps=data["steps"],
            target=data["target"],
        )
