"""Reading XLA's memory plan of a compiled program: its buffer assignment, as every compiler's
plan is read (`compiled.compiled_bytes` for this host's XLA, `tpu.py` and `gpu.py` for the
compilers of devices named).

`memory_from_hlo_proto` reads an `HloProto` that carries the assignment; `parse_buffer_assignment`
reads the same figures from a `*buffer-assignment.txt` file that `XLA_FLAGS=--xla_dump_to=DIR`
writes, e.g. from a run on a TPU host.
"""

import collections
import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

from framework.core.tf_internals import hlo_pb2, xla_data_pb2
from framework.memory.units import format_bytes


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer live at the peak.

    Attributes:
      instruction: the HLO instruction that defines it, e.g. "MatMul_3.2" or "fusion.12".
      op_name: the TensorFlow op it comes from (HLO metadata), e.g. "dense_1/MatMul" or
        "XLA_Args" for parameters; empty when XLA created the instruction itself.
      shape: e.g. "f32[1024,256]".
      size_bytes: its size.
      kind: "parameter", "output" or "temp".
    """

    instruction: str
    op_name: str
    shape: str
    size_bytes: int
    kind: str


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """What XLA planned for one compiled program.

    Attributes:
      module: the HLO module's name.
      total_bytes: XLA's "Total bytes used": all allocations (parameters, outputs, temps).
      parameter_bytes: the program's inputs, variables included; live before the step runs.
      output_bytes: outputs that are not parameters (aliased updates count as parameters).
      temp_bytes: the scratch the step needs on top: activations, gradients, workspaces.
      peak_bytes: bytes live at the program's peak (see `memory_from_hlo_proto` and
        `parse_buffer_assignment` for how each counts it).
      peak_buffers: the buffers live at the peak, largest first.
      compiler: who planned it, e.g. "XLA:CPU" or "TPU v5e (libtpu 0.0.42.1)".
      on_chip_bytes: buffers the compiler placed outside the device's main memory (a TPU's
        VMEM and SMEM, on-chip scratch); not part of the totals above, which count main memory
        (HBM on a TPU) only.
      generated_code_bytes: the compiled program's code, also in device memory on a TPU.
      capacity_bytes: the target's memory (a TPU chip's HBM), when compiled for a named chip.
      flops: the compiler's own FLOP count of the optimised program, when it reports one.
    """

    module: str
    total_bytes: int
    parameter_bytes: int
    output_bytes: int
    temp_bytes: int
    peak_bytes: int
    peak_buffers: tuple[Buffer, ...]
    compiler: str = "XLA"
    on_chip_bytes: int = 0
    generated_code_bytes: int = 0
    capacity_bytes: int | None = None
    flops: float | None = None

    def summary(self, top: int = 10) -> str:
        """A few lines for logs: the totals and the `top` largest buffers at the peak."""
        lines = [
            f"{self.compiler} buffer assignment of {self.module}:",
            (
                f"  total {format_bytes(self.total_bytes)} = parameters "
                f"{format_bytes(self.parameter_bytes)} + outputs "
                f"{format_bytes(self.output_bytes)} + temps {format_bytes(self.temp_bytes)}"
            ),
            f"  live at peak {format_bytes(self.peak_bytes)}{self._capacity()}, largest buffers:",
        ]
        for buf in self.peak_buffers[:top]:
            lines.append(
                f"    {format_bytes(buf.size_bytes):>11}  {buf.kind:<9} {buf.shape:<24} "
                f"{buf.instruction}  ({buf.op_name or 'XLA'})"
            )
        return "\n".join(lines)

    def _capacity(self) -> str:
        return f" of {format_bytes(self.capacity_bytes)}" if self.capacity_bytes else ""


def _sorted(buffers: Iterable[Buffer]) -> tuple[Buffer, ...]:
    return tuple(sorted(buffers, key=lambda b: (-b.size_bytes, b.instruction)))


def _compiled_memory(
    module: str, totals: collections.Counter, peak_buffers: list[Buffer], **details: Any
) -> CompiledMemory:
    return CompiledMemory(
        module=module,
        total_bytes=totals["parameter"] + totals["output"] + totals["temp"],
        parameter_bytes=totals["parameter"],
        output_bytes=totals["output"],
        temp_bytes=totals["temp"],
        peak_bytes=sum(b.size_bytes for b in peak_buffers),
        peak_buffers=_sorted(peak_buffers),
        **details,
    )


# XLA's memory space of the device's main memory (HBM on a TPU or GPU); a TPU compiler colours
# its on-chip memories (VMEM, SMEM) with other numbers.
_MAIN_MEMORY = 0


def _allocation_kind(is_parameter: bool, is_output: bool) -> str:
    if is_parameter:
        return "parameter"
    return "output" if is_output else "temp"


def _shape_text(shape: xla_data_pb2.ShapeProto) -> str:
    if shape.element_type == xla_data_pb2.TUPLE:
        return "(" + ", ".join(_shape_text(s) for s in shape.tuple_shapes) + ")"
    element = xla_data_pb2.PrimitiveType.Name(shape.element_type).lower()
    return f"{element}[{','.join(str(d) for d in shape.dimensions)}]"


def _shape_bytes(shape: xla_data_pb2.ShapeProto) -> int | None:
    """Dense array size in bytes, or None for tuples and types whose size is not a byte count."""
    element = xla_data_pb2.PrimitiveType.Name(shape.element_type).lower()
    match = re.fullmatch(r"[a-z]+?(\d+)(?:e\d+m\d+\w*)?", element)
    if shape.element_type == xla_data_pb2.TUPLE or match is None or int(match[1]) % 8:
        return None
    return math.prod(shape.dimensions) * int(match[1]) // 8


def _subshape(shape: xla_data_pb2.ShapeProto, index: Iterable[int]) -> xla_data_pb2.ShapeProto:
    for i in index:
        shape = shape.tuple_shapes[i]
    return shape


def _heap_peak(trace: hlo_pb2.HeapSimulatorTrace, sizes: dict[int, int]) -> dict[int, str]:
    """Replays one heap-simulator trace; returns the buffers live at its peak, id -> instruction.

    A buffer that shares memory with another (SHARE_WITH) adds no bytes.
    """
    live: dict[int, int] = {}
    names: dict[int, str] = {}
    current = peak = 0
    at_peak: dict[int, str] = {}
    for event in trace.events:
        if event.kind == hlo_pb2.HeapSimulatorTrace.Event.FREE:
            current -= live.pop(event.buffer_id, 0)
            continue
        shared = event.kind == hlo_pb2.HeapSimulatorTrace.Event.SHARE_WITH
        live[event.buffer_id] = 0 if shared else sizes[event.buffer_id]
        names[event.buffer_id] = event.instruction_name
        current += live[event.buffer_id]
        if current > peak:
            peak = current
            at_peak = {i: names[i] for i, size in live.items() if size}
    return at_peak


def memory_from_hlo_proto(proto: hlo_pb2.HloProto, compiler: str = "XLA") -> CompiledMemory:
    """Reads a `CompiledMemory` from an `HloProto` that carries its buffer assignment.

    The peak is the parameters and outputs (live for the whole program) plus, for each heap that
    XLA simulated to pack the temps, the temps live at that heap's peak. Only the device's main
    memory counts (memory space, or "color", 0); what a TPU compiler puts in on-chip memory is
    `on_chip_bytes`. `compiler` labels the result.

    Buffers are matched to instructions by name: the heap traces name the temps, parameter
    numbers name the parameters. Instruction ids are not used for them, because with
    `--xla_dump_to` set the module in the proto is numbered differently from its assignment.
    """
    assignment = proto.buffer_assignment
    if not assignment.buffer_allocations:
        raise ValueError("The HloProto carries no buffer assignment.")
    module = proto.hlo_module
    by_name = {inst.name: inst for comp in module.computations for inst in comp.instructions}
    by_id = {inst.id: inst for inst in by_name.values()}
    entry = next(c for c in module.computations if c.id == module.entry_computation_id)
    parameters = {i.parameter_number: i for i in entry.instructions if i.opcode == "parameter"}
    root = next(i for i in entry.instructions if i.id == entry.root_id)
    logical = {buf.id: buf for buf in assignment.logical_buffers}

    def describe(name: str, index: Iterable[int], size: int, kind: str) -> Buffer:
        inst = by_name.get(name)
        if inst is None:
            return Buffer(name, "", "", size, kind)
        shape = _shape_text(_subshape(inst.shape, index))
        return Buffer(name, inst.metadata.op_name, shape, size, kind)

    def describe_output(alloc: hlo_pb2.BufferAllocationProto) -> Buffer:
        # Of the values an output allocation holds in turn, the last defined is the one live at
        # the end. Its id is trusted only when it names an instruction of the right size.
        last = logical[max(a.logical_buffer_id for a in alloc.assigned)]
        inst = by_id.get(last.defined_at.instruction_id)
        index = last.defined_at.shape_index
        if inst is not None and _shape_bytes(_subshape(inst.shape, index)) in (alloc.size, None):
            return describe(inst.name, index, alloc.size, "output")
        return describe(root.name, (), alloc.size, "output")

    totals = collections.Counter()
    peak_buffers = []
    for alloc in assignment.buffer_allocations:
        if alloc.color != _MAIN_MEMORY:
            totals["on chip"] += alloc.size
            continue
        kind = _allocation_kind(alloc.is_entry_computation_parameter, alloc.maybe_live_out)
        totals[kind] += alloc.size
        if kind == "parameter":
            param = parameters[alloc.parameter_number]
            index = alloc.parameter_shape_index
            peak_buffers.append(describe(param.name, index, alloc.size, kind))
        elif kind == "output":
            peak_buffers.append(describe_output(alloc))
    sizes = {i: buf.size for i, buf in logical.items()}
    for trace in assignment.heap_simulator_traces:
        # XLA simulates one heap per memory space; the first buffer tells which.
        if not trace.events or logical[trace.events[0].buffer_id].color != _MAIN_MEMORY:
            continue
        for buffer_id, name in _heap_peak(trace, sizes).items():
            index = logical[buffer_id].defined_at.shape_index
            peak_buffers.append(describe(name, index, sizes[buffer_id], "temp"))
    return _compiled_memory(
        module.name, totals, peak_buffers, compiler=compiler, on_chip_bytes=totals["on chip"]
    )


_ALLOCATION_RE = re.compile(r"^allocation \d+: size (?P<size>\d+), (?P<rest>.*)$")
_VALUE_RE = re.compile(
    r"^ value: <\d+ (?P<name>[^\s{>]+)(?P<index>\{[\d,]*\})? [^>]*> \(size=\d+,offset=\d+\): "
    r"(?P<shape>.+)$"
)
_USED_VALUE_RE = re.compile(r"^<\d+ (?P<name>[^\s{>]+)")
_FROM_RE = re.compile(r"^ from instruction: %(?P<name>\S+) = .*?op_name=\"(?P<op_name>[^\"]*)\"")
_LIVE_RE = re.compile(r"^\s+(?P<name>[^\s{]+)(?P<index>\{[\d,]*\}): (?P<size>\d+) bytes")
_LAYOUT_RE = re.compile(r"\{[\d,]*\}")


def parse_buffer_assignment(text: str, module: str = "") -> CompiledMemory:
    """Reads a `CompiledMemory` from the text of an XLA `*buffer-assignment.txt` dump.

    The text does not name its module; pass `module` (e.g. from the file name) to label it.

    The peak is XLA's own "Live ranges at N (peak)" section (every value live at that point of
    the schedule, parameters included, memory shared between values counted once per value), so
    it can differ slightly from `compiled_bytes`' peak for the same program; the totals agree.

    Raises:
      ValueError: when the text is not a buffer assignment.
    """
    lines = text.splitlines()
    if not lines or lines[0].strip() != "BufferAssignment:":
        raise ValueError("Not an XLA buffer assignment: it must start with 'BufferAssignment:'.")
    totals = collections.Counter()
    kinds: dict[tuple[str, str], str] = {}
    shapes: dict[tuple[str, str], str] = {}
    op_names: dict[str, str] = {}
    peak_buffers: list[Buffer] = []
    kind = "temp"
    section = "allocations"
    for line in lines[1:]:
        if line.startswith("Used values:"):
            section = "values"
        elif line.startswith("HloLiveRange"):
            section = "live ranges"
        elif section == "allocations" and (match := _ALLOCATION_RE.match(line)):
            rest = match["rest"]
            kind = _allocation_kind(rest.startswith("parameter "), "maybe-live-out" in rest)
            totals[kind] += int(match["size"])
        elif section == "allocations" and (match := _VALUE_RE.match(line)):
            key = (match["name"], match["index"] or "{}")
            kinds[key] = kind
            shapes[key] = _LAYOUT_RE.sub("", match["shape"])
        elif section == "values" and (match := _FROM_RE.match(line)):
            op_names[match["name"]] = match["op_name"]
        elif section == "live ranges" and "(peak):" in line:
            section = "peak"
        elif section == "peak" and (match := _LIVE_RE.match(line)):
            key = (match["name"], match["index"])
            peak_buffers.append(
                Buffer(
                    match["name"],
                    op_names.get(match["name"], ""),
                    shapes.get(key, ""),
                    int(match["size"]),
                    kinds.get(key, "temp"),
                )
            )
        elif section == "peak":
            section = "done"
    if not totals:
        raise ValueError("The buffer assignment lists no allocations.")
    return _compiled_memory(module, totals, peak_buffers)
