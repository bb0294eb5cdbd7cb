"""How a train step's peak memory grows with depth and with batch size, per remat policy.

The framework's real train step (the quickstart ViT under the gin-configured Trainer, AdamW,
XLA-compiled forward and backward) is measured by the fit planner's per-combination process
(`framework.planner.measure_combination`: fresh process, CPU BFC allocator, one warm-up step, one
measured step, median time), for no remat, full remat (`nothing_saveable`) and `dots_saveable`:

- depth sweep: 6, 12 and 24 blocks at one batch size;
- batch sweep: three batch sizes at the smallest depth.

Full remat keeps, per block, only the block's input for the backward pass, so its activation
memory should grow by one block input (batch x tokens x width x 4 bytes) per extra block. The
report fits the growth per block and compares it with that ideal. What a step adds
(`peak - live before`) also grows by each block's gradients (its parameters, 4 bytes each), which
are live at the end of the backward pass whatever the policy; the report estimates them from how
much the weights and AdamW's two slots grow per block (live before / 3) and shows the growth both
with and without them.

    python benchmarks/memory_scaling.py --out=benchmarks/results/memory_scaling.md \
        --plot=benchmarks/results/memory_scaling.png
    python benchmarks/memory_scaling.py --quick            # smoke test: tiny sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time

from framework import cli
from framework.planner import Measurement, RunConfig, measure_combination

POLICIES = ("none", "nothing_saveable", "dots_saveable")
LABELS = {"none": "no remat", "nothing_saveable": "full", "dots_saveable": "dots_saveable"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    image_size: int
    patch_size: int
    dim: int
    mlp_dim: int
    depths: tuple[int, ...]
    batch: int
    batches: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1  # patches and the class token

    def block_input_bytes(self, batch: int) -> int:
        return batch * self.tokens * self.dim * 4


FULL = Sizes(
    image_size=32,
    patch_size=4,
    dim=64,
    mlp_dim=128,
    depths=(6, 12, 24),
    batch=64,
    batches=(32, 64, 128),
)
QUICK = Sizes(
    image_size=8, patch_size=4, dim=16, mlp_dim=32, depths=(1, 2, 4), batch=8, batches=(4, 8, 16)
)


def config(sizes: Sizes, depth: int) -> RunConfig:
    bindings = [
        f"models.VisionTransformer.image_size = {sizes.image_size}",
        f"models.VisionTransformer.patch_size = {sizes.patch_size}",
        f"models.VisionTransformer.dim = {sizes.dim}",
        f"models.VisionTransformer.mlp_dim = {sizes.mlp_dim}",
        f"models.VisionTransformer.depth = {depth}",
        f"data.shapes.image_size = {sizes.image_size}",
        f"data.shapes.eval_examples = {max(sizes.batches)}",  # one global batch at least
    ]
    return RunConfig(["quickstart.gin"], bindings, [str(cli.CONFIGS_DIR)])


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares growth of ys per unit of xs."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum(
        (x - mean_x) ** 2 for x in xs
    )


def mib(num_bytes: float | None) -> str:
    return "failed" if num_bytes is None else f"{num_bytes / 2**20:.1f}"


def measure_all(sizes: Sizes, steps: int) -> dict[tuple[str, int, int], Measurement]:
    """Every (policy, depth, batch) of both sweeps, each in its own process."""
    runs = [(d, sizes.batch) for d in sizes.depths]
    runs += [(sizes.depths[0], b) for b in sizes.batches if b != sizes.batch]
    results = {}
    for depth, batch in runs:
        for policy in POLICIES:
            start = time.perf_counter()
            result = measure_combination(config(sizes, depth), policy, batch, steps)
            results[policy, depth, batch] = result
            print(
                f"depth {depth:>2} batch {batch:>3} {policy:<16} peak {mib(result.peak_bytes)} "
                f"MiB ({time.perf_counter() - start:.0f} s) {result.error or ''}",
                file=sys.stderr,
                flush=True,
            )
    return results


def sweep_table(sizes, results, key_name, keys, key_of) -> list[str]:
    header = [key_name] + [f"{LABELS[p]} peak / step adds / XLA temp (MiB)" for p in POLICIES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in keys:
        cells = [str(key)]
        for policy in POLICIES:
            m = results[key_of(policy, key)]
            cells.append(
                f"{mib(m.peak_bytes)} / {mib(m.step_bytes)} / {mib(m.compiled_temp_bytes)}"
                if m.ok
                else f"failed: {m.error}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def growth_lines(sizes: Sizes, results) -> list[str]:
    """Growth per extra block of each policy, between each pair of depths and as a least-squares
    fit, with full remat's against the ideal of one block input per block."""
    depths = list(sizes.depths)
    ideal = sizes.block_input_bytes(sizes.batch)
    steps = [f"{a}->{b} blocks" for a, b in zip(depths, depths[1:])]
    lines = [
        "| policy | "
        + " | ".join(f"step adds per block, {s} (KiB)" for s in steps)
        + " | fit over all depths (KiB) | fit minus the block's gradients (KiB) | "
        "XLA temp per block, fit (KiB) |",
        "|---|" + "---|" * (len(steps) + 3),
    ]
    fits = {}
    for policy in POLICIES:
        ms = [results[policy, d, sizes.batch] for d in depths]
        if not all(m.ok for m in ms):
            lines.append(f"| {LABELS[policy]} | failed |")
            continue
        pairs = [
            (b.step_bytes - a.step_bytes) / (db - da)
            for (a, da), (b, db) in zip(zip(ms, depths), zip(ms[1:], depths[1:]))
        ]
        step = slope(depths, [m.step_bytes for m in ms])
        grads = slope(depths, [m.live_before_bytes for m in ms]) / 3  # weights + 2 AdamW slots
        temp = slope(depths, [m.compiled_temp_bytes for m in ms])
        fits[policy] = (pairs, step, grads, temp)
        cells = [f"{x / 1024:.0f} ({x / ideal:.2f}x)" for x in (*pairs, step, step - grads, temp)]
        lines.append(f"| {LABELS[policy]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "In parentheses: times the ideal for full remat, one block input per block = batch "
        f"{sizes.batch} x {sizes.tokens} tokens x width {sizes.dim} x 4 bytes = "
        f"{ideal / 1024:.0f} KiB. A block's gradients are estimated as a third of how much the "
        "weights and AdamW's two slots grow per block.",
    ]
    if "nothing_saveable" in fits:
        pairs, step, grads, temp = fits["nothing_saveable"]
        lines.append(
            "Full remat: "
            + ", ".join(f"{x / ideal:.2f}x" for x in pairs)
            + f" the ideal between successive depths; {step / ideal:.2f}x fitted over all depths, "
            f"{(step - grads) / ideal:.2f}x without the gradients; XLA's temporaries grow by "
            f"{temp / ideal:.2f}x the ideal per block."
        )
    return lines


def report(sizes: Sizes, results, command: str) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    depth0 = sizes.depths[0]
    lines = [
        "# Peak memory against depth and batch size, per remat policy",
        "",
        f"`{command}`",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load}. Quickstart ViT ({sizes.image_size} px, patch {sizes.patch_size}, "
        f"{sizes.tokens} tokens, width {sizes.dim}, MLP {sizes.mlp_dim}), AdamW, the Trainer's "
        "XLA-compiled step on the CPU. *Peak*: the allocator's absolute peak during a steady "
        "step (weights, AdamW slots and prefetched data included); *step adds*: peak minus what "
        "was live before the step; *XLA temp*: temporaries of the compiled forward and backward "
        "pass (`memory.compiled_bytes`). CPU figures: compare them with each other, not with a "
        "TPU core (docs/memory.md).",
        "",
        f"## Depth (batch {sizes.batch})",
        "",
        *sweep_table(sizes, results, "blocks", sizes.depths, lambda p, d: (p, d, sizes.batch)),
        "",
        f"## Batch size ({depth0} blocks)",
        "",
        *sweep_table(sizes, results, "batch", sizes.batches, lambda p, b: (p, depth0, b)),
        "",
        "## Growth per extra block",
        "",
        *growth_lines(sizes, results),
        "",
    ]
    return "\n".join(lines)


def plot(sizes: Sizes, results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (by_depth, by_batch) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in POLICIES:
        for axes, keys, key_of in (
            (by_depth, sizes.depths, lambda d, p=policy: (p, d, sizes.batch)),
            (by_batch, sizes.batches, lambda b, p=policy: (p, sizes.depths[0], b)),
        ):
            points = [
                (k, results[key_of(k)].peak_bytes / 2**20) for k in keys if results[key_of(k)].ok
            ]
            if points:
                axes.plot(*zip(*points), marker="o", label=LABELS[policy])
    full = results.get(("nothing_saveable", sizes.depths[0], sizes.batch))
    if full is not None and full.ok:
        ideal = [
            full.peak_bytes / 2**20
            + (d - sizes.depths[0]) * sizes.block_input_bytes(sizes.batch) / 2**20
            for d in sizes.depths
        ]
        by_depth.plot(
            sizes.depths,
            ideal,
            linestyle=":",
            color="black",
            label="full, ideal: + one block input per block",
        )
    by_depth.set(xlabel="blocks", ylabel="allocator peak (MiB)", title=f"batch {sizes.batch}")
    by_batch.set(
        xlabel="global batch size", ylabel="allocator peak (MiB)", title=f"{sizes.depths[0]} blocks"
    )
    for axes in (by_depth, by_batch):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting")
    parser.add_argument("--out", help="write the markdown report here too")
    parser.add_argument("--plot", help="write the picture here (PNG)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    results = measure_all(sizes, args.steps)
    text = report(sizes, results, "python " + " ".join(sys.argv))
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text)
    if args.plot:
        plot(sizes, results, args.plot)


if __name__ == "__main__":
    main()
