"""The Cloud TPU generations the project knows, as plain data: peak FLOP/s, HBM, how TensorCores
make TensorFlow devices, and how Cloud TPU names them.

Both the TPU compiler's plans (`framework.memory.tpu`) and the TPU launcher (`launch/tpu/`) read
these figures. The launcher runs on a workstation where TensorFlow need not be installed, so this
module imports nothing but the standard library: one table serves both, on any machine.

The figures are Google's, from Cloud TPU's system architecture pages
(https://cloud.google.com/tpu/docs/system-architecture-tpu-vm and one page per version).
"""

from __future__ import annotations

import dataclasses

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation.

    Attributes:
      name: the short name, e.g. "v5e".
      accelerator_prefix: how Cloud TPU names its slices, e.g. "v5litepod" in "v5litepod-16".
      peak_flops: dense bfloat16 FLOP/s of one chip.
      hbm_bytes: HBM of one chip.
      tensorcores_per_chip: 2 from v2 to v5p, whose accelerator types count TensorCores
        ("v4-32" is 16 chips); 1 on v5e and v6e, whose accelerator types count chips.
      devices_per_chip: the TensorFlow devices one chip is: 2 on v2 and v3 (a device per
        TensorCore), 1 from v4 on (two TensorCores act as one megacore device, or one core).
      compile_only_topology: the topology libtpu's compile-only client compiles a one-chip
        program for (the smallest it knows), or None where it knows none (v2, v3): the TPU
        compiler can plan, on any host, only for generations that have one.
    """

    name: str
    accelerator_prefix: str
    peak_flops: float
    hbm_bytes: int
    tensorcores_per_chip: int
    devices_per_chip: int
    compile_only_topology: str | None

    @property
    def accelerator_names(self) -> tuple[str, ...]:
        """What an accelerator type of this generation may start with: its Cloud TPU prefix and
        its short name, e.g. ("v5litepod", "v5e")."""
        return tuple(dict.fromkeys((self.accelerator_prefix, self.name)))

    @property
    def megacore(self) -> bool:
        """Whether the chip's TensorCores act as one device (v4, v5p): libtpu compiles for such a
        chip under its "megacore" chip configuration."""
        return self.devices_per_chip < self.tensorcores_per_chip

    @property
    def peak_flops_per_device(self) -> float:
        """Dense bfloat16 FLOP/s of one TensorFlow device: what model FLOPs utilisation is
        measured against (half a chip's on v2 and v3)."""
        return self.peak_flops / self.devices_per_chip


# Oldest first; v5e before v5p, as Cloud TPU released them.
TPU_GENERATIONS = {
    generation.name: generation
    for generation in (
        TpuGeneration("v2", "v2", 45e12, 16 * GIB, 2, 2, None),
        TpuGeneration("v3", "v3", 123e12, 32 * GIB, 2, 2, None),
        TpuGeneration("v4", "v4", 275e12, 32 * GIB, 2, 1, "v4:2x2x1"),
        TpuGeneration("v5e", "v5litepod", 197e12, 16 * GIB, 1, 1, "v5e:1x1"),
        TpuGeneration("v5p", "v5p", 459e12, 95 * GIB, 2, 1, "v5p:2x2x1"),
        TpuGeneration("v6e", "v6e", 918e12, 32 * GIB, 1, 1, "v6e:1x1"),
    )
}
