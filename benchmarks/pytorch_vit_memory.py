"""The headline case's other side: timm's ViT-B/16 in PyTorch, one AdamW training step at batch 64,
with and without activation checkpointing, each in a fresh process.

The project started from a report that ViT-B/16 at batch 64 ran out of memory in TensorFlow where
PyTorch's checkpointing fit (11 GB without, 4 GB with, on a 16 GB P100). This measures PyTorch's
side on this machine, to put beside the framework's plan of the same step (the README's table):
timm's `vit_base_patch16_224` with dropout 0.1 after attention and MLP projections
(as `models.vit_b16.dropout = 0.1`), 1000 classes, float32, cross-entropy, AdamW; checkpointing is
timm's `set_grad_checkpointing()` (each block under `torch.utils.checkpoint`, which replays the
RNG, so dropout stays exact).

Two figures per setting, both on the CPU (PyTorch keeps no allocator statistics there):
- peak RSS: the process's high-water resident memory during the step, minus its resident memory
  before the model was built: weights, gradients, AdamW's two slots, activations, and the
  allocator's slack - the whole step, as the framework's "XLA step" column counts it;
- saved for backward: the bytes autograd keeps for the backward pass
  (`torch.autograd.graph.saved_tensors_hooks`, each storage counted once; parameters excluded),
  the activations alone.

Needs PyTorch and timm (not dependencies of the framework; nothing is downloaded):

    python benchmarks/pytorch_vit_memory.py --out=benchmarks/results/pytorch_vit_memory.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

SETTINGS = ("no checkpointing", "checkpointing")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(setting: str, batch: int, dropout: float) -> dict:
    """One step of one setting, in this (fresh) process."""
    import timm
    import torch

    torch.manual_seed(0)
    before = _rss_bytes()
    model = timm.create_model(
        "vit_base_patch16_224", pretrained=False, proj_drop_rate=dropout, attn_drop_rate=0.0
    ).train()
    if setting == "checkpointing":
        model.set_grad_checkpointing(True)
    parameters = {p.data_ptr() for p in model.parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.randn(batch, 3, 224, 224)
    labels = torch.randint(0, 1000, (batch,))
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "setting": setting,
        "peak_rss_bytes": peak - before,
        "saved_bytes": sum(saved.values()),
        "step_seconds": seconds,
        "loss": float(loss),
        "torch": torch.__version__,
        "timm": timm.__version__,
    }


def measure(setting: str, batch: int, dropout: float) -> dict:
    command = [sys.executable, __file__, f"--child={setting}", f"--batch={batch}"]
    proc = subprocess.run(
        [*command, f"--dropout={dropout}"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{setting} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results: list[dict], args: argparse.Namespace, minutes: float) -> str:
    gib = 2**30
    base = results[0]
    lines = [
        "Command: `python benchmarks/pytorch_vit_memory.py --out=" + (args.out or "") + "`",
        f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}, took {minutes:.1f} min, load average "
        f"(1 min) at the start {os.getloadavg()[0]:.1f}",
        f"Machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, PyTorch "
        f"{base['torch']}, timm {base['timm']}",
        f"Model: timm vit_base_patch16_224, batch {args.batch}, 224 px, 1000 classes, dropout "
        f"{args.dropout}, float32, AdamW; each setting in a fresh process.",
        "",
        "| setting | peak RSS of the step (GiB) | saved for backward (GiB) | memory ratio "
        "(peak RSS) | step s |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['setting']} | {r['peak_rss_bytes'] / gib:.2f} | {r['saved_bytes'] / gib:.2f} "
            f"| {r['peak_rss_bytes'] / base['peak_rss_bytes']:.2f} | {r['step_seconds']:.1f} |"
        )
    lines.append("")
    lines.append(
        "Step times are of one step on a shared CPU, not a benchmark: the memory is the point."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--out", help="write the report (markdown) here too")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.batch, args.dropout)))
        return
    start = time.perf_counter()
    results = [measure(setting, args.batch, args.dropout) for setting in SETTINGS]
    text = report(results, args, (time.perf_counter() - start) / 60)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()
