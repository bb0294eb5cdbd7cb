"""Measuring a step's memory: the allocator's real peak, and XLA's plan before anything runs.

- `peak_bytes(fn, *args)`: run once, read the device allocator's peak (CPU needs
  `TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow starts; see `enable_cpu_bfc_allocator`).
- `compiled_bytes(fn, *args)`: compile a `jit_compile=True` function and read XLA's buffer
  assignment (total, parameters, temps, the buffers live at the peak), without running it;
  `target="v5e"` compiles it for a TPU chip with libtpu's compiler (`tpu.py`), `target="p100"`
  for an NVIDIA GPU with XLA's GPU compiler (`gpu.py`), on any host.
- `parse_bytes` / `format_bytes`: "16GiB" <-> bytes, for budgets given on the command line.
"""

from framework.memory.allocator import (
    AllocatorNotTrackedError,
    PeakMemory,
    PeakTracker,
    counting_device,
    default_device,
    enable_cpu_bfc_allocator,
    keeps_statistics,
    peak_bytes,
)
from framework.memory.compiled import compiled_bytes, xla_compiler
from framework.memory.units import format_bytes, parse_bytes
from framework.memory.xla_buffers import (
    Buffer,
    CompiledMemory,
    memory_from_hlo_proto,
    parse_buffer_assignment,
)

__all__ = [
    "AllocatorNotTrackedError",
    "Buffer",
    "CompiledMemory",
    "PeakMemory",
    "PeakTracker",
    "counting_device",
    "compiled_bytes",
    "default_device",
    "enable_cpu_bfc_allocator",
    "format_bytes",
    "keeps_statistics",
    "memory_from_hlo_proto",
    "parse_buffer_assignment",
    "parse_bytes",
    "peak_bytes",
    "xla_compiler",
]
