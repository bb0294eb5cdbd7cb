"""Sharded training state on N logical CPU devices: each level's step time against the unsharded
step, the bytes its collectives move, and what each replica keeps.

One process splits the CPU into N logical devices (`mirrored`) and builds a trainer for each
level of `Trainer.shard_state` (same model, data and seed), compiles each, then times one host
loop of `--steps` steps per level in turns, `--rounds` times: the median loop time per step and
its ratio to the unsharded step, all from the same run. On logical CPU devices a collective is a
copy within one memory: the ratios show the work the extra collectives and the sharded update
add, not what a GPU's or a TPU's interconnect costs.

Bytes per replica per step are those of the collectives the step makes on CPUs and GPUs, in a
ring of N replicas (an all-reduce of B bytes sends and receives 2 (N-1)/N B; an all-gather into,
or a reduce-scatter of, B bytes (N-1)/N B), with tf.distribute's reduce-scatter an all-reduce
of which each replica keeps its part. Kept: the weights, gradients and optimizer state one
replica holds between steps, counted from its variables.

    python benchmarks/shard_levels.py --out=benchmarks/results/shard_levels.md
    python benchmarks/shard_levels.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

from reporting import report_header, write_report

LEVELS = ("none", "optimizer", "gradients", "weights")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4, help="logical CPU devices")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed loop")
    parser.add_argument("--rounds", type=int, default=5, help="timed loops per level")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round")
    parser.add_argument("--out", help="also write the report to this file")
    return parser.parse_args(argv)


def trainer_args(quick: bool) -> dict:
    """A small ViT (width 192, 6 blocks, 64 patches) with dropout and AdamW; --quick: tiny."""
    import functools

    from framework.data.images import synthetic
    from framework.models import VisionTransformer

    size, dim, depth, heads, mlp = (8, 16, 2, 2, 32) if quick else (32, 192, 6, 3, 768)
    patch = 4
    model = functools.partial(
        VisionTransformer,
        image_size=size,
        patch_size=patch,
        num_classes=8,
        dim=dim,
        depth=depth,
        num_heads=heads,
        mlp_dim=mlp,
        dropout=0.1,
    )
    data = functools.partial(synthetic.shapes, image_size=size, num_classes=8)
    return dict(
        model_fn=model,
        dataset_fn=data,
        global_batch_size=16 if quick else 64,
        train_steps=10**6,
        count_flops=False,
    )


def moved_bytes(trainer) -> dict[str, float]:
    """Bytes one replica sends and receives per step, by collective (see the module)."""
    import tensorflow as tf

    from framework.planner.measurement import state_bytes

    replicas = trainer.strategy.num_replicas_in_sync
    ring = (replicas - 1) / replicas
    if trainer.sharded is None:
        whole = state_bytes(trainer.model.trainable_variables)
        return {"all-reduce": 2 * ring * whole, "all-gather": 0.0}
    sharded = trainer.sharded
    padded = sum(
        layout.padded_size * tf.as_dtype(v.dtype).size
        for layout, v in zip(sharded.layouts, sharded.shards)
    )
    return {"all-reduce": 2 * ring * padded, "all-gather": ring * padded}


def kept_bytes(trainer) -> dict[str, float]:
    """What one replica keeps between steps: weights, gradients (none: they exist only in the
    step) and the optimizer's state."""
    from framework.planner.measurement import state_bytes

    weights = trainer.model.trainable_variables
    if trainer.sharded is None:
        return {
            "weights": state_bytes(weights),
            "optimizer": state_bytes(trainer.optimizer.variables),
        }
    shards = state_bytes(trainer.sharded.shards)
    replicated = 0 if trainer.sharded.level == "weights" else state_bytes(weights)
    return {"weights": replicated + shards, "optimizer": state_bytes(trainer.optimizer.variables)}


def measure(args: argparse.Namespace) -> tuple[list[dict], str]:
    from framework.runtime import Runtime, distribute
    from framework.trainer import Trainer

    distribute.split_cpu(args.replicas)  # before TensorFlow initialises its devices
    settings = trainer_args(args.quick)
    trainers, iterators = {}, {}
    for level in LEVELS:
        runtime = Runtime("mirrored", cpu_devices=args.replicas)
        trainers[level] = Trainer(None, runtime=runtime, shard_state=level, **settings)
        iterators[level] = trainers[level].train_iterator()
    # Warmed up once all are built: building a trainer seeds TensorFlow, which clears its kernel
    # caches, and the trainers built before would compile their loops again in the first round.
    for level in LEVELS:
        trainers[level].run_steps(iterators[level], args.steps)  # trace, compile, warm up
    seconds: dict[str, list[float]] = {level: [] for level in LEVELS}
    for _ in range(1 if args.quick else args.rounds):
        for level in LEVELS:
            start = time.perf_counter()
            trainers[level].run_steps(iterators[level], args.steps)
            seconds[level].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(seconds["none"])
    rows = []
    for level in LEVELS:
        step = statistics.median(seconds[level])
        rows.append(
            {
                "level": level,
                "step": step,
                "ratio": step / base,
                **moved_bytes(trainers[level]),
                **{f"kept {k}": v for k, v in kept_bytes(trainers[level]).items()},
            }
        )
    parameters = trainers["none"].model.count_params()
    return rows, f"ViT, {parameters:,} parameters, batch {settings['global_batch_size']}"


def format_report(rows: list[dict], model: str, args: argparse.Namespace, started) -> str:
    lines = [
        *report_header(__file__, started),
        f"Load average at the end: {os.getloadavg()[0]:.1f}",
        f"Model: {model} (dropout 0.1, AdamW, float32) on {args.replicas} logical CPU devices; "
        f"each level's step is the median of {1 if args.quick else args.rounds} loops of "
        f"{args.steps} steps, the levels timed in turns.",
        "",
        "| shard_state | step s | vs none | all-reduce | all-gather | kept: weights | "
        "kept: optimizer |",
        "|---|---|---|---|---|---|---|",
    ]
    from framework.memory import format_bytes

    for r in rows:
        sizes = [r[k] for k in ("all-reduce", "all-gather", "kept weights", "kept optimizer")]
        lines.append(
            f"| `{r['level']}` | {r['step']:.4f} | {r['ratio']:.2f} | "
            + " | ".join(format_bytes(int(b)) for b in sizes)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    started = datetime.datetime.now()
    rows, model = measure(args)
    write_report(format_report(rows, model, args, started), args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
