"""Sharded state on 4 and 8 replicas trains as the unsharded run does, and 4 replicas'
checkpoints restore into 2 (how and to what tolerance: replica_runs.py)."""

import pytest

from tests.shard.replica_runs import COMMON, levels
from tests.subprocesses import run_python

pytestmark = pytest.mark.slow  # subprocesses: the full tier only

RESTORE_SCRIPT = (
    COMMON
    + """
    distribute.split_cpu({replicas})
    RUNTIME = Runtime("mirrored", cpu_devices={replicas})
    result = {{}}
    for case, level in {cases!r}:
        model = case.split("-")[0]
        saved = np.load(os.path.join({out!r}, case + ".npz"))
        restored = trainer(model, os.path.join({out!r}, case), shard_state=level, **FULL_STEP)
        result[f"{{case}}->{{level}}"] = [
            restored.step, difference(state(restored), [saved[k] for k in saved.files])
        ]
    print(json.dumps(result))
"""
)


def test_four_replicas_train_as_the_unsharded_run_and_their_checkpoints_restore_into_two(
    tmp_path,
):
    result = levels(4, {"decoder": ["gradients", "weights"]}, tmp_path)
    assert len(result) == 2 and max(result.values()) < 1e-5, result
    # The 4-replica checkpoints, into 2 replicas: unsharded, and at other levels.
    cases = [
        ("decoder-weights", "none"),
        ("decoder-weights", "optimizer"),
        ("decoder-gradients", "weights"),
    ]
    script = RESTORE_SCRIPT.format(replicas=2, cases=cases, out=str(tmp_path))
    restored = run_python(script, timeout=600)
    assert len(restored) == 3
    for case, (step, difference) in restored.items():
        assert step == 4 and difference == 0.0, (case, restored)


def test_eight_replicas_gather_their_weights_as_the_unsharded_run(tmp_path):
    result = levels(8, {"vit": ["weights"]}, tmp_path, full_step=False)
    assert result["vit/weights"] < 1e-5, result
