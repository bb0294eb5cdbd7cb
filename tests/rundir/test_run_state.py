"""framework.rundir.run_state: where a worker other than the chief writes its copy of a save."""

import pathlib
import tempfile
import types

from framework.rundir import run_state


def _worker(task_id: int):
    resolver = types.SimpleNamespace(task_type="worker", task_id=task_id)
    return types.SimpleNamespace(cluster_resolver=resolver)


def test_a_worker_saves_into_one_scratch_directory_per_run_emptied_at_start(tmp_path, monkeypatch):
    """A worker killed after a save leaves its copy there: the next start of the same run and
    worker removes it, where a new temporary directory per start left one copy per kill."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # as $TMPDIR sets it
    monkeypatch.chdir(tmp_path)
    scratch = pathlib.Path(run_state._worker_scratch("runs/a", _worker(1)))
    assert scratch.parent == tmp_path / "tmp" and scratch.name.startswith("framework-ckpt-")
    scratch.mkdir()
    (scratch / "ckpt-10.index").write_bytes(b"a killed worker's copy")
    # The same run (here named by its absolute path) and worker: the same directory, emptied.
    again = run_state._worker_scratch(str(tmp_path / "runs" / "a"), _worker(1))
    assert again == str(scratch) and not scratch.exists()
    others = {
        run_state._worker_scratch("runs/a", _worker(2)),
        run_state._worker_scratch("runs/b", _worker(1)),
    }
    assert str(scratch) not in others and len(others) == 2
