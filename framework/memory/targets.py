"""A device a step is planned for by name, on any host: a TPU chip (libtpu's compiler) or an
NVIDIA GPU (XLA's GPU compiler from jax's CUDA plugin); one entry for both."""

from __future__ import annotations

from framework.memory import gpu, tpu
from framework.memory.xla_buffers import CompiledMemory

Target = tpu.TpuChip | gpu.GpuCard


def target_device(name: str) -> Target:
    """The TPU chip or GPU card `name` stands for: "v5e", "v5litepod-16", "p100", "a100-40gb",
    "Tesla V100-SXM2-32GB", ... (`tpu.tpu_chip`, `gpu.gpu_card`).

    Raises:
      ValueError: naming the chips and cards known.
    """
    try:
        return tpu.tpu_chip(name)
    except ValueError:
        pass
    try:
        return gpu.gpu_card(name)
    except ValueError:
        pass
    chips = ", ".join(f"{c.name} ({c.accelerator_prefix}-N)" for c in tpu.TPU_CHIPS.values())
    raise ValueError(
        f"Unknown target {name!r}; TPU chips: {chips}; GPUs: {', '.join(gpu.GPU_CARDS)}."
    )


def compile_for_target(
    hlo_module: bytes,
    name: str,
    replicas: int = 1,
    compiler_flags: dict[str, str] | None = None,
) -> CompiledMemory:
    """The plan of a serialized HloModuleProto compiled for the device `name` stands for
    (`tpu.compile_for_chip`, `gpu.compile_for_card`); `replicas` > 1 compiles for that many
    chips of a TPU slice.

    Raises:
      MissingDependency: the extra of that compiler (`tpu` or `gpu`) is not installed.
    """
    device = target_device(name)
    if device.kind == "GPU":
        if replicas > 1:
            raise ValueError("a GPU plan is one card's program: plan with one replica")
        return gpu.compile_for_card(hlo_module, device, compiler_flags=compiler_flags)
    return tpu.compile_for_chip(hlo_module, device, compiler_flags, replicas)
