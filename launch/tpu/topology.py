"""What the launcher knows of Cloud TPUs without asking gcloud: accelerator types and their hosts,
each type's generation (peak FLOP/s, whether the TPU compiler plans for it), TensorFlow runtime
names.

The generations' figures and the supported TensorFlow releases are the framework's own
(`framework.core.tpu_generations`, `framework.core.releases`), from modules that import no
TensorFlow: the launcher runs where TensorFlow need not be installed (the user's workstation).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from framework.core.releases import is_supported_tensorflow
from framework.core.tpu_generations import TPU_GENERATIONS, TpuGeneration
from launch.tpu.errors import LaunchError

# The TensorFlow TPU runtimes carry: the `tensorflow-tpu` wheels stop at 2.20.0, so a TPU VM runs
# 2.20 even where the project is tested on 2.21.
TPU_TENSORFLOW = "2.20.0"
# An accelerator type starts with a generation's Cloud TPU prefix or short name ("v5litepod-16",
# "v5e-16") and counts TensorCores where a chip has two (v2, v3, v4, v5p: 4 chips per host) or
# chips (v5e, v6e: up to 8 per host); either way a type above 8 spans several hosts.
GENERATIONS = {
    name: generation
    for generation in TPU_GENERATIONS.values()
    for name in generation.accelerator_names
}
CORE_NAMED = tuple(name for name, g in GENERATIONS.items() if g.tensorcores_per_chip == 2)
CHIP_NAMED = tuple(name for name, g in GENERATIONS.items() if g.tensorcores_per_chip == 1)
SINGLE_HOST_MAX = 8


def accelerator_family(accelerator_type: str) -> tuple[str, int]:
    """('v4', 32) for 'v4-32'; unknown generations are an error rather than a guess."""
    match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type)
    if not match or match[1] not in GENERATIONS:
        known = ", ".join(f"{family}-N" for family in (*CORE_NAMED, *CHIP_NAMED))
        raise LaunchError(f"unknown accelerator type {accelerator_type!r} (known: {known})", 2)
    return match[1], int(match[2])


def tpu_generation(accelerator_type: str) -> TpuGeneration:
    """The generation of the slice's chips: v5e's for 'v5litepod-16'."""
    return GENERATIONS[accelerator_family(accelerator_type)[0]]


def is_multi_host(accelerator_type: str) -> bool:
    """Whether the slice spans several TPU VMs (and so needs a `-pod-` runtime and one client)."""
    _, size = accelerator_family(accelerator_type)
    return size > SINGLE_HOST_MAX


def default_runtime(accelerator_type: str) -> str:
    """`tpu-vm-tf-X.Y.Z[-pod]-pjrt`, Cloud TPU's naming for TensorFlow runtimes (see docs)."""
    pod = "-pod" if is_multi_host(accelerator_type) else ""
    return f"tpu-vm-tf-{TPU_TENSORFLOW}{pod}-pjrt"


@dataclass(frozen=True)
class TpuRuntime:
    """A TensorFlow TPU runtime name taken apart: `tpu-vm-tf-2.20.0-pod-pjrt[-HARDWARE]`."""

    name: str
    tensorflow: tuple[int, int, int]
    pod: bool
    pjrt: bool
    hardware: str | None

    @classmethod
    def parse(cls, name: str) -> TpuRuntime | None:
        match = re.fullmatch(r"tpu-vm-tf-(\d+)\.(\d+)\.(\d+)(-pod)?(-pjrt|-se)?(?:-(.+))?", name)
        if not match:
            return None
        version = (int(match[1]), int(match[2]), int(match[3]))
        return cls(name, version, bool(match[4]), match[5] == "-pjrt", match[6])

    def supported(self) -> bool:
        return is_supported_tensorflow(".".join(map(str, self.tensorflow)))

    def fits(self, accelerator_type: str) -> bool:
        """Pod-ness matches, and a hardware suffix (seen as `-v5e-and-v6`) names this family."""
        family, _ = accelerator_family(accelerator_type)
        hardware = {"v5e-and-v6": CHIP_NAMED, "v5p-and-below": CORE_NAMED}
        fits_hardware = self.hardware is None or family in hardware.get(self.hardware, ())
        return self.pod == is_multi_host(accelerator_type) and fits_hardware


def newest_runtime(names: Sequence[str], accelerator_type: str) -> str | None:
    """The newest PJRT TensorFlow runtime among `names` for a supported TensorFlow.

    Of two builds of one TensorFlow version, the one made for this hardware family wins.
    """
    runtimes = [TpuRuntime.parse(name) for name in names]
    fitting = [
        runtime
        for runtime in runtimes
        if runtime and runtime.pjrt and runtime.supported() and runtime.fits(accelerator_type)
    ]
    newest = max(fitting, key=lambda r: (r.tensorflow, r.hardware is not None), default=None)
    return newest.name if newest else None
