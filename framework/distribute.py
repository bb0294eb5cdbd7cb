"""One factory for the `tf.distribute` strategy a run uses, chosen by name.

`one_device` runs on the first GPU/TPU core or the CPU; `mirrored` replicates over all local GPUs,
or, on a machine without accelerators, over `cpu_devices` logical CPU devices, so data parallelism
runs and is tested on a laptop exactly as it runs on an 8-GPU host.
"""

from __future__ import annotations

import logging

import tensorflow as tf

STRATEGIES = ("one_device", "mirrored")


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


def create_strategy(
    name: str = "one_device", cpu_devices: int | None = None
) -> tf.distribute.Strategy:
    """Returns the strategy `name` (one of STRATEGIES), logging its devices and replica count."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    accelerators = tf.config.list_physical_devices("GPU")
    if cpu_devices is not None and cpu_devices < 1:
        raise ValueError(f"cpu_devices must be at least 1, got {cpu_devices}")
    if name == "one_device":
        device = "/gpu:0" if accelerators else "/cpu:0"
        strategy = tf.distribute.OneDeviceStrategy(device)
    elif accelerators:
        strategy = tf.distribute.MirroredStrategy()
    else:
        devices = split_cpu(cpu_devices or 1)
        strategy = tf.distribute.MirroredStrategy(devices)
    logging.info(
        "strategy %s with %d replica(s): %s",
        name,
        strategy.num_replicas_in_sync,
        ", ".join(strategy.extended.worker_devices),
    )
    return strategy
