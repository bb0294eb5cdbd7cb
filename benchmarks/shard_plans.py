"""What one TPU chip of a slice holds at each level of sharded training state, planned by the TPU
compiler for that slice: decoder language models at a long sequence, and the largest that fits.

For each decoder size a fresh process builds the model once on this host (nothing runs) and, for
each level of `Trainer.shard_state` and each batch per chip, writes out the forward and backward
pass as the trainer's replica step runs it on a TPU; another process compiles each with libtpu
for every chip of the slice (a large decoder's compilation needs the host's memory to itself):
at "gradients" and "weights" one program of all the slice's chips, each weight gathered where a
layer reads it and its gradient reduce-scattered inside it; at "none" and "optimizer" the same
pass on whole weights, its gradients whole (those two levels share the program). Per chip:

- program: the compiler's plan (parameters, outputs, temporaries and the compiled code, all in
  HBM; a program of unrolled blocks holds each block's code);
- kept: what lives beside the program between steps: the optimizer's state (whole, or its
  shards) and the weights' shards when the program does not take them;
- total = program + kept, against the HBM libtpu lets a v5e program use (15.75 GiB).

A program whose temporaries alone exceed the chip is refused by the compiler (`RESOURCE_EXHAUSTED
... exceeds available HBM`): its row gives the compiler's figures. The unsharded optimizer's state
is counted from its slots' shapes, never built whole: for a 2.6 B model it would be 21 GB of this
host's memory for a figure the shapes give.

    python benchmarks/shard_plans.py --out=benchmarks/results/shard_plans.md
    python benchmarks/shard_plans.py --sizes=2b --levels=weights --batches=4
    python benchmarks/shard_plans.py --sizes=2.6b --depths=8,16 --levels=weights --batches=4
    python benchmarks/shard_plans.py --sequence=16384 --attention=blockwise --loss_chunk=512 \
        --levels=weights --batches=1 --policies=nothing_saveable
    python benchmarks/shard_plans.py --quick

libtpu's compilation of the 2.6 B decoder's whole program needs more than 24 GB of host memory:
`--depths` plans it at fewer blocks (beyond the first few, each block adds about the same).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import re
import sys
import tempfile

from reporting import child_json, report_header, write_report

# Decoder sizes (width, blocks, heads, MLP width), each with a 32 k vocabulary by default.
SIZES = {
    "tiny": dict(dim=64, depth=2, num_heads=4, mlp_dim=256),
    "0.35b": dict(dim=1024, depth=24, num_heads=16, mlp_dim=4096),
    "0.7b": dict(dim=1536, depth=24, num_heads=16, mlp_dim=6144),
    "1b": dict(dim=2048, depth=18, num_heads=16, mlp_dim=8192),  # configs/models/decoder_1b.gin
    "1.3b": dict(dim=2048, depth=24, num_heads=16, mlp_dim=8192),
    "2b": dict(dim=2560, depth=24, num_heads=20, mlp_dim=10240),
    "2.6b": dict(dim=2560, depth=32, num_heads=20, mlp_dim=10240),
    "3.4b": dict(dim=2560, depth=42, num_heads=20, mlp_dim=10240),
}
LEVELS = ("none", "optimizer", "gradients", "weights")
# The program each level compiles on a TPU (see the module).
PROGRAMS = {"none": "whole", "optimizer": "whole", "gradients": "gradients", "weights": "weights"}
# libtpu's refusal of a program too large for the chip.
TOO_LARGE = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")
V5E_USABLE_GIB = 15.75  # libtpu's "available HBM" on a v5e chip


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="v5e-8", help="a TPU slice (default v5e-8)")
    parser.add_argument("--sizes", default="1b", help=f"decoder sizes, from {', '.join(SIZES)}")
    parser.add_argument("--levels", default=",".join(LEVELS), help="Trainer.shard_state levels")
    parser.add_argument("--batches", default="4,8", help="sequences per chip")
    parser.add_argument("--sequence", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=32_000, help="vocabulary size")
    parser.add_argument(
        "--attention",
        default="plain",
        choices=("plain", "blockwise"),
        help="the decoder's attention",
    )
    parser.add_argument("--dropout", type=float, default=0.1, help="the decoder's dropout rate")
    parser.add_argument(
        "--loss_chunk", type=int, help="tokens per chunk of the loss (default: whole)"
    )
    parser.add_argument(
        "--policies", default="nothing_saveable,dots_saveable", help="the blocks' remat policies"
    )
    parser.add_argument(
        "--depths",
        help="plan each size with these numbers of blocks instead of its own (a decoder whose "
        "compilation needs more host memory than this host has; beyond the first few blocks each "
        "adds about the same)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny decoder: a smoke test")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--hlo_dir", help=argparse.SUPPRESS)
    parser.add_argument("--compile", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [name for name in args.sizes.split(",") if name not in SIZES]
    if unknown:
        parser.error(f"unknown size {', '.join(unknown)}: choose from {', '.join(SIZES)}")
    if args.depths and not all(d.isdigit() and int(d) > 0 for d in args.depths.split(",")):
        parser.error(f"--depths takes block counts such as 8,16; got {args.depths!r}")
    return args


def sizes(args: argparse.Namespace) -> list[str]:
    """The decoders to plan: a size, or "size@blocks" with `--depths`."""
    names = args.sizes.split(",")
    if not args.depths:
        return names
    return [f"{name}@{depth}" for name in names for depth in args.depths.split(",")]


def decoder(size: str) -> dict:
    """The DecoderLM settings of a size (see `sizes`)."""
    name, _, depth = size.partition("@")
    return {**SIZES[name], **({"depth": int(depth)} if depth else {})}


def write_programs(args: argparse.Namespace, size: str, program: str) -> dict:
    """Every (level, policy, batch) of one decoder size whose step compiles `program` (see
    `PROGRAMS`), each program's HLO written into `args.hlo_dir`; run in a process of its own,
    which frees all it held when it ends."""
    import keras
    import tensorflow as tf

    from framework import remat, shard
    from framework.core import tf_internals
    from framework.memory import tpu
    from framework.models.language import DecoderLM
    from framework.planner.measurement import kept_bytes
    from framework.trainer import optim, train_step

    chips = tpu.tpu_devices(args.target)
    keras.utils.set_random_seed(0)
    # The "weights" program reads the weights' shards alone: the model needs no storage for its
    # own, so a decoder larger than this host's memory is planned (its shards are 1/chips).
    scope = contextlib.nullcontext()
    if program == "weights":
        scope = tf_internals.trainable_weights_without_storage()
    with scope:
        model = DecoderLM(
            vocab_size=args.vocab,
            max_length=args.sequence,
            dropout=args.dropout,
            attention=args.attention,
            loss_chunk=args.loss_chunk,
            **decoder(size),
        )
    programs: dict[tuple[str, str, int], str] = {}
    rows = []
    for level in [level for level in args.levels.split(",") if PROGRAMS[level] == program]:
        # Every level's state is cut for the slice, "none" too: its optimizer's whole size is
        # counted from the shards' layouts.
        optimizer, _ = optim.scheduled_optimizer(optim.adamw, 1e-4, 0, 1000, 0.05)
        state = shard.ShardedState(
            "optimizer" if level == "none" else level,
            tf.distribute.get_strategy(),
            model,
            optimizer,
            replicas=chips,
        )
        if level == "none":
            kept = state.unsharded_optimizer_bytes()
        else:
            kept = kept_bytes(None, state, in_program=True)
        in_program = PROGRAMS[level] != "whole"
        for policy, batch in itertools.product(
            args.policies.split(","), map(int, args.batches.split(","))
        ):
            key = (policy, PROGRAMS[level], batch)
            if key not in programs:
                remat.set_grad_checkpointing(model, policy=policy)
                tokens = tf.zeros([batch, args.sequence], tf.int32)
                features = {"tokens": tokens, "segment_ids": tokens + 1, "positions": tokens}
                step = train_step.compiled_gradients(
                    model, sharded=state if in_program else None, in_program=in_program
                )
                hlo = step.experimental_get_compiler_ir((features, tokens))(stage="hlo_serialized")
                programs[key] = os.path.join(args.hlo_dir, f"{size}-{'-'.join(map(str, key))}.pb")
                with open(programs[key], "wb") as f:
                    f.write(hlo)
            rows.append(
                {
                    "level": level,
                    "policy": policy,
                    "batch": batch,
                    "kept": kept,
                    "hlo": programs[key],
                    "replicas": chips if in_program else 1,
                }
            )
        del state, optimizer
    return {"parameters": model.count_params(), "rows": rows}


def plan_rows(
    argv: list[str], size: str, program: str, levels: list[str], hlo_dir: str
) -> tuple[int | None, list[dict]]:
    """The parameters and rows of one decoder size's levels that compile `program`: one process
    writes their programs, then each program is compiled in a process of its own."""
    child = [*argv, f"--child={size}:{program}", f"--hlo_dir={hlo_dir}"]
    result = child_json(__file__, child, {})
    if "error" in result:  # the process died: its levels' rows say how
        died = [level for level in levels if PROGRAMS[level] == program]
        return None, [{"level": level, "error": result["error"]} for level in died]
    plans: dict[str, dict] = {}
    for row in result["rows"]:
        hlo, replicas = row.pop("hlo"), row.pop("replicas")
        if hlo not in plans:
            compile_args = [*argv, f"--compile={hlo}", f"--replicas={replicas}"]
            plans[hlo] = child_json(__file__, compile_args, {})
        row.update(plans[hlo])
        print(json.dumps({"size": size, **row}), file=sys.stderr, flush=True)
    return result["parameters"], result["rows"]


def plan_program(args: argparse.Namespace) -> dict:
    """libtpu's plan of one chip's program (the HLO file `args.compile`), or its refusal."""
    from framework.memory import tpu

    with open(args.compile, "rb") as f:
        hlo = f.read()
    try:
        plan = tpu.compile_for_chip(hlo, tpu.tpu_chip(args.target), replicas=args.replicas)
    except Exception as error:  # noqa: BLE001 (the compiler's refusal is a result)
        found = TOO_LARGE.search(str(error))
        if not found:
            return {"error": str(error).splitlines()[0][:200]}
        return {"temp_gib": float(found[1]), "hbm_gib": float(found[2])}
    return {
        "program": plan.peak_bytes,
        "temp": plan.temp_bytes,
        "parameter": plan.parameter_bytes,
        "code": plan.generated_code_bytes,
    }


def format_report(args: argparse.Namespace, results: dict[str, dict], started) -> str:
    from framework.memory import tpu

    unit = "MiB" if args.quick else "GiB"  # a tiny decoder's plans are a few MiB

    def gib(num_bytes: float) -> str:
        return f"{num_bytes / (2**20 if args.quick else 2**30):.2f}"

    usable = V5E_USABLE_GIB * 2**30 if args.target.startswith("v5e") else None
    usable = usable or tpu.tpu_chip(args.target).hbm_bytes
    lines = [
        *report_header(__file__, started),
        f"Planned by: libtpu's compiler (compile-only) for {args.target}, one chip's plan of "
        f"the program of all {tpu.tpu_devices(args.target)} chips. Decoder LMs at sequence "
        f"{args.sequence}, vocabulary {args.vocab}, {args.attention} attention, the loss "
        f"{f'in chunks of {args.loss_chunk} tokens' if args.loss_chunk else 'over whole logits'}"
        f", dropout {args.dropout}, AdamW in float32, the remat "
        f"policy on every block. {unit} per chip; fits: the total within the {gib(usable)} "
        f"{unit} a program may use.",
        "",
        "| decoder | shard_state | remat | batch per chip | program (temporaries; code) | kept "
        "| total | fits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, result in results.items():
        name, _, depth = size.partition("@")
        if depth:
            name += f" at {depth} of {SIZES[name]['depth']} blocks"
        if result["parameters"]:
            name += f" ({result['parameters'] / 1e9:.2f} B)"
        for row in result["rows"]:
            if "program" in row:
                total = row["program"] + row["kept"]
                program = f"{gib(row['program'])} ({gib(row['temp'])}; {gib(row['code'])})"
                total_text, fits = gib(total), "yes" if total <= usable else "no"
            elif "temp_gib" in row:
                program = f"refused: temporaries {row['temp_gib']:.2f}G > {row['hbm_gib']:.2f}G"
                total_text, fits = "-", "no"
            else:
                program, total_text, fits = row["error"], "-", "-"
            policy, batch = row.get("policy", "-"), row.get("batch", "-")
            kept = gib(row["kept"]) if "kept" in row else "-"
            lines.append(
                f"| {name} | `{row['level']}` | `{policy}` | {batch} | {program} | {kept} | "
                f"{total_text} | {fits} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.quick:
        args.sizes, args.batches, args.sequence, args.vocab = "tiny", "2", 64, 512
    if args.child:
        print(json.dumps(write_programs(args, *args.child.split(":"))))
        return
    if args.compile:
        print(json.dumps(plan_program(args)))
        return
    started = datetime.datetime.now()
    levels = args.levels.split(",")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as hlo_dir:
        for size in sizes(args):
            merged = results[size] = {"parameters": None, "rows": []}
            for program in dict.fromkeys(PROGRAMS[level] for level in levels):
                parameters, rows = plan_rows(argv, size, program, levels, hlo_dir)
                merged["rows"] += rows
                merged["parameters"] = merged["parameters"] or parameters
    write_report(format_report(args, results, started), args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
