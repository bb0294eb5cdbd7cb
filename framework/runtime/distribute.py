"""One factory for the `tf.distribute` strategy a run uses, chosen by name.

- `one_device`: the first GPU, or the CPU.
- `mirrored`: all local GPUs; on a machine without accelerators, `cpu_devices` logical CPU devices,
  so data parallelism runs and is tested on a laptop exactly as on an 8-GPU host.
- `multi_worker_mirrored`: several hosts (or local processes) described by `TF_CONFIG`, with ring
  or NCCL collectives.
- `tpu`: a Cloud TPU, by name, `local` (a TPU VM) or a `grpc://host:port` address.
"""

from __future__ import annotations

import functools
import logging
import socket
import urllib.parse

import numpy as np
import tensorflow as tf

STRATEGIES = ("one_device", "mirrored", "multi_worker_mirrored", "tpu")
COLLECTIVES = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}
CLOUD_TPU_CLIENT_HELP = (
    "the legacy TPU-node path needs cloud-tpu-client, which cannot be installed with its declared "
    "dependencies without breaking TensorFlow; run `bash launch/install_cloud_tpu_client.sh`"
)


def split_cpu(num_devices: int) -> list[str]:
    """Splits the CPU into `num_devices` logical devices (before TensorFlow uses a device)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration()] * num_devices
    current = tf.config.get_logical_device_configuration(cpu)
    if current is None or len(current) != num_devices:
        try:
            tf.config.set_logical_device_configuration(cpu, wanted)
        except RuntimeError as error:
            raise RuntimeError(
                f"cannot split the CPU into {num_devices} devices: TensorFlow has already "
                "initialised its devices in this process. Create the strategy before running ops."
            ) from error
    return [device.name for device in tf.config.list_logical_devices("CPU")]


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fails fast, with a clear message, when nothing listens at a `grpc://host:port` address.

    Connecting to an unreachable TPU otherwise blocks for minutes inside TensorFlow.
    """
    parsed = urllib.parse.urlparse(address)
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=timeout).close()
    except OSError as error:
        raise ConnectionError(
            f"no TPU answers at {address} ({error.strerror or error}). Check the TPU's name or "
            "address, that it is READY (`gcloud compute tpus list`), and the firewall."
        ) from None


def configure_tpu_node(tpu: str, zone: str | None = None, project: str | None = None) -> None:
    """Legacy TPU nodes: sets the TPU runtime to this TensorFlow version and waits until healthy.

    TPU VMs do not need this; TPU nodes (a separate TPU host reached over gRPC) must run the same
    TensorFlow version as the client.
    """
    try:
        from cloud_tpu_client import Client
    except ImportError:
        raise ImportError(CLOUD_TPU_CLIENT_HELP) from None
    client = Client(tpu=tpu, zone=zone, project=project)
    client.configure_tpu_version(tf.__version__, restart_type="ifNeeded")
    client.wait_for_healthy()


def tpu_resolver(
    tpu: str, zone: str | None = None, project: str | None = None
) -> tf.distribute.cluster_resolver.TPUClusterResolver:
    """The resolver for a TPU name, `local` (TPU VM) or a `grpc://` address (checked first)."""
    if not tpu:
        raise ValueError("the tpu strategy needs a TPU: a name, 'local' or 'grpc://host:port'")
    if tpu.startswith("grpc://"):
        check_reachable(tpu)
    return tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu, zone=zone, project=project)


def _tpu_strategy(
    tpu: str, zone: str | None, project: str | None, tpu_node: bool
) -> tf.distribute.TPUStrategy:
    if tpu_node:
        configure_tpu_node(tpu, zone, project)
    resolver = tpu_resolver(tpu, zone, project)
    if tpu != "local":
        tf.config.experimental_connect_to_cluster(resolver)
    try:
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except tf.errors.NotFoundError:
        raise RuntimeError(
            f"no TPU found for tpu={tpu!r}: 'local' needs a TPU VM, a name or address needs a "
            "READY TPU. On a machine without TPUs use strategy 'one_device' or 'mirrored'."
        ) from None
    return tf.distribute.TPUStrategy(resolver)


@functools.cache
def _mirrored(devices: tuple[str, ...] | None) -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy per set of devices in a process: each numbers its collectives from
    the same keys, so two of them over the same devices mix up each other's collectives (a
    shape mismatch in a collective the second run did not make)."""
    return tf.distribute.MirroredStrategy(None if devices is None else list(devices))


@functools.cache
def _multi_worker(collectives: str) -> tf.distribute.MultiWorkerMirroredStrategy:
    """One MultiWorkerMirroredStrategy per process: it configures the process's collectives
    once, with keys of its own (see `_mirrored`)."""
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=COLLECTIVES[collectives]
    )
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def create_strategy(
    name: str = "one_device",
    cpu_devices: int | None = None,
    collectives: str = "auto",
    tpu: str | None = None,
    tpu_zone: str | None = None,
    tpu_project: str | None = None,
    tpu_node: bool = False,
) -> tf.distribute.Strategy:
    """Returns the strategy `name` (one of STRATEGIES), logging its devices and replica count.

    `cpu_devices` splits a CPU-only machine for `mirrored`; `collectives` (auto, ring, nccl)
    chooses the all-reduce of `multi_worker_mirrored`; `tpu`, `tpu_zone`, `tpu_project` and
    `tpu_node` (legacy TPU node, not a TPU VM) locate the TPU for `tpu`.
    """
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    if collectives not in COLLECTIVES:
        raise ValueError(f"unknown collectives {collectives!r}; choose one of {list(COLLECTIVES)}")
    if cpu_devices is not None and cpu_devices < 1:
        raise ValueError(f"cpu_devices must be at least 1, got {cpu_devices}")
    accelerators = tf.config.list_physical_devices("GPU")
    if name == "one_device":
        strategy = tf.distribute.OneDeviceStrategy("/gpu:0" if accelerators else "/cpu:0")
    elif name == "mirrored":
        devices = None if accelerators else split_cpu(cpu_devices or 1)
        strategy = _mirrored(None if devices is None else tuple(devices))
    elif name == "multi_worker_mirrored":
        strategy = _multi_worker(collectives)
    else:
        strategy = _tpu_strategy(tpu or "", tpu_zone, tpu_project, tpu_node)
    logging.info(
        "strategy %s with %d replica(s): %s",
        name,
        strategy.num_replicas_in_sync,
        ", ".join(strategy.extended.worker_devices),
    )
    return strategy


def device_type(strategy: tf.distribute.Strategy) -> str:
    """The kind of device the strategy's replicas run on: "CPU", "GPU" or "TPU"."""
    return tf.DeviceSpec.from_string(strategy.extended.worker_devices[0]).device_type


def first_device(strategy: tf.distribute.Strategy) -> str:
    """The first replica's device as memory statistics name it, e.g. "CPU:0" or "TPU:0"."""
    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return f"{spec.device_type}:{spec.device_index}"


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process writes checkpoints, summaries and the run record (one per cluster)."""
    return strategy.extended.should_checkpoint


def worker_count(strategy: tf.distribute.Strategy) -> int:
    """The tasks of the run's cluster (workers, or a TPU pod's hosts); 1 without a cluster."""
    resolver = strategy.cluster_resolver
    return sum(map(len, resolver.cluster_spec().as_dict().values())) if resolver else 1


def pipelines_run_here(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process runs the run's input pipelines itself: all but a TPU pod's client,
    which builds one pipeline per host and has each run on its host."""
    is_pod = isinstance(strategy, tf.distribute.TPUStrategy) and strategy.extended.num_hosts > 1
    return not is_pod


def gather_workers(strategy: tf.distribute.Strategy, value: np.ndarray) -> np.ndarray:
    """[workers, ...]: each worker's `value` (all the same shape), on every worker; collective,
    so every worker calls it at the same point. Replicas are numbered worker by worker."""
    gathered = strategy.gather(
        strategy.experimental_distribute_values_from_function(lambda _: tf.constant(value[None])),
        axis=0,
    ).numpy()
    return gathered[:: len(gathered) // worker_count(strategy)]
