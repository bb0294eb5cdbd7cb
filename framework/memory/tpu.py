"""The TPU compiler's memory plan of a step, on any host: a chip named, nothing run.

XLA's TPU compiler plans memory differently from its CPU compiler: other fusions, other
layouts (a TPU tiles each array's two minor dimensions, padding them to 8 x 128), a scheduler
that trades memory for overlap, and on-chip memories (VMEM) that take what the CPU would keep in
main memory. A figure from XLA:CPU is therefore not a TPU's. libtpu ships the TPU compiler with a
compile-only client, which compiles for a named chip without one attached; this module hands it
TensorFlow's HLO and reads back the plan in the same `CompiledMemory` shape the CPU path returns.

What it cannot tell: anything only running shows (the TPU runtime's own reservations, the
input pipeline's buffers, fragmentation over many steps). Those need a TPU VM: compare with
`peak_bytes` there.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import ClassVar

from framework.core.tf_internals import hlo_pb2, xla_data_pb2
from framework.core.tpu_generations import TPU_GENERATIONS
from framework.memory.xla_buffers import CompiledMemory, memory_from_hlo_proto


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation, as the compile-only client and a planner see it.

    Attributes:
      name: the short name, e.g. "v5e".
      accelerator_prefix: how Cloud TPU names its slices, e.g. "v5litepod" in "v5litepod-16".
      topology / chip_config: the compile-only topology the per-device program is compiled for
        ("megacore" on v4 and v5p, whose two TensorCores act as one device).
      hbm_bytes: HBM per chip (one device).
      peak_flops: dense bf16 FLOP/s per chip.
    """

    name: str
    accelerator_prefix: str
    topology: str
    chip_config: str
    hbm_bytes: int
    peak_flops: float
    kind: ClassVar[str] = "TPU"  # the device type TensorFlow names

    @property
    def memory_bytes(self) -> int:
        """The chip's memory (HBM), under the name a GPU card's has."""
        return self.hbm_bytes

    def peak(self, precision: str = "bfloat16") -> float:
        """Peak FLOP/s of matrix products: the MXU's bfloat16 rate, at which XLA:TPU also
        multiplies float32 at its default precision."""
        return self.peak_flops


# The generations libtpu's compile-only client compiles for, with their figures from the one
# table the TPU launcher reads too (`framework.core.tpu_generations`).
TPU_CHIPS = {
    generation.name: TpuChip(
        generation.name,
        generation.accelerator_prefix,
        generation.compile_only_topology,
        "megacore" if generation.megacore else "default",
        generation.hbm_bytes,
        generation.peak_flops,
    )
    for generation in TPU_GENERATIONS.values()
    if generation.compile_only_topology is not None
}


def tpu_devices(accelerator_type: str) -> int:
    """The devices (chips) of a slice, among which a data-parallel batch is split:
    "v5litepod-16" -> 16, "v4-32" -> 16 (v4 and v5p slices count TensorCores, two per chip, and
    TensorFlow makes one device per chip); a bare chip name ("v5e") is one.

    Raises:
      ValueError: a size that is no slice's ("v5e-3", "v4-3").
    """
    chip = tpu_chip(accelerator_type)
    match = re.search(r"-(\d+)$", accelerator_type.strip())
    if match is None:
        return 1
    per_chip = 2 if chip.chip_config == "megacore" else 1
    chips = int(match[1]) // per_chip
    if chips < 1 or chips & (chips - 1) or int(match[1]) % per_chip:
        sizes = ", ".join(f"{chip.accelerator_prefix}-{n * per_chip}" for n in (1, 4, 8, 16))
        raise ValueError(
            f"{accelerator_type!r} is not a TPU slice: a slice has a power-of-two number of "
            f"chips ({sizes}, ...)"
        )
    return chips


def slice_topology(chip: TpuChip, chips: int) -> tuple[str, tuple[int, int, int]]:
    """The compile-only topology of a slice of `chips` chips (a power of two) and the chips one
    of its hosts drives: what a program of one replica per chip is compiled for. v5e and v6e
    slices are 2-D, on one host up to 8 chips and on 4-chip hosts beyond (2x4, 4x4, 4x8, ...);
    v4 and v5p slices are 3-D tori of 4-chip hosts (2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...)."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"a TPU slice has a power-of-two number of chips, not {chips}")
    if chips == 1:
        bounds = tuple(int(n) for n in chip.topology.split(":")[1].split("x"))
        return chip.topology, (*bounds, 1, 1)[:3]
    if chip.chip_config == "megacore":
        bounds = [2, 2, 1]
        while bounds[0] * bounds[1] * bounds[2] < chips:
            smallest = min(bounds)
            axis = max(a for a in range(3) if bounds[a] == smallest)
            bounds[axis] *= 2
        return f"{chip.name}:{'x'.join(map(str, bounds))}", (2, 2, 1)
    x = 2 ** ((chips.bit_length() - 1) // 2)
    host = (x, chips // x, 1) if chips <= 8 else (2, 2, 1)
    return f"{chip.name}:{x}x{chips // x}", host


def tpu_chip(name: str) -> TpuChip:
    """The chip a name stands for: "v5e", or a Cloud TPU accelerator type such as
    "v5litepod-16", "v4-32" or "v6e-8" (the slice's size does not matter: the plan is per device).

    Raises:
      ValueError: naming the chips known.
    """
    key = re.sub(r"-\d+$", "", name.strip().lower())
    for chip in TPU_CHIPS.values():
        if key in (chip.name, chip.accelerator_prefix):
            return chip
    known = ", ".join(f"{c.name} ({c.accelerator_prefix}-N)" for c in TPU_CHIPS.values())
    raise ValueError(f"Unknown TPU chip {name!r}; known: {known}.")


# TensorFlow ops through which a random op leaves its algorithm to the device ("auto_select",
# the default of `tf.random.stateless_*` and so of Keras' dropout and seed generators).
_AUTO_SELECTED = frozenset(
    {"StatelessRandomGetKeyCounter", "StatelessRandomGetKeyCounterAlg", "StatelessRandomGetAlg"}
)


def _auto_selected(rng: hlo_pb2.HloInstructionProto, by_id: dict) -> bool:
    """Whether the state of an rng-bit-generator comes from TensorFlow's device-chosen key."""
    todo, seen = list(rng.operand_ids), set()
    while todo:
        inst = by_id[todo.pop()]
        if inst.metadata.op_type in _AUTO_SELECTED:
            return True
        if inst.id not in seen:
            seen.add(inst.id)
            todo.extend(inst.operand_ids)
    return False


def lower_random_for_tpu(hlo_module: bytes) -> bytes:
    """TensorFlow's CPU lowering of a program, with its random numbers lowered as on a TPU.

    The HLO TensorFlow hands out was lowered for the host's XLA device, where an op that leaves
    the algorithm to the device ("auto_select") draws with Philox. On a TPU, TensorFlow picks
    the TPU's own generator (XLA's RNG_DEFAULT, a 2-word state) for the same op. The two plan
    very differently: XLA:TPU expands Philox into `u32[N/4, 4]` blocks whose minor dimension 4
    is padded to 128 lanes, so a dropout mask of N values costs 32 times its size. Each such
    generator is switched to RNG_DEFAULT here, its state cut to 2 words, and readers of its new
    state given the old one: the values drawn differ, the shapes and so the plan are the TPU's.
    Generators with an explicit algorithm (`alg="philox"`, `tf.random.Generator`) are left
    as they are, as TensorFlow on a TPU leaves them.
    """
    module = hlo_pb2.HloModuleProto.FromString(hlo_module)
    by_id = {inst.id: inst for comp in module.computations for inst in comp.instructions}
    readers = collections.defaultdict(list)
    for inst in by_id.values():
        for operand in inst.operand_ids:
            readers[operand].append(inst)
    for comp in module.computations:
        instructions = []
        # A new instruction's id: past the computation's own, since XLA's protos number each
        # computation's instructions within it (its id in the upper 32 bits), and unused.
        next_id = max((inst.id for inst in comp.instructions), default=0) + 1
        for inst in comp.instructions:
            if (
                inst.opcode == "rng-bit-generator"
                and inst.rng_algorithm == xla_data_pb2.RNG_PHILOX
                and _auto_selected(inst, by_id)
            ):
                state = inst.operand_ids[0]
                while next_id in by_id:
                    next_id += 1
                cut = hlo_pb2.HloInstructionProto(
                    name=f"{inst.name}.tpu_state", opcode="slice", id=next_id, operand_ids=[state]
                )
                cut.shape.CopyFrom(by_id[state].shape)
                cut.shape.dimensions[:] = [_TPU_RNG_STATE_WORDS]
                cut.slice_dimensions.add(start=0, limit=_TPU_RNG_STATE_WORDS, stride=1)
                cut.metadata.CopyFrom(inst.metadata)
                instructions.append(cut)
                by_id[cut.id] = cut
                inst.operand_ids[0] = cut.id
                inst.rng_algorithm = xla_data_pb2.RNG_DEFAULT
                inst.shape.tuple_shapes[0].dimensions[:] = [_TPU_RNG_STATE_WORDS]
                for element in readers[inst.id]:
                    if element.opcode == "get-tuple-element" and element.tuple_index == 0:
                        element.shape.dimensions[:] = [_TPU_RNG_STATE_WORDS]
                        for reader in readers[element.id]:
                            reader.operand_ids[:] = [
                                state if i == element.id else i for i in reader.operand_ids
                            ]
            instructions.append(inst)
        del comp.instructions[:]
        comp.instructions.extend(instructions)
    return module.SerializeToString()


# The state of XLA:TPU's default generator: u64[2].
_TPU_RNG_STATE_WORDS = 2


def compile_for_chip(
    hlo_module: bytes,
    chip: TpuChip,
    compiler_flags: dict[str, str] | None = None,
    replicas: int = 1,
) -> CompiledMemory:
    """libtpu's plan of a serialized HloModuleProto (TensorFlow's
    `experimental_get_compiler_ir(...)(stage="hlo_serialized")`) compiled for one `chip`, or,
    with `replicas` > 1, for one replica per chip of a slice of that many chips (a program
    whose collectives span the slice); the plan is one chip's.

    Random numbers TensorFlow lets the device choose are drawn as on a TPU (see
    `lower_random_for_tpu`). The totals are the compiler's own memory statistics (what a TPU's
    runtime allocates in HBM), and the peak is all of them plus the program's code, since the
    temporaries are one block held for the whole execution; the buffers listed at the peak come
    from its buffer assignment, HBM only.
    `compiler_flags` are libtpu flags for this compilation, e.g.
    {"xla_tpu_max_hbm_size_mib": "8192"}.

    Raises:
      MissingDependency: the `tpu` extra (jax, jaxlib, libtpu) is not installed.
    """
    from framework.core import jax_internals

    topology, chips_per_host = slice_topology(chip, replicas)
    devices = jax_internals.tpu_topology_devices(topology, chip.chip_config, chips_per_host)
    compiled = jax_internals.compile_only(
        lower_random_for_tpu(hlo_module), devices[:replicas], compiler_flags
    )
    slice_name = f", one of {replicas} chips" if replicas > 1 else ""
    label = f"TPU {chip.name}{slice_name} (libtpu {jax_internals.versions()['libtpu']})"
    plan = memory_from_hlo_proto(hlo_pb2.HloProto.FromString(compiled.hlo_proto), label)
    outputs = compiled.output_bytes - compiled.alias_bytes
    total = compiled.argument_bytes + outputs + compiled.temp_bytes
    return dataclasses.replace(
        plan,
        total_bytes=total,
        # A TPU program's temporaries are one block, allocated for the whole execution, and
        # its code sits in HBM beside them.
        peak_bytes=total + compiled.generated_code_bytes,
        parameter_bytes=compiled.argument_bytes,
        output_bytes=outputs,
        temp_bytes=compiled.temp_bytes,
        generated_code_bytes=compiled.generated_code_bytes,
        capacity_bytes=chip.hbm_bytes,
        flops=compiled.flops,
    )
