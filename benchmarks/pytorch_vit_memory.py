"""The headline case's other side: timm's ViT-B/16 in PyTorch, one AdamW training step at batch 64,
with and without activation checkpointing, each in a fresh process.

The project started from a report that ViT-B/16 at batch 64 ran out of memory in TensorFlow where
PyTorch's checkpointing fit (11 GB without, 4 GB with, on a 16 GB P100). This measures PyTorch's
side on this machine, to put beside the framework's plan of the same step (the README's table):
timm's `vit_base_patch16_224` with dropout 0.1 after attention and MLP projections
(as `models.vit_b16.dropout = 0.1`), 1000 classes, float32, cross-entropy, AdamW; checkpointing is
timm's `set_grad_checkpointing()` (each block under `torch.utils.checkpoint`, which replays the
RNG, so dropout stays exact).

Figures per setting, all on the CPU (PyTorch keeps no allocator statistics there):
- peak RSS of the first step: the process's high-water resident memory during the step, minus
  its resident memory before the model was built. AdamW creates its two slots in its first
  `step()`, after the backward pass has freed the activations, so they are not yet resident at
  the backward pass's peak;
- peak RSS of a steady step (the second; gradients set to None before it, PyTorch's default):
  the high-water mark reset after the first step (`/proc/self/clear_refs`), minus the same
  baseline: weights, AdamW's slots, gradients, activations and the allocator's slack - the whole
  step, as a compiled step's plan (weights and optimizer state as parameters) counts it;
- saved for backward: the bytes autograd keeps for the first step's backward pass
  (`torch.autograd.graph.saved_tensors_hooks`, each storage counted once; parameters excluded),
  the activations alone.

Every allocation above 64 KiB is mapped and unmapped on its own (`MALLOC_MMAP_THRESHOLD_`), so
freed tensors leave the resident set at once and the high-water marks count live tensors.

Needs PyTorch and timm (not dependencies of the framework; nothing is downloaded):

    python benchmarks/pytorch_vit_memory.py --out=benchmarks/results/pytorch_vit_memory.md
    python benchmarks/pytorch_vit_memory.py --batch=8 --optimizer=sgd --steps=5  # and time

With `--steps`, that many more steady steps are timed after the two above (median), to set
beside the other systems' step times (`--optimizer=sgd`: the update the other benchmarks' timed
steps apply).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time

SETTINGS = ("no checkpointing", "checkpointing")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """The process's resident high-water mark (VmHWM) since it started or was last reset."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024  # kB


def _reset_peak_rss() -> None:
    """Sets the high-water mark to the current resident size (Linux: clear_refs, value 5)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _child(setting: str, batch: int, dropout: float, optimizer_name: str, steps: int) -> dict:
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
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.randn(batch, 3, 224, 224)
    labels = torch.randint(0, 1000, (batch,))
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def step(hooks=None):
        optimizer.zero_grad(set_to_none=True)
        with hooks or contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        return loss

    start = time.perf_counter()
    loss = step(torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor))
    seconds = time.perf_counter() - start
    first_peak = _peak_rss_bytes()
    _reset_peak_rss()
    step()
    steady_peak = _peak_rss_bytes()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return {
        "setting": setting,
        "peak_rss_bytes": first_peak - before,
        "steady_peak_rss_bytes": steady_peak - before,
        "median_step_seconds": sorted(times)[len(times) // 2] if times else None,
        "saved_bytes": sum(saved.values()),
        "step_seconds": seconds,
        "loss": float(loss),
        "torch": torch.__version__,
        "timm": timm.__version__,
    }


def measure(args: argparse.Namespace, setting: str) -> dict:
    command = [sys.executable, __file__, f"--child={setting}", f"--batch={args.batch}"]
    command += [f"--optimizer={args.optimizer}", f"--steps={args.steps}"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [*command, f"--dropout={args.dropout}"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{setting} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results: list[dict], args: argparse.Namespace, minutes: float) -> str:
    gib = 2**30
    base = results[0]
    lines = [
        "Command: `python benchmarks/pytorch_vit_memory.py " + " ".join(sys.argv[1:]) + "`",
        f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}, took {minutes:.1f} min, load average "
        f"(1 min) at the start {os.getloadavg()[0]:.1f}",
        f"Machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, PyTorch "
        f"{base['torch']}, timm {base['timm']}",
        f"Model: timm vit_base_patch16_224, batch {args.batch}, 224 px, 1000 classes, dropout "
        f"{args.dropout}, float32, {'SGD' if args.optimizer == 'sgd' else 'AdamW'}; each "
        "setting in a fresh process.",
        "",
        "| setting | peak RSS, first step (GiB) | peak RSS, steady step (GiB) | saved for "
        "backward (GiB) | memory ratio (steady peak) | memory ratio (saved) | first step s "
        "| step s (median) | time ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["steady_peak_rss_bytes"] / base["steady_peak_rss_bytes"]
        timed = r["median_step_seconds"] is not None
        lines.append(
            f"| {r['setting']} | {r['peak_rss_bytes'] / gib:.2f} "
            f"| {r['steady_peak_rss_bytes'] / gib:.2f} | {r['saved_bytes'] / gib:.2f} "
            f"| {ratio:.2f} | {r['saved_bytes'] / base['saved_bytes']:.2f} "
            f"| {r['step_seconds']:.1f} "
            + (
                f"| {r['median_step_seconds']:.2f} "
                f"| {r['median_step_seconds'] / base['median_step_seconds']:.2f} |"
                if timed
                else "| - | - |"
            )
        )
    lines.append("")
    lines.append(
        "The first step's time is one step; with `--steps`, the median is of that many steady "
        "steps, each setting in its own process one after the other."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--steps", type=int, default=0, help="also time this many steady steps")
    parser.add_argument("--out", help="write the report (markdown) here too")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.batch, args.dropout, args.optimizer, args.steps)))
        return
    start = time.perf_counter()
    results = [measure(args, setting) for setting in SETTINGS]
    text = report(results, args, (time.perf_counter() - start) / 60)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()
