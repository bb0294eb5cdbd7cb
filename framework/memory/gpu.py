"""XLA's GPU compiler's memory plan of a step, for a card named, on any host: nothing run.

XLA:GPU plans memory its own way: its fusions (Triton's among them), cuBLAS and cuDNN calls
with their workspaces, a scheduler and a rematerialization pass that works towards the card's
memory. A figure from XLA:CPU or from a TPU's compiler is therefore not a GPU's. jax's CUDA
plugin carries XLA's GPU compiler with a compile-only client that compiles for a GPU described
by XLA's `GpuTargetConfigProto` (its SMs, memory, clocks, compute capability) without one
attached; this module writes that description for the card named, hands the compiler
TensorFlow's HLO and reads back the plan in the same `CompiledMemory` shape the CPU and TPU paths
return.

What it cannot tell: what only the card shows. Without a GPU the compiler autotunes nothing (its
kernel and workspace choices are its defaults), and the process's own reservations - the CUDA
context, cuBLAS and cuDNN handles and workspaces TensorFlow keeps outside the program,
TensorFlow's allocator's fragmentation - are not in any compiled program: docs/memory.md says
how much margin to keep for them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from framework.core.tf_internals import hlo_pb2
from framework.memory.hlo_flops import hlo_matmul_flops
from framework.memory.xla_buffers import CompiledMemory, memory_from_hlo_proto


@dataclasses.dataclass(frozen=True)
class GpuCard:
    """One NVIDIA GPU, as XLA's GPU compiler and a planner see it: the device's published
    figures, in the fields of XLA's `GpuTargetConfigProto`.

    Attributes:
      name: the short name, e.g. "a100-40gb".
      device_name: the name CUDA (and so TensorFlow) reports, e.g. "NVIDIA A100-SXM4-40GB".
      compute_capability: (major, minor); `accelerated` adds the "a" features (sm_90a, ...).
      sms / fp32_lanes_per_sm / clock_ghz: streaming multiprocessors, float32 lanes in each,
        boost clock.
      memory_bytes: device memory, as CUDA reports its total; XLA's default memory limit.
      memory_bandwidth: bytes per second.
      l2_bytes / shared_memory_per_sm / shared_memory_per_block: caches the compiler's fusion
        and tiling heuristics read (the last is the opt-in limit of one block).
      fp32_flops / tf32_flops / bf16_flops: dense peak FLOP/s of matrix products in float32,
        TensorFloat-32 (what TensorFlow and XLA use for float32 products on cards that have
        it) and bfloat16; 0 where the card has no such units.
    """

    name: str
    device_name: str
    compute_capability: tuple[int, int]
    sms: int
    fp32_lanes_per_sm: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: float
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block: int
    fp32_flops: float
    tf32_flops: float = 0.0
    bf16_flops: float = 0.0
    accelerated: bool = False
    kind: ClassVar[str] = "GPU"  # the device type TensorFlow names

    def peak(self, precision: str = "float32") -> float:
        """Dense peak FLOP/s of the card's matrix products in `precision` ("float32" or
        "bfloat16"): float32 products use TensorFloat-32 where the card has it (TensorFlow's
        and XLA's default); bfloat16 runs as float32 on cards without bfloat16 units."""
        if precision == "bfloat16" and self.bf16_flops:
            return self.bf16_flops
        return self.tf32_flops or self.fp32_flops


MIB = 1024**2

# NVIDIA's published figures (datasheets and CUDA's device properties). Each card XLA describes
# in xla/backends/gpu/target_config/specs/ (p100, v100, a100_sxm_40, a100_sxm_80, h100_sxm, h200,
# b200) was checked against that description; T4 and L4 have none there. Every card compiles with
# jax 0.10.2's CUDA plugin (`jax_internals.SUPPORTED_JAX`), P100 and V100 with CUDA 12's ptxas.
GPU_CARDS = {
    card.name: card
    for card in (
        GpuCard(
            "p100", "Tesla P100-SXM2-16GB", (6, 0), 56, 64, 1.4805, 17_066_885_120,
            732.16e9, 4 * MIB, 65_536, 49_152, fp32_flops=10.6e12,
        ),
        GpuCard(
            "v100", "Tesla V100-SXM2-16GB", (7, 0), 80, 64, 1.53, 16_935_682_048,
            898.048e9, 6 * MIB, 98_304, 98_304, fp32_flops=15.7e12,
        ),
        GpuCard(
            "t4", "Tesla T4", (7, 5), 40, 64, 1.59, 16_106_127_360,
            320e9, 4 * MIB, 65_536, 65_536, fp32_flops=8.1e12,
        ),
        GpuCard(
            "a100-40gb", "NVIDIA A100-SXM4-40GB", (8, 0), 108, 64, 1.41, 42_331_013_120,
            1555.2e9, 40 * MIB, 167_936, 166_912, 19.5e12, 156e12, 312e12,
        ),
        GpuCard(
            "a100-80gb", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 85_100_068_864,
            2039.04e9, 40 * MIB, 167_936, 166_912, 19.5e12, 156e12, 312e12,
        ),
        GpuCard(
            "l4", "NVIDIA L4", (8, 9), 58, 128, 2.04, 24_152_899_584,
            300e9, 48 * MIB, 102_400, 101_376, 30.3e12, 60e12, 121e12,
        ),
        GpuCard(
            "h100", "NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 84_942_979_072,
            3352.32e9, 50 * MIB, 233_472, 232_448, 67e12, 494.7e12, 989.4e12, accelerated=True,
        ),
        GpuCard(
            "h200", "NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 1.98, 151_397_597_184,
            4800e9, 50 * MIB, 233_472, 232_448, 67e12, 494.7e12, 989.4e12, accelerated=True,
        ),
        GpuCard(
            "b200", "NVIDIA B200", (10, 0), 148, 128, 1.965, 191_514_411_008,
            7672.32e9, 132_644_864, 233_472, 232_448, 75e12, 1.1e15, 2.25e15, accelerated=True,
        ),
    )
}  # fmt: skip

# The card of a family CUDA names without its memory size ("NVIDIA H100 PCIe", "Tesla T4").
_FAMILY_DEFAULT = {"p100": "p100", "v100": "v100", "a100": "a100-80gb"}


def _family(card: GpuCard) -> str:
    return card.name.split("-")[0]


def _nominal_gb(card: GpuCard) -> int:
    """The memory size a card's name states: 16 for "Tesla V100-SXM2-16GB"."""
    match = re.search(r"(\d+)GB", card.device_name)
    return int(match[1]) if match else round(card.memory_bytes / 1e9)


def gpu_card(name: str) -> GpuCard:
    """The card a name stands for: a short name ("p100", "a100-80gb", "h100"; see `GPU_CARDS`)
    or the name CUDA reports for a device ("Tesla V100-SXM2-32GB", "NVIDIA A100 80GB PCIe").
    A device of a known family with another memory size gets the family's description with its
    own memory ("Tesla V100-SXM2-32GB": a V100 of 32 GB); PCIe models get their SXM sibling's
    description, whose clocks are a little higher (the memory plan does not depend on them).

    Raises:
      ValueError: naming the cards known.
    """
    key = name.strip().lower()
    if key in GPU_CARDS:
        return GPU_CARDS[key]
    for card in GPU_CARDS.values():
        if key == card.device_name.lower():
            return card
    words = re.findall(r"[a-z]?\d+|[a-z]+", key.replace("tesla", ""))
    families = [_family(c) for c in GPU_CARDS.values()]
    family = next((w for w in words if w in families), None)
    if family is not None:
        size = re.search(r"(\d+)\s*gb", key)
        cards = [c for c in GPU_CARDS.values() if _family(c) == family]
        if size is None:
            return GPU_CARDS[_FAMILY_DEFAULT.get(family, cards[0].name)]
        gb = int(size[1])
        card = min(cards, key=lambda c: abs(_nominal_gb(c) - gb))
        if _nominal_gb(card) == gb:
            return card
        memory = round(card.memory_bytes * gb / _nominal_gb(card))
        return dataclasses.replace(card, name=f"{family}-{gb}gb", memory_bytes=memory)
    known = ", ".join(GPU_CARDS)
    raise ValueError(f"Unknown GPU {name!r}; known: {known} (or the name CUDA reports for one).")


def local_card() -> GpuCard | None:
    """The card of this host's first GPU, as TensorFlow lists it without starting it; None
    without a GPU, or when it is not a card `gpu_card` knows."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    details = tf.config.experimental.get_device_details(gpus[0])
    try:
        return gpu_card(details.get("device_name", ""))
    except ValueError:
        return None


def target_config(card: GpuCard, memory_bytes: int | None = None) -> str:
    """XLA's `GpuTargetConfigProto` of `card`, in text form: what the compile-only client
    compiles for. `memory_bytes` plans for the card with less memory than it has (the
    compiler rematerializes towards it)."""
    major, minor = card.compute_capability
    memory = memory_bytes or card.memory_bytes
    features = "ACCELERATED_FEATURES" if card.accelerated else "NONE"
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {card.shared_memory_per_sm}
  threads_per_core_limit: {1024 if (major, minor) == (7, 5) else 2048}
  core_count: {card.sms}
  fpus_per_core: {card.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(card.memory_bandwidth)}
  l2_cache_size: {card.l2_bytes}
  clock_rate_ghz: {card.clock_ghz}
  device_memory_size: {memory}
  shared_memory_per_block_optin: {card.shared_memory_per_block}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {features} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  name: "{card.device_name}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{card.device_name}"
"""


# What XLA:GPU says when its Triton GEMM emitter has no tiling for a product (`compile_for_card`).
_UNTILED_PRODUCT = "Couldn't find output tile sizes"


def compile_for_card(
    hlo_module: bytes,
    card: GpuCard,
    memory_bytes: int | None = None,
    compiler_flags: dict[str, str | bool] | None = None,
) -> CompiledMemory:
    """XLA:GPU's plan of a serialized HloModuleProto (TensorFlow's
    `experimental_get_compiler_ir(...)(stage="hlo_serialized")`) compiled for one `card`.

    The totals are the compiler's own memory statistics; the peak is all of them, the
    temporaries being one block held for the whole execution, as on a TPU; the buffers listed
    at the peak come from its buffer assignment. `flops` are the dot and convolution FLOPs of
    the optimised program (its cuBLAS and cuDNN calls), so recomputation the compiler added is
    in them: the client has no cost analysis. `memory_bytes` plans for less memory than the
    card has; `compiler_flags` are XLA flags for this compilation
    ({"xla_gpu_memory_limit_slop_factor": "50"}).

    Raises:
      MissingDependency: the `gpu` extra (jax, jaxlib, jax's CUDA plugin, ptxas) is missing.
    """
    from framework.core import jax_internals

    device = jax_internals.cuda_device(target_config(card, memory_bytes))
    label = ""
    try:
        compiled = jax_internals.compile_only(hlo_module, device, compiler_flags)
    except Exception as error:  # noqa: BLE001 (jaxlib's runtime error; only this one is retried)
        if _UNTILED_PRODUCT not in str(error):
            raise
        # Without a card to autotune on, XLA:GPU's Triton GEMM emitter finds no tiling for
        # some float32 products on Ampere (XLA's own A100 description fails the same way); a
        # run would autotune between Triton and cuBLAS. Every product goes to cuBLAS instead.
        flags = {**(compiler_flags or {}), "xla_gpu_enable_triton_gemm": False}
        compiled = jax_internals.compile_only(hlo_module, device, flags)
        label = ", products in cuBLAS"
    proto = hlo_pb2.HloProto.FromString(compiled.hlo_proto)
    major, minor = card.compute_capability
    plugin = jax_internals.versions()["jax-cuda12-plugin"]
    label = f"XLA:GPU {card.name} sm_{major}{minor} (jax-cuda12-plugin {plugin}{label})"
    plan = memory_from_hlo_proto(proto, label)
    outputs = compiled.output_bytes - compiled.alias_bytes
    total = compiled.argument_bytes + outputs + compiled.temp_bytes
    return dataclasses.replace(
        plan,
        total_bytes=total,
        peak_bytes=total,
        parameter_bytes=compiled.argument_bytes,
        output_bytes=outputs,
        temp_bytes=compiled.temp_bytes,
        capacity_bytes=memory_bytes or card.memory_bytes,
        flops=float(hlo_matmul_flops(proto.hlo_module)[0]),
    )
