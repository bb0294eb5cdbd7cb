"""What the launcher knows of Cloud TPUs without asking gcloud: accelerator types and their hosts,
peak FLOP/s, which families the TPU compiler plans for, TensorFlow runtime names.

This runs where TensorFlow need not be installed (the user's workstation), so it keeps its own
copies of `SUPPORTED_TENSORFLOW` and the peak table; tests compare them with the framework's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from launch.tpu.errors import LaunchError

# The TensorFlow versions the project supports, and the one TPU runtimes carry: the
# `tensorflow-tpu` wheels stop at 2.20.0, so a TPU VM runs 2.20 even where the project
# is tested on 2.21.
SUPPORTED_TENSORFLOW = ("2.20", "2.21")
TPU_TENSORFLOW = "2.20.0"
# Accelerator types name TensorCores (v2, v3, v4, v5p: 2 per chip, 4 chips per host) or chips
# (v5e, v6e: up to 8 per host); either way a type above 8 spans several hosts.
CORE_NAMED = ("v2", "v3", "v4", "v5p")
CHIP_NAMED = ("v5litepod", "v5e", "v6e")
# Peak bfloat16 TFLOP/s of one TensorFlow TPU device (what MFU is measured against: TPUs report
# no type to TensorFlow, so the launcher binds `Runtime.peak_tflops`). From Google's datasheets,
# per chip: v2 45, v3 123, v4 275, v5p 459, v5e 197, v6e 918; TensorFlow makes one device per
# TensorCore on v2 and v3 (two per chip) and one per chip from v4 on (megacore).
TPU_PEAK_TFLOPS = {
    "v2": 22.5,
    "v3": 61.5,
    "v4": 275.0,
    "v5p": 459.0,
    "v5litepod": 197.0,
    "v5e": 197.0,
    "v6e": 918.0,
}
# Families whose chips the TPU compiler can plan for on any host (framework/memory/tpu.py's
# TPU_CHIPS; a test compares the two): the launcher binds `Runtime.accelerator_type` for them, so
# that `Trainer.remat_policy = "auto"` plans with the TPU compiler for the chip the run has.
PLANNABLE = ("v4", "v5p", "v5litepod", "v5e", "v6e")
SINGLE_HOST_MAX = 8


def accelerator_family(accelerator_type: str) -> tuple[str, int]:
    """('v4', 32) for 'v4-32'; unknown generations are an error rather than a guess."""
    match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type)
    if not match or match[1] not in (*CORE_NAMED, *CHIP_NAMED):
        known = ", ".join(f"{family}-N" for family in (*CORE_NAMED, *CHIP_NAMED))
        raise LaunchError(f"unknown accelerator type {accelerator_type!r} (known: {known})", 2)
    return match[1], int(match[2])


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
        return f"{self.tensorflow[0]}.{self.tensorflow[1]}" in SUPPORTED_TENSORFLOW

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
