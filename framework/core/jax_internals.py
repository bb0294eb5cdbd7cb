"""Every private jax, jaxlib, libtpu and jax CUDA plugin API the framework relies on, in one place.

libtpu carries the TPU compiler, and jax's CUDA plugin XLA's GPU compiler; each has a
compile-only client that compiles a program for a device this host does not have (the way
MaxText's `train_compile.py` plans a v5e-256 job on a CPU VM). jax is the only public door to
those clients, and the door is private: a topology description, jaxlib's MLIR bindings and jax's
compile options. Each wrapper here is small, so a jax release that moves one of them breaks one
function, and `SUPPORTED_JAX` says which releases were checked.

The packages are the `tpu` extra (`pip install -e ".[tpu]"`) and the `gpu` extra (`".[gpu]"`);
importing this module without jax, or asking for a TPU without libtpu or for a GPU without the
CUDA plugin, raises `MissingDependency` with the command; other releases warn
(`UnsupportedJaxWarning`) but go on, as `tf_internals` does for TensorFlow. jax itself only
compiles here and runs on the host's CPU (`run_on_cpu_replicas`): it never claims an accelerator
the TensorFlow run holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

from framework.core.errors import MissingDependency

# The jax/jaxlib release the compile-only paths were tested with, the libtpu release its `tpu`
# extra pins (jax 0.10.2 -> libtpu 0.0.42.*), and the CUDA plugin's (released with jax, the same
# version). Keep in step with setup.py's `tpu` and `gpu` extras.
SUPPORTED_JAX = ("0.10.2",)
SUPPORTED_LIBTPU = ("0.0.42",)

INSTALL_HINT = 'pip install -e ".[tpu]"'
GPU_INSTALL_HINT = 'pip install -e ".[gpu]"'

try:
    import jax
    import jaxlib
    from jax._src import compiler as _compiler
    from jax._src import config as _config
    from jax._src.interpreters import mlir as _jax_mlir
    from jax._src.lib.mlir import ir as _ir
    from jax.experimental import topologies as _topologies
    from jaxlib import _jax
except ImportError as error:  # the extra is not installed
    raise MissingDependency(
        f"planning for a TPU chip or a GPU needs jax ({error.name} is missing): {INSTALL_HINT} "
        f"(a TPU) or {GPU_INSTALL_HINT} (a GPU)"
    ) from None

# jax compiles for the named devices and runs on the CPU only: started on a GPU host, it would
# otherwise initialise the GPU beside TensorFlow (and reserve most of its memory), and its CUDA
# plugin, started on a host without one, leaves no compile-only CUDA devices.
jax.config.update("jax_platforms", "cpu")

# What libtpu prints to stderr when it starts on a host that is not a TPU VM (it cannot find the
# accelerator type and the worker hostnames in the VM's metadata), and the CUDA plugin on a host
# without a GPU driver. The compile-only clients need neither. Any other line is passed through.
_START_UP_NOISE = re.compile(
    r"TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|Logging before InitGoogle|"
    r"Source Location Trace|libtpu_init_utils|Failed to find host bounds|failed call to cuInit"
)


def versions() -> dict[str, str]:
    """The installed jax, jaxlib, libtpu and jax CUDA plugin releases ("missing" if not)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "missing"

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "libtpu": version("libtpu"),
        "jax-cuda12-plugin": version("jax-cuda12-plugin"),
    }


def unsupported_versions_message(platform: str = "tpu") -> str | None:
    """What to tell a user whose jax, and libtpu ("tpu") or CUDA plugin ("gpu"), are not the
    tested releases, or None."""
    found = versions()
    if platform == "tpu":
        compiler, tested, hint = "libtpu", SUPPORTED_LIBTPU, INSTALL_HINT
    else:
        compiler, tested, hint = "jax-cuda12-plugin", SUPPORTED_JAX, GPU_INSTALL_HINT
    if found["jax"] in SUPPORTED_JAX and found["jaxlib"] in SUPPORTED_JAX:
        if found[compiler].startswith(tested):  # libtpu: any build of the release
            return None
    return (
        f"jax {found['jax']}, jaxlib {found['jaxlib']} and {compiler} {found[compiler]} are "
        f"installed; the {platform.upper()} compile-only path was tested with jax and jaxlib "
        f"{'/'.join(SUPPORTED_JAX)} and {compiler} {'/'.join(tested)}: {hint}"
    )


class UnsupportedJaxWarning(UserWarning):
    """The installed jax, jaxlib, libtpu or CUDA plugin is not the tested release."""


@functools.cache
def require_compiler(platform: str) -> None:
    """Raises `MissingDependency` when the compiler of `platform` ("tpu" or "gpu") is not
    installed; warns once when it is not the tested release."""
    package = {"tpu": "libtpu", "gpu": "jax-cuda12-plugin"}[platform]
    if versions()[package] == "missing":
        hint = INSTALL_HINT if platform == "tpu" else GPU_INSTALL_HINT
        device = "a TPU chip" if platform == "tpu" else "a GPU"
        raise MissingDependency(f"planning for {device} needs {package}: {hint}")
    if (message := unsupported_versions_message(platform)) is not None:
        warnings.warn(message, UnsupportedJaxWarning, stacklevel=3)


@contextlib.contextmanager
def _quiet_start_up() -> Iterator[None]:
    """Holds back the compilers' start-up warnings (written by C++ straight to file
    descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if line.strip() and not _START_UP_NOISE.search(line):
                    sys.stderr.write(line)


@functools.cache
def tpu_topology_devices(
    topology: str, chip_config: str, chips_per_host: tuple[int, ...] | None = None
):
    """The devices of a compile-only TPU topology, e.g. ("v5e:2x4", "default") for a v5e-8
    slice or ("v4:2x2x1", "megacore"); a "megacore" device is one chip's two TensorCores as
    one. `chips_per_host` bounds one host's chips (the whole topology by default: one host)."""
    require_compiler("tpu")
    chips = tuple(int(n) for n in topology.split(":")[1].split("x"))
    # libtpu takes a host-wide lock file when it starts, so that two processes do not drive one
    # TPU. A compile-only client drives none, and the planner's compile workers each start one.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with _quiet_start_up():
        description = _topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology,
            chip_config_name=chip_config,
            chips_per_host_bounds=chips_per_host or (*chips, 1)[:3],
            num_slices=1,
            wrap=(False, False, False),
        )
    return tuple(description.devices)


def tpu_device(topology: str, chip_config: str):
    """The first device of a compile-only TPU topology (see `tpu_topology_devices`)."""
    return tpu_topology_devices(topology, chip_config)[0]


def _stablehlo(hlo_module: bytes) -> _ir.Module:
    """A serialized HloModuleProto as a StableHLO module the TPU client accepts.

    TensorFlow copies each returned value (`mhlo.copy`), which the TPU legalizer rejects; a copy
    changes nothing a compiler can observe, so each is replaced by its operand.
    """
    module = _ir.Module.parse(_jax.mlir.hlo_to_stablehlo(hlo_module))
    copies = []

    def find_copies(operation) -> None:
        for region in operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "mhlo.copy":
                        copies.append(inner)
                    find_copies(inner.operation)

    find_copies(module.operation)
    for copy in copies:
        copy.result.replace_all_uses_with(copy.operands[0])
        copy.erase()
    return module


@functools.cache
def cuda_device(target_config: str):
    """A compile-only CUDA device for the GPU a `GpuTargetConfigProto` in text form describes
    (the card's SMs, memory, clocks, compute capability: `memory.gpu.target_config`)."""
    require_compiler("gpu")
    with _quiet_start_up():
        description = _topologies.get_topology_desc(
            platform="cuda", target_config=target_config, topology="1x1x1"
        )
    return description.devices[0]


@dataclasses.dataclass(frozen=True)
class Compilation:
    """What a compile-only client's compiler reports for one program.

    Attributes:
      hlo_proto: the optimised program with its buffer assignment, a serialized `HloProto`.
      argument_bytes / output_bytes / alias_bytes / temp_bytes / generated_code_bytes: the
        compiler's memory statistics, in device memory (outputs that alias an argument count
        in both).
      flops: the compiler's cost analysis of the optimised program; None where the client has
        none (the GPU's).
    """

    hlo_proto: bytes
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    flops: float | None


# Compile options the compiler reads from the executable's build options rather than from its
# flags: jax takes them out of the overrides by name, and wants them in these types.
_BUILD_OPTIONS = {
    "exec_time_optimization_effort": float,
    "memory_fitting_effort": float,
    "optimization_level": lambda value: _config.EffortLevel(value).value,
    "memory_fitting_level": lambda value: _config.EffortLevel(value).value,
}


def compile_only(
    hlo_module: bytes, device, compiler_flags: dict[str, str | bool] | None = None
) -> Compilation:
    """Compiles a serialized HloModuleProto for a compile-only `device` (`tpu_device`,
    `cuda_device`), or for a tuple of devices as one replica each (a program with collectives
    among them), running nothing.

    `compiler_flags` are the compiler's flags for this compilation only, e.g.
    {"xla_tpu_max_hbm_size_mib": "8192"}, {"xla_gpu_enable_triton_gemm": False} (no leading
    dashes; booleans as Python's), or XLA's build options by name
    ({"exec_time_optimization_effort": "-1"}, {"optimization_level": "O1"}). The buffer
    assignment comes from a dump of the optimised module into a temporary directory, the one
    place the clients write it (the GPU compiler dumps its autotuning candidates beside it, as
    later modules). The statistics are one replica's (each runs the same program).
    """
    devices = tuple(device) if isinstance(device, (tuple, list)) else (device,)
    overrides = {
        name: value if isinstance(value, bool) else _BUILD_OPTIONS.get(name, str)(value)
        for name, value in (compiler_flags or {}).items()
    }
    options = _compiler.get_compile_options(
        len(devices), 1, device_assignment=list(devices), env_options_overrides=overrides
    )
    with _jax_mlir.make_ir_context(), tempfile.TemporaryDirectory() as dump:
        debug = options.executable_build_options.debug_options
        debug.xla_dump_to = dump
        debug.xla_dump_hlo_as_proto = True
        debug.xla_dump_hlo_as_text = False
        executable = devices[0].client.compile(
            _stablehlo(hlo_module),
            executable_devices=_jax.DeviceList(devices),
            compile_options=options,
        )
        # The program is the first module compiled: "module_0001.<name>...".
        optimised = min(glob.glob(os.path.join(dump, "*after_optimizations.hlo.pb")))
        with open(optimised, "rb") as proto:
            hlo_proto = proto.read()
    stats = executable.get_compiled_memory_stats()
    try:
        flops = float(executable.cost_analysis().get("flops", 0.0))
    except _jax.JaxRuntimeError:  # UNIMPLEMENTED on the GPU's compile-only client
        flops = None
    return Compilation(
        hlo_proto=hlo_proto,
        argument_bytes=stats.argument_size_in_bytes,
        output_bytes=stats.output_size_in_bytes,
        alias_bytes=stats.alias_size_in_bytes,
        temp_bytes=stats.temp_size_in_bytes,
        generated_code_bytes=stats.generated_code_size_in_bytes,
        flops=flops,
    )


def run_on_cpu_replicas(hlo_module: bytes, arguments: list[list]) -> list[list]:
    """Runs a serialized HloModuleProto as one replica per entry of `arguments` on this host's
    CPU (XLA:CPU runs collectives among replicas of one process), and returns each replica's
    outputs as NumPy arrays. `arguments[r]` are replica r's parameters, in order.

    TensorFlow's own XLA:CPU runs no program with collectives among replicas; this is how a
    multi-chip program's collectives are checked on a host without accelerators. Needs as many
    CPU devices as replicas: `cpu_devices(n)` before jax starts its CPU backend.
    """
    import numpy as np

    devices = _jax_cpu_devices()[: len(arguments)]
    if len(devices) < len(arguments):
        raise ValueError(
            f"{len(arguments)} replicas need as many CPU devices; jax has {len(devices)}: "
            "call cpu_devices(n) before jax starts"
        )
    options = _compiler.get_compile_options(len(devices), 1, device_assignment=list(devices))
    with _jax_mlir.make_ir_context():
        executable = devices[0].client.compile_and_load(
            _stablehlo(hlo_module),
            executable_devices=_jax.DeviceList(tuple(devices)),
            compile_options=options,
        )

    # One array per parameter, its replicas' values one per device (as pmap passes them).
    # TensorFlow's programs take 64-bit values (random seeds), which jax narrows unless told.
    jax.config.update("jax_enable_x64", True)
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    every_device = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def per_parameter(values: list) -> jax.Array:
        """One buffer per device, each replica's own: an array laid out as if replicated, as
        a program of replicas (not of partitions) takes its parameters."""
        arrays = [jax.device_put(np.asarray(v), d) for v, d in zip(values, devices)]
        return jax.make_array_from_single_device_arrays(arrays[0].shape, every_device, arrays)

    parameters = [
        per_parameter([replica[i] for replica in arguments]) for i in range(len(arguments[0]))
    ]
    results = executable.execute_sharded(parameters).disassemble_into_single_device_arrays()
    return [[np.asarray(result[r]) for result in results] for r in range(len(devices))]


def cpu_devices(count: int) -> None:
    """Makes jax's CPU backend start with `count` devices (before it starts; once per process)."""
    jax.config.update("jax_num_cpu_devices", count)


def _jax_cpu_devices() -> list:
    return jax.devices("cpu")
