"""The seed case planned for NVIDIA GPUs by XLA's GPU compiler, on this host, nothing run:
ViT-B/16 at batch 64 (224 px, AdamW, dropout 0.1, float32), `plan/vit_b16_batch64_16gib.gin`.

1. The planner for each card (`python -m framework.planner --target=CARD`): every default remat
   policy and the budget fraction that fits, the card's memory as the budget; its table and pick.
2. Micro-batches: no remat with `Trainer.microbatches` 2 and 4 (each micro-batch's activations
   only, the gradients summed in the step).
3. XLA:GPU's own rematerialization: the no-remat step compiled for the first card described with
   its own memory, without a limit, and with less: what the compiler reaches by itself, and the
   dot FLOPs it pays (its cuBLAS calls, counted).

    python benchmarks/gpu_plans.py --out=benchmarks/results/gpu_plans.md
    python benchmarks/gpu_plans.py --cards=p100 --quick

Each planner run starts its own compile worker; the part-3 child builds the model once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from reporting import REPO_DIR, child_json, report_header, write_report

CONFIG = "plan/vit_b16_batch64_16gib.gin"
# A tiny ViT for --quick (seconds per compilation).
QUICK = [
    "--gin.data.shapes.image_size=16",
    "--gin.models.vit_b16.image_size=16",
    "--gin.models.vit_b16.depth=2",
    "--gin.models.vit_b16.dim=64",
    "--gin.models.vit_b16.mlp_dim=128",
    "--gin.models.vit_b16.num_heads=2",
]
GIB = 2**30
EXPLANATION = (
    "Every figure is XLA's GPU compiler's plan (jax's CUDA plugin, compile-only, for the card's "
    "published description; `framework.memory.gpu`), nothing run. XLA step = the program "
    "(arguments, outputs, its temporaries' block) plus the optimizer's state; times are the "
    "program's dot FLOPs at the card's dense peak for float32 (TensorFloat-32 on A100 and "
    "H100), marked `~`."
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cards", default="p100,v100,a100-40gb,h100", help="GPU cards to plan")
    parser.add_argument(
        "--microbatches", default="2,4", help="Trainer.microbatches to plan without remat"
    )
    parser.add_argument(
        "--fractions",
        default="0.75,0.6,0.5,0.4",
        help="part 3: the first card's memory described as these fractions of its own",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny ViT (tests)")
    parser.add_argument("--out", help="write the report here too")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def gin_args(quick: bool) -> list[str]:
    return [f"--gin_file={CONFIG}", *(QUICK if quick else [])]


def plan(card: str, quick: bool, extra: list[str]) -> tuple[str, dict]:
    """The planner's printed table and verdict, and its plan.json, for one card."""
    with tempfile.TemporaryDirectory() as model_dir:
        command = [
            sys.executable,
            "-m",
            "framework.planner",
            *gin_args(quick),
            f"--target={card}",
            f"--model_dir={model_dir}",
            "--compile_processes=1",
            *extra,
        ]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        proc = subprocess.run(
            command, cwd=REPO_DIR, env=env, capture_output=True, text=True, check=False
        )
        path = os.path.join(model_dir, "plan.json")
        if not os.path.exists(path):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"error: the planner failed for {card}: {tail}")
        printed = [
            line for line in proc.stdout.strip().splitlines() if not line.startswith("wrote ")
        ]
        with open(path) as f:
            return "\n".join(printed), json.load(f)


def compiler_remat(card: str, fractions: list[float], quick: bool) -> dict:
    """Part 3, in a fresh process: the no-remat step's plan for `card` at several memory sizes."""
    args = ["--child", f"--cards={card}", f"--fractions={','.join(map(str, fractions))}"]
    return child_json(__file__, args + ["--quick"] * quick, {"card": card})


def child(args: argparse.Namespace) -> None:
    """Builds the configured trainer on this host's CPU (no remat) and prints, as JSON, the
    card's plan of its step at its own memory, without a limit and at each fraction."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    from framework import cli
    from framework.memory import gpu
    from framework.trainer import Trainer

    bindings = [flag.removeprefix("--gin.") for flag in QUICK] if args.quick else []
    cli.parse_gin([CONFIG], [*bindings, "Runtime.strategy = 'one_device'"], [str(cli.CONFIGS_DIR)])
    trainer = Trainer(None, remat_policy=None, count_flops=False)
    fn, step_args = trainer.compiled_step()
    hlo = fn.experimental_get_compiler_ir(*step_args)(stage="hlo_serialized")
    card = gpu.gpu_card(args.cards)
    sizes = [("unlimited", 2**50), ("its own", card.memory_bytes)]
    sizes += [
        (f"{f:g} of it", int(f * card.memory_bytes)) for f in map(float, args.fractions.split(","))
    ]
    rows = []
    for name, size in sizes:
        compiled = gpu.compile_for_card(hlo, card, memory_bytes=size)
        rows.append(
            {
                "memory": name,
                "memory_bytes": size,
                "peak_bytes": compiled.peak_bytes,
                "temp_bytes": compiled.temp_bytes,
                "flops": compiled.flops,
            }
        )
    print(json.dumps({"card": card.name, "compiler": compiled.compiler, "rows": rows}))


def remat_table(result: dict) -> list[str]:
    if "error" in result:
        return [f"failed: {result['error']}"]
    rows = result["rows"]
    base = rows[0]
    lines = [
        f"{result['compiler']}, the step without remat (forward and backward pass; the optimizer's "
        "state is not in this program):",
        "",
        "| card's memory described as | GiB | program's plan GiB | temporaries GiB | dot FLOPs vs "
        "unlimited |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        size = "-" if row["memory"] == "unlimited" else f"{row['memory_bytes'] / GIB:.2f}"
        lines.append(
            f"| {row['memory']} | {size} | {row['peak_bytes'] / GIB:.2f} | "
            f"{row['temp_bytes'] / GIB:.2f} | {row['flops'] / base['flops']:.3f} |"
        )
    return lines


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    started = datetime.datetime.now()
    cards = args.cards.split(",")
    sections = []
    for card in cards:
        printed, _ = plan(card, args.quick, [])
        sections += [f"### {card}", "", "```", printed, "```", ""]
    for count in filter(None, args.microbatches.split(",")):
        for card in cards[:1]:
            extra = [
                "--policies=none",
                "--search_budget=false",
                f"--gin.Trainer.microbatches={count}",
            ]
            printed, _ = plan(card, args.quick, extra)
            sections += [
                f"### {card}, no remat, {count} micro-batches",
                "",
                "```",
                printed,
                "```",
                "",
            ]
    fractions = [float(f) for f in args.fractions.split(",")]
    remat = compiler_remat(cards[0], fractions, args.quick)
    report = [
        "# GPU plans of the seed case (ViT-B/16, batch 64, AdamW, dropout 0.1)",
        "",
        *report_header(__file__, started),
        "",
        EXPLANATION,
        "",
        "## The planner, each card",
        "",
        *sections,
        "## XLA:GPU's own rematerialization",
        "",
        *remat_table(remat),
        "",
    ]
    write_report("\n".join(report), args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
