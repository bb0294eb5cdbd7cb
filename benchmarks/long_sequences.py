"""What a decoder's training step holds as the sequence grows, with plain or blockwise attention,
planned by XLA:CPU and by libtpu's compiler for one TPU chip (compile-only: nothing runs).

For each sequence length and each setting, a fresh process builds the decoder (blocks scanned,
full remat: each block keeps only its input) and writes its forward and backward pass at batch 1
(the trainer's replica step: weights in, gradients out); XLA:CPU plans it there, and another
process compiles it with libtpu for the chip. Settings:

- plain: attention over whole [batch, heads, S, S] scores, the loss over whole logits;
- blockwise: `attention="blockwise"` (chunks of 512 queries and keys) and `loss_chunk=512`.

Per program: temporaries (activations, the backward pass's working set, the gradients' scratch)
and the peak (parameters, outputs and temporaries; on a TPU its compiled code too). A program
whose temporaries exceed the chip's memory is refused by libtpu; its row gives the compiler's
figures. A second table plans the loss alone (hidden states to per-token losses and their
gradient) for a 256 k vocabulary, whole logits against chunks.

    python benchmarks/long_sequences.py --out=benchmarks/results/long_sequences.md
    python benchmarks/long_sequences.py --sequences=16384,32768 --settings=blockwise
    python benchmarks/long_sequences.py --time --out=benchmarks/results/long_sequences_time.md
    python benchmarks/long_sequences.py --quick

`--time` runs a smaller decoder's step on this CPU instead (XLA:CPU, full remat), plain, with
blockwise attention, and with the chunked loss too, in turns in one process: step time and the
FLOPs XLA:CPU's cost analysis reports, each as a ratio to plain.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile

from reporting import child_json, report_header, write_report
from step_models import median_step_times

DECODER_1B = dict(dim=2048, depth=18, num_heads=16, mlp_dim=8192, vocab_size=32_000)
TINY = dict(dim=64, depth=2, num_heads=4, mlp_dim=128, vocab_size=512)
SETTINGS = {
    "plain": {},
    "blockwise": {"attention": "blockwise", "attention_chunk": 512, "loss_chunk": 512},
}
LOSS_VOCAB = 256_000
# libtpu's refusal of a program too large for the chip.
TOO_LARGE = re.compile(r"HLO temporaries \(([\d.]+)G\) exceed")
# --time: a decoder this CPU runs in seconds per step; its settings, timed in turns.
TIMED = dict(dim=256, depth=4, num_heads=4, mlp_dim=1024, vocab_size=32_000)
TIMED_SETTINGS = {
    "plain": {},
    "blockwise attention": {"attention": "blockwise", "attention_chunk": 512},
    "blockwise + chunked loss": SETTINGS["blockwise"],
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", default="1024,2048,4096,8192", help="tokens per sequence")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="plain and/or blockwise")
    parser.add_argument("--target", default="v5e", help="the TPU chip (default v5e); none: skip")
    parser.add_argument("--batch", type=int, default=1, help="sequences per device")
    parser.add_argument("--policy", default="nothing_saveable", help="the blocks' remat policy")
    parser.add_argument("--dropout", type=float, default=0.1, help="the decoder's dropout rate")
    parser.add_argument(
        "--time", action="store_true", help="time a smaller decoder's step on this CPU instead"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per setting")
    parser.add_argument("--quick", action="store_true", help="a tiny decoder: a smoke test")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--hlo", help=argparse.SUPPRESS)
    parser.add_argument("--compile", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.settings.split(",")) - set(SETTINGS)
    if unknown:
        parser.error(f"unknown setting {', '.join(sorted(unknown))}: choose from plain, blockwise")
    if not all(s.isdigit() and int(s) > 0 for s in args.sequences.split(",")):
        parser.error(f"--sequences takes token counts such as 1024,2048; got {args.sequences!r}")
    return args


def _plan(plan) -> dict:
    return {
        "temp": plan.temp_bytes,
        "peak": plan.peak_bytes,
        "flops": plan.flops,
        "compiler": plan.compiler,
    }


def step_program(args: argparse.Namespace, what: str, sequence: int) -> dict:
    """In a process of its own: XLA:CPU's plan of one program, its HLO written to `args.hlo`."""
    import keras
    import tensorflow as tf

    from framework import memory, remat
    from framework.models import chunked_loss
    from framework.models.language import DecoderLM
    from framework.trainer import losses, train_step

    config = TINY if args.quick else DECODER_1B
    if what == "loss":  # the loss alone, whole or in chunks, for a large vocabulary
        chunks = {"whole": None, "chunked": 512}[args.loss_setting]

        @tf.function(jit_compile=True)
        def step(hidden, table, labels):
            with tf.GradientTape() as tape:
                tape.watch([hidden, table])
                if chunks:
                    token_losses, _ = chunked_loss.chunked_losses(
                        hidden, table, labels, chunk_size=chunks
                    )
                else:
                    logits = tf.matmul(hidden, table, transpose_b=True)
                    token_losses = losses.cross_entropy(logits, labels)
                loss = tf.reduce_sum(token_losses)
            return tape.gradient(loss, [hidden, table])

        vocab = 4096 if args.quick else LOSS_VOCAB
        specs = (
            tf.TensorSpec([args.batch, sequence, config["dim"]]),
            tf.TensorSpec([vocab, config["dim"]]),
            tf.TensorSpec([args.batch, sequence], tf.int32),
        )
        ir = step.experimental_get_compiler_ir(*specs)
    else:
        keras.utils.set_random_seed(0)
        model = DecoderLM(
            max_length=sequence,
            dropout=args.dropout,
            scan_layers=True,
            **config,
            **SETTINGS[what],
        )
        remat.set_grad_checkpointing(model, policy=args.policy)
        tokens = tf.zeros([args.batch, sequence], tf.int32)
        batch = ({"tokens": tokens, "segment_ids": tokens + 1, "positions": tokens}, tokens)
        ir = train_step.compiled_gradients(model).experimental_get_compiler_ir(batch)
    with open(args.hlo, "wb") as f:
        f.write(ir(stage="hlo_serialized"))
    proto = memory.xla_buffers.hlo_pb2.HloProto.FromString(
        ir(stage="optimized_hlo_proto_serialized")
    )
    return _plan(memory.xla_buffers.memory_from_hlo_proto(proto, compiler="XLA:CPU"))


def chip_program(args: argparse.Namespace) -> dict:
    """In a process of its own: libtpu's plan of the HLO in `args.compile`, or its refusal."""
    from framework.memory import tpu

    with open(args.compile, "rb") as f:
        hlo = f.read()
    try:
        return _plan(tpu.compile_for_chip(hlo, tpu.tpu_chip(args.target)))
    except Exception as error:  # noqa: BLE001 (the compiler's refusal is a result)
        return {"error": str(error).splitlines()[0][:160]}


def measure(args: argparse.Namespace, argv: list[str], what: str, sequence: int, hlo_dir: str):
    """One program's plans: XLA:CPU's, then (unless --target=none) the TPU chip's."""
    hlo = os.path.join(hlo_dir, f"{what}-{sequence}.pb")
    row = {"what": what, "sequence": sequence}
    row["cpu"] = child_json(__file__, [*argv, f"--child={what}:{sequence}", f"--hlo={hlo}"], {})
    if "error" not in row["cpu"] and args.target != "none":
        row["tpu"] = child_json(__file__, [*argv, f"--compile={hlo}"], {})
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def format_report(args: argparse.Namespace, rows: list[dict], started) -> str:
    unit, scale = ("MiB", 2**20) if args.quick else ("GiB", 2**30)
    config = TINY if args.quick else DECODER_1B

    def size(plan: dict | None, key: str) -> str:
        if not plan:
            return "-"
        if "error" in plan:
            refused = TOO_LARGE.search(plan["error"])
            return f"refused: temporaries {refused[1]}G" if refused else "-"
        return f"{plan[key] / scale:.2f}"

    def growth(what: str, target: str) -> str:
        temps = {
            r["sequence"]: r.get(target, {}).get("temp")
            for r in rows
            if r["what"] == what and r.get(target) and "temp" in r.get(target, {})
        }
        base = temps.get(min(temps)) if temps else None
        return ", ".join(f"{s}: {t / base:.1f}x" for s, t in sorted(temps.items())) if base else "-"

    tpu_name = f"TPU {args.target} (libtpu, compile-only)"
    lines = [
        *report_header(__file__, started),
        f"Planned by: XLA:CPU and {tpu_name}. Decoder of width {config['dim']}, "
        f"{config['depth']} blocks (scanned), {config['num_heads']} heads, vocabulary "
        f"{config['vocab_size']}, batch {args.batch}, dropout {args.dropout}, remat "
        f"`{args.policy}`: the forward and backward pass (weights in, gradients out). {unit} "
        "per device. TPU FLOPs reported: libtpu's cost analysis, which counts a loop's body once "
        "(the scanned blocks, the attention's chunk loops): not the step's FLOPs.",
        "",
        "| sequence | setting | XLA:CPU temporaries | XLA:CPU peak | TPU temporaries | TPU peak "
        "| TPU FLOPs reported |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["what"] not in SETTINGS:
            continue
        reported = (row.get("tpu") or {}).get("flops")
        lines.append(
            f"| {row['sequence']} | {row['what']} | {size(row['cpu'], 'temp')} | "
            f"{size(row['cpu'], 'peak')} | {size(row.get('tpu'), 'temp')} | "
            f"{size(row.get('tpu'), 'peak')} | {f'{reported:.3g}' if reported else '-'} |"
        )
    lines += ["", "Temporaries against the shortest sequence's:", ""]
    for what in SETTINGS:
        for target, name in (("cpu", "XLA:CPU"), ("tpu", tpu_name)):
            lines.append(f"- {what}, {name}: {growth(what, target)}")
    loss_rows = [r for r in rows if r["what"] in ("whole", "chunked")]
    if loss_rows:
        vocab = 4096 if args.quick else LOSS_VOCAB
        lines += [
            "",
            f"The loss alone: hidden states [batch {args.batch}, sequence, {config['dim']}] to "
            f"per-token cross-entropy over {vocab} tokens and its gradient (the logits of one "
            f"whole sequence are sequence x {vocab} float32 values; chunks of 512 tokens).",
            "",
            "| sequence | loss | XLA:CPU temporaries | TPU temporaries |",
            "|---|---|---|---|",
        ]
        for row in loss_rows:
            lines.append(
                f"| {row['sequence']} | {row['what']} | {size(row['cpu'], 'temp')} | "
                f"{size(row.get('tpu'), 'temp')} |"
            )
    return "\n".join(lines) + "\n"


def time_steps(args: argparse.Namespace, started) -> str:
    """Step times and XLA:CPU's FLOPs of each `TIMED_SETTINGS`, as ratios to plain, per
    sequence length (a fresh model per setting, the same weights)."""
    import keras
    import tensorflow as tf

    from framework import remat
    from framework.models.language import DecoderLM
    from framework.runtime import flops
    from framework.trainer import train_step

    config = {**TINY, "vocab_size": 512} if args.quick else TIMED
    lines = [
        f"Run on this CPU by XLA:CPU: a decoder of width {config['dim']}, {config['depth']} "
        f"blocks, {config['num_heads']} heads, vocabulary {config['vocab_size']}, batch "
        f"{args.batch}, dropout {args.dropout}, remat `{args.policy}`; forward and backward pass, "
        f"median of {args.repeats} steps taken in turns. FLOPs: the matrix products counted in "
        "the program (`framework.runtime.flops`), each loop's body times its trip count; a loop "
        "whose count is known only when it runs (causal attention's inner loops) is counted "
        "once: not exact.",
        "",
        "| sequence | setting | step time / plain's | plain's step (s) | FLOPs counted / plain's |",
        "|---|---|---|---|---|",
    ]
    for sequence in map(int, args.sequences.split(",")):
        steps, reported = [], []
        tokens = tf.random.stateless_uniform(
            [args.batch, sequence], [1, 2], 0, config["vocab_size"], tf.int32
        )
        batch = (
            {
                "tokens": tokens,
                "segment_ids": tf.ones_like(tokens),
                "positions": tf.zeros_like(tokens),
            },
            tokens,
        )
        for setting in TIMED_SETTINGS.values():
            keras.utils.set_random_seed(0)
            model = DecoderLM(max_length=sequence, dropout=args.dropout, **config, **setting)
            remat.set_grad_checkpointing(model, policy=args.policy)
            step = train_step.compiled_gradients(model)
            steps.append(lambda x, y, step=step: step((x, y))[0][0])
            reported.append(flops.forward_flops(step, batch))
        times = median_step_times(steps, *batch, args.repeats)
        for name, spent, (counted, exact) in zip(TIMED_SETTINGS, times, reported, strict=True):
            ratio = f"{counted / reported[0][0]:.2f}" + ("" if exact else " (not exact)")
            lines.append(
                f"| {sequence} | {name} | {spent / times[0]:.2f} | {times[0]:.2f} | {ratio} |"
            )
    return "\n".join([*report_header(__file__, started), *lines]) + "\n"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.quick:
        args.sequences = "256,512"
    if args.time:
        write_report(time_steps(args, datetime.datetime.now()), args.out)
        return
    if args.child:
        what, sequence = args.child.split(":")
        if what in ("whole", "chunked"):
            args.loss_setting = what
            what = "loss"
        print(json.dumps(step_program(args, what, int(sequence))))
        return
    if args.compile:
        print(json.dumps(chip_program(args)))
        return
    started = datetime.datetime.now()
    sequences = [int(s) for s in args.sequences.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as hlo_dir:
        for sequence in sequences:
            for what in args.settings.split(","):
                rows.append(measure(args, argv, what, sequence, hlo_dir))
        for what in ("whole", "chunked"):
            rows.append(measure(args, argv, what, sequences[-1], hlo_dir))
    write_report(format_report(args, rows, started), args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
