"""Strategies: `mirrored` over logical CPU devices must train exactly like `one_device`."""

import importlib.util
import socket

import pytest

from framework.runtime import distribute
from tests.subprocesses import run_python

pytestmark = pytest.mark.slow  # subprocesses: the full tier only

EQUALITY_SCRIPT = """
    import json, tempfile
    from framework.runtime import distribute
    from framework.runtime import Runtime
    from framework.trainer import Trainer
    from tests import tiny

    distribute.split_cpu({devices})  # before TensorFlow initialises its devices
    losses = {{}}
    for strategy in ("one_device", "mirrored"):
        runtime = Runtime(strategy, cpu_devices={devices})
        trainer = Trainer(tempfile.mkdtemp(), runtime=runtime,
                          train_steps=4, remat_policy="nothing_saveable", **tiny.TRAINER_ARGS)
        trainer.train()
        losses[strategy] = float(trainer.evaluate()["loss"])
        losses[strategy + "_replicas"] = trainer.strategy.num_replicas_in_sync
    print(json.dumps(losses))
"""


@pytest.mark.tf_compat
def test_mirrored_reaches_the_same_loss_as_one_device():
    devices = 2  # 4 logical devices took 50 s more of a 2-core CI and tested nothing new
    losses = run_python(EQUALITY_SCRIPT.format(devices=devices))
    assert losses["mirrored_replicas"] == devices and losses["one_device_replicas"] == 1
    relative = abs(losses["mirrored"] - losses["one_device"]) / losses["one_device"]
    assert relative < 1e-4, losses


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ValueError, match="one_device, mirrored, multi_worker_mirrored, tpu"):
        distribute.create_strategy("tpu_v9")


def test_unreachable_tpu_address_fails_fast_and_clearly():
    port = free_port()
    with pytest.raises(ConnectionError, match=f"no TPU answers at grpc://127.0.0.1:{port}"):
        distribute.create_strategy("tpu", tpu=f"grpc://127.0.0.1:{port}")


def test_tpu_resolver_takes_the_address_it_is_given():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"grpc://127.0.0.1:{server.getsockname()[1]}"
        resolver = distribute.tpu_resolver(address)
    assert resolver.master() == address
    assert resolver.cluster_spec().as_dict() == {"worker": [address.removeprefix("grpc://")]}


def test_no_tpu_on_this_machine_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no TPU found for tpu='local'"):
        distribute.create_strategy("tpu", tpu="local")


def test_legacy_tpu_node_without_cloud_tpu_client_says_how_to_install_it():
    if importlib.util.find_spec("cloud_tpu_client") is not None:
        pytest.skip("cloud-tpu-client is installed here")
    with pytest.raises(ImportError, match="launch/install_cloud_tpu_client.sh"):
        distribute.create_strategy("tpu", tpu="my-tpu", tpu_node=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "tpu"}, "needs a TPU"),
        ({"name": "multi_worker_mirrored", "collectives": "carrier_pigeon"}, "unknown collectives"),
        ({"name": "mirrored", "cpu_devices": 0}, "at least 1"),
    ],
)
def test_bad_strategy_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        distribute.create_strategy(**kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
