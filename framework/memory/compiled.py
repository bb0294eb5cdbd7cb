"""XLA's own memory plan for a `jit_compile=True` step, obtained without running it.

XLA decides every buffer of a compiled program ahead of time (its buffer assignment), so the
bytes a step needs can be known before the first step runs. TensorFlow returns the optimized
module together with that assignment from
`fn.experimental_get_compiler_ir(*args)(stage="optimized_hlo_proto_serialized")` (an `HloProto`
whose `buffer_assignment` field is filled), so `compiled_bytes` works in this process: no
`XLA_FLAGS=--xla_dump_to`, which XLA reads once per process, and no subprocess. With a `target`
the program goes to the compiler of the TPU chip or GPU named instead (`targets.py`).
"""

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from framework.core.tf_internals import hlo_pb2, is_jit_compiled
from framework.memory import targets
from framework.memory.allocator import default_device
from framework.memory.xla_buffers import CompiledMemory, memory_from_hlo_proto


def compiled_bytes(
    fn: Callable[..., Any], *args: Any, target: str | None = None, **kwargs: Any
) -> CompiledMemory:
    """Compiles `fn(*args, **kwargs)` with XLA, without running it, and returns XLA's plan.

    `fn` must be a `tf.function(jit_compile=True)`. Captured variables become parameters of the
    program, so `parameter_bytes` includes the weights and optimizer state a train step touches.
    Arguments may be tensors or `tf.TensorSpec`s (then nothing needs to be allocated).
    The result is deterministic for a given program and compiler. With `--xla_dump_to` in
    XLA_FLAGS, XLA hands back the unoptimised module beside the optimised buffer assignment: the
    totals stay right, but temporaries lose their shapes and op names (read the dump with
    `parse_buffer_assignment` then).

    Args:
      fn: the jit-compiled function.
      *args: its positional arguments.
      target: None for the XLA compiler of the device `fn` would run on (labelled "XLA:CPU",
        "XLA:GPU", ...); a TPU chip ("v5e", "v4", "v5p-8", ...; see `tpu.tpu_chip`) to compile
        for it with libtpu's compiler (the `tpu` extra), or an NVIDIA GPU ("p100", "v100",
        "a100-40gb", "h100", ...; see `gpu.gpu_card`) to compile for it with XLA's GPU compiler
        (the `gpu` extra); on this host, with or without that device.
      **kwargs: its keyword arguments.
    """
    if not is_jit_compiled(fn):
        raise ValueError(
            "compiled_bytes needs a tf.function(jit_compile=True); XLA plans buffers only for "
            f"programs it compiles, and {fn!r} is not one."
        )
    ir = fn.experimental_get_compiler_ir(*args, **kwargs)
    if target is not None:
        return targets.compile_for_target(ir(stage="hlo_serialized"), target)
    proto = hlo_pb2.HloProto.FromString(ir(stage="optimized_hlo_proto_serialized"))
    return memory_from_hlo_proto(proto, compiler=xla_compiler())


def xla_compiler(device: str | None = None) -> str:
    """How a plan by XLA's compiler for `device` (default: `default_device()`) is labelled,
    e.g. "XLA:CPU"."""
    return f"XLA:{tf.DeviceSpec.from_string(device or default_device()).device_type}"
