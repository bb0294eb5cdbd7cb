"""Kills a training run at random moments, restarts it each time, and checks nothing was lost.

Each cycle starts `python -m framework.train` on the quickstart (shortened) in one model_dir,
waits a random time - the kill lands during start-up, compilation, a train loop or a checkpoint
save - and sends SIGKILL (or SIGTERM, the preemption path). The next cycle restarts it. A last
start runs to the end. The report counts:

- runs resumed: restarts that restored a checkpoint (a restart before the first save starts fresh);
- fresh starts over checkpoints: restarts that started from scratch although checkpoints were on
  disk (must be 0);
- steps lost per kill: the last step logged before the kill minus the step the restart restored
  (at most one checkpoint interval);
- checkpoints failing their checksum: every committed checkpoint left at the end, each tensor read
  back, which checks its CRC (must be 0);
- lock refusals: restarts refused because the killed run still held the model_dir (must be 0).

    python benchmarks/faults.py --cycles=12 --out=benchmarks/results/faults.md
    python benchmarks/faults.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading

import tensorflow as tf
from reporting import REPO_DIR, machine, write_report

from framework.rundir import checkpoints

FULL_RUN = [
    "--gin_file=quickstart.gin",
    "--gin.Trainer.train_steps=2000",
    "--gin.Trainer.steps_per_loop=10",
    "--gin.data.shapes.eval_examples=128",
    "--mode=train",
]
QUICK_RUN = [
    "--gin_file=quickstart.gin",
    "--gin.Trainer.train_steps=600",
    "--gin.Trainer.steps_per_loop=10",
    "--gin.Trainer.global_batch_size=8",
    "--gin.data.shapes.image_size=8",
    "--gin.data.shapes.eval_examples=16",
    "--gin.models.VisionTransformer.image_size=8",
    "--gin.models.VisionTransformer.depth=1",
    "--gin.models.VisionTransformer.dim=16",
    "--gin.models.VisionTransformer.mlp_dim=16",
    "--mode=train",
]
STEP = re.compile(r"step (\d+)/(\d+):")
RESTORED = re.compile(r"restored step (\d+)")
FRESH = "starting from scratch"
LOCK_HELD = "in use by another run"
LOCK_TAKEN_OVER = "took over"


class Run:
    """One start of the trainer, its log read as it comes."""

    def __init__(self, args: list[str]):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_DIR, env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "framework.train", *args],
            cwd=REPO_DIR,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

        self.trained = threading.Event()  # set at the first logged step

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)
            if STEP.search(line):
                self.trained.set()

    def finish(self, after: float | None, signum: int, from_first_step: bool = False) -> int:
        """Waits `after` seconds (None: for the end) from now or, with `from_first_step`, from
        the first logged step, then sends `signum`; returns the exit status."""
        if after is not None and from_first_step:
            while not self.trained.wait(0.1) and self.process.poll() is None:
                pass
        try:
            self.process.wait(timeout=after)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signum)
            self.process.wait()
        self._reader.join()
        return self.process.returncode

    def last(self, pattern: re.Pattern) -> int | None:
        found = [int(m[1]) for line in self.lines if (m := pattern.search(line))]
        return found[-1] if found else None

    def says(self, text: str) -> bool:
        return any(text in line for line in self.lines)


def corrupt_checkpoints(directory: str) -> list[str]:
    """The committed checkpoints in `directory` that fail to read back (checksums included)."""
    failing = []
    for prefix in checkpoints.list_checkpoints(directory).committed:
        try:
            reader = tf.train.load_checkpoint(prefix)
            for name in reader.get_variable_to_shape_map():
                reader.get_tensor(name)
        except Exception as error:  # noqa: BLE001 (TF raises many types for a bad file)
            failing.append(f"{prefix}: {str(error).splitlines()[0][:100]}")
    return failing


def run_cycles(
    cycles: int,
    run_args: list[str],
    delays: tuple[float, float],
    signals: list[str],
    seed: int,
    from_first_step: bool = False,
) -> dict:
    """Kills and restarts the run `cycles` times, then lets it finish; returns the counts."""
    rng = random.Random(seed)
    model_dir = tempfile.mkdtemp(prefix="faults-")
    args = [*run_args, f"--model_dir={model_dir}"]
    interval = int(next(a for a in run_args if "steps_per_loop" in a).split("=")[1])
    counts = dict(
        resumed=0, fresh_over_checkpoints=0, lock_refusals=0, locks_taken_over=0, other_failures=0
    )
    lost, kills = [], {name: 0 for name in signals}
    last_logged, after_kill = None, False
    for cycle in range(cycles + 1):
        had_checkpoints = bool(checkpoints.list_checkpoints(f"{model_dir}/checkpoints").committed)
        run = Run(args)
        final = cycle == cycles
        name = rng.choice(signals)
        delay = None if final else rng.uniform(*delays)
        status = run.finish(delay, getattr(signal, f"SIG{name}"), from_first_step)
        restored = run.last(RESTORED)
        if restored is not None:
            counts["resumed"] += 1
            if after_kill and last_logged is not None:
                lost.append(max(last_logged - restored, 0))
        elif had_checkpoints and run.says(FRESH):
            counts["fresh_over_checkpoints"] += 1
        counts["lock_refusals"] += run.says(LOCK_HELD)
        counts["locks_taken_over"] += run.says(LOCK_TAKEN_OVER)
        killed = status in (-signal.SIGKILL, -signal.SIGTERM, 42) and not final
        kills[name] += killed
        # Steps lost are counted at the first restore after a kill (a start can die before it).
        after_kill = killed or (after_kill and restored is None)
        if status != 0 and not killed:
            counts["other_failures"] += 1
            print("".join(run.lines[-20:]), file=sys.stderr)
        last_logged = run.last(STEP) if run.last(STEP) is not None else last_logged
        print(
            f"cycle {cycle}: status {status}, restored {restored}, last step {run.last(STEP)}",
            flush=True,
        )
    return {
        **counts,
        "cycles": cycles,
        "kills": kills,
        "steps_lost_max": max(lost, default=0),
        "steps_lost_mean": sum(lost) / len(lost) if lost else 0.0,
        "checkpoint_interval": interval,
        "final_step": last_logged,
        "train_steps": int(next(a for a in run_args if "train_steps" in a).split("=")[1]),
        "corrupt": corrupt_checkpoints(f"{model_dir}/checkpoints"),
        "checked": len(checkpoints.list_checkpoints(f"{model_dir}/checkpoints").committed),
        "model_dir": model_dir,
    }


def format_report(result: dict, command: str, delays: tuple[float, float], anchor: str) -> str:
    kills = ", ".join(f"{n} SIG{name}" for name, n in result["kills"].items())
    rows = [
        (
            "starts killed at a random moment",
            f"{result['cycles']}, {delays[0]:g}-{delays[1]:g} s after {anchor} "
            f"(landed: {kills}; the others found the run finished)",
        ),
        ("runs resumed from a checkpoint", result["resumed"]),
        ("fresh starts over existing checkpoints", result["fresh_over_checkpoints"]),
        ("locks of killed runs taken over", result["locks_taken_over"]),
        ("restarts refused by a stale lock", result["lock_refusals"]),
        ("other failures", result["other_failures"]),
        (
            "steps lost per kill (max / mean)",
            f"{result['steps_lost_max']} / {result['steps_lost_mean']:.1f} "
            f"(checkpoint interval {result['checkpoint_interval']})",
        ),
        ("final step", f"{result['final_step']} of {result['train_steps']}"),
        (
            "checkpoints failing their checksum",
            f"{len(result['corrupt'])} of {result['checked']} left on disk",
        ),
    ]
    table = "\n".join(f"| {what} | {value} |" for what, value in rows)
    corrupt = "".join(f"\n- {line}" for line in result["corrupt"])
    return (
        f"Command: `{command}`\n\nMachine: {machine()}\n\n"
        f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}, load average "
        f"{os.getloadavg()[0]:.2f}\n\n| | |\n|---|---|\n{table}\n{corrupt}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=12)
    parser.add_argument("--signals", default="KILL,KILL,TERM", help="chosen from at random")
    parser.add_argument("--min_seconds", type=float, default=4.0)
    parser.add_argument("--max_seconds", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--from_first_step",
        action="store_true",
        help="count the delay from the first logged step instead of from the start",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny run, for a smoke test")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    delays = (args.min_seconds, args.max_seconds)
    result = run_cycles(
        args.cycles,
        QUICK_RUN if args.quick else FULL_RUN,
        delays,
        args.signals.split(","),
        args.seed,
        args.from_first_step,
    )
    command = shlex.join(["python", "benchmarks/faults.py", *sys.argv[1:]])
    anchor = "the first logged step" if args.from_first_step else "the start"
    write_report(format_report(result, command, delays, anchor), args.out)
    ok = (
        not result["corrupt"]
        and result["fresh_over_checkpoints"] == result["lock_refusals"] == 0
        and result["other_failures"] == 0
        and result["final_step"] == result["train_steps"]
        and result["steps_lost_max"] <= result["checkpoint_interval"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
