"""framework.rundir.checkpoints: a model_dir's checkpoints found from their files, damaged ones
skipped.

Faults are injected into real checkpoint files: a flipped byte in a data file, a truncated file, a
deleted or garbled index. The checkpoints that are not restored stay byte-identical.
"""

import hashlib
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from framework.core import files
from framework.rundir import checkpoints


def save_steps(directory, steps=(2, 4, 6)):
    """Saves a checkpoint of a variable holding `step` at each step; returns (checkpoint, var)."""
    var = tf.Variable(tf.zeros([256]))
    checkpoint = tf.train.Checkpoint(var=var)
    manager = tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=None)
    for step in steps:
        var.assign(tf.fill([256], float(step)))
        manager.save(checkpoint_number=step)
    var.assign(tf.zeros([256]))
    return checkpoint, var


def restore_into(checkpoint):
    return lambda prefix: checkpoint.restore(prefix).assert_existing_objects_matched()


def digests(directory) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(pathlib.Path(directory).iterdir())
        if path.is_file()
    }


def flip_a_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["deleted", "garbled", "empty"])
def test_a_lost_index_restores_the_newest_checkpoint_from_the_files(tmp_path, damage):
    checkpoint, var = save_steps(tmp_path)
    index = tmp_path / checkpoints.INDEX_FILE
    if damage == "deleted":
        index.unlink()
    else:
        index.write_text("model_checkpoint_path: {{{ garbage" if damage == "garbled" else "")
    if damage != "empty":  # (TensorFlow raises ValueError on an empty index)
        assert tf.train.latest_checkpoint(str(tmp_path)) is None  # all TensorFlow finds
    before = digests(tmp_path)
    listing = checkpoints.list_checkpoints(str(tmp_path))
    restored = checkpoints.restore_newest(listing, restore_into(checkpoint))
    assert checkpoints.step_of(restored) == 6 and float(var[0]) == 6.0
    assert digests(tmp_path) == before
    assert checkpoints.repair_index(listing, restored)
    assert not checkpoints.repair_index(listing, restored)
    state = tf.train.get_checkpoint_state(str(tmp_path))
    assert state.model_checkpoint_path == restored
    assert list(state.all_model_checkpoint_paths) == listing.committed


@pytest.mark.tf_compat
@pytest.mark.parametrize("damage", ["flipped byte", "truncated data", "truncated index"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, caplog):
    checkpoint, var = save_steps(tmp_path)
    newest = tmp_path / "ckpt-6.data-00000-of-00001"
    if damage == "flipped byte":
        flip_a_byte(newest)
    elif damage == "truncated data":
        newest.write_bytes(newest.read_bytes()[:100])
    else:
        (tmp_path / "ckpt-6.index").write_bytes(b"short")
    before = digests(tmp_path)
    restored = checkpoints.restore_newest(
        checkpoints.list_checkpoints(str(tmp_path)), restore_into(checkpoint)
    )
    assert checkpoints.step_of(restored) == 4 and float(var[0]) == 4.0
    assert "skipping checkpoint" in caplog.text and "ckpt-6" in caplog.text
    assert "restored the older checkpoint" in caplog.text
    assert digests(tmp_path) == before


def test_a_restore_that_refuses_a_checkpoint_moves_on_to_an_older_one(tmp_path, caplog):
    checkpoint, var = save_steps(tmp_path)

    def finite_only(prefix):
        restore_into(checkpoint)(prefix)
        if float(var[0]) > 4:
            raise ValueError("it holds non-finite values")

    listing = checkpoints.list_checkpoints(str(tmp_path))
    assert checkpoints.step_of(checkpoints.restore_newest(listing, finite_only)) == 4
    assert "ckpt-6: it holds non-finite values" in caplog.text


def test_no_restorable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    checkpoint, _ = save_steps(tmp_path, steps=(2, 4))
    for name in ("ckpt-2.data-00000-of-00001", "ckpt-4.data-00000-of-00001"):
        flip_a_byte(tmp_path / name)
    before = digests(tmp_path)
    with pytest.raises(checkpoints.CheckpointError, match="cannot be restored") as error:
        checkpoints.restore_newest(
            checkpoints.list_checkpoints(str(tmp_path)), restore_into(checkpoint)
        )
    assert "ckpt-4: " in str(error.value) and "ckpt-2: " in str(error.value)
    assert "Checksum does not match" in str(error.value)
    assert digests(tmp_path) == before


def test_an_index_without_its_checkpoints_is_an_error(tmp_path):
    checkpoint, _ = save_steps(tmp_path, steps=(2,))
    for path in tmp_path.glob("ckpt-2*"):
        path.unlink()
    with pytest.raises(checkpoints.CheckpointError, match="no ckpt-N.index file is there"):
        checkpoints.restore_newest(
            checkpoints.list_checkpoints(str(tmp_path)), restore_into(checkpoint)
        )


def test_the_data_of_several_saves_without_any_index_is_an_error_not_a_fresh_start(tmp_path):
    """One save's data without its .index is what a kill in a run's first save leaves (the
    next start begins afresh); several saves' are a run that lost its index files, which a
    fresh start would overwrite and rotate away."""
    checkpoint, _ = save_steps(tmp_path, steps=(2, 4, 6))
    for path in [*tmp_path.glob("*.index"), tmp_path / "checkpoint"]:
        path.unlink()
    before = digests(tmp_path)
    listing = checkpoints.list_checkpoints(str(tmp_path))
    assert listing.uncommitted_steps == [2, 4, 6] and not listing.empty
    with pytest.raises(checkpoints.CheckpointError, match="ckpt-2, ckpt-4, ckpt-6 without their"):
        checkpoints.restore_newest(listing, restore_into(checkpoint))
    assert digests(tmp_path) == before
    for path in tmp_path.glob("ckpt-[24].*"):
        path.unlink()
    assert checkpoints.list_checkpoints(str(tmp_path)).empty


def test_uncommitted_saves_are_ignored_and_temporary_directories_removed(tmp_path, caplog):
    checkpoint, var = save_steps(tmp_path, steps=(2,))
    (tmp_path / "ckpt-4.data-00000-of-00001").write_bytes(b"half a save")
    (tmp_path / "ckpt-6_temp").mkdir()
    (tmp_path / "ckpt-6_temp" / "part-00000-of-00001.index").write_bytes(b"x")
    (tmp_path / "notes_temp").mkdir()
    listing = checkpoints.list_checkpoints(str(tmp_path))
    assert listing.uncommitted == ["ckpt-4.data-00000-of-00001"]
    assert checkpoints.step_of(checkpoints.restore_newest(listing, restore_into(checkpoint))) == 2
    assert "its save never completed" in caplog.text
    assert checkpoints.remove_temporary(listing) == [f"{tmp_path}/ckpt-6_temp"]
    assert not (tmp_path / "ckpt-6_temp").exists() and (tmp_path / "notes_temp").exists()


def test_an_empty_or_missing_directory_has_nothing_to_restore(tmp_path):
    for directory in (tmp_path, tmp_path / "missing"):
        listing = checkpoints.list_checkpoints(str(directory))
        assert listing.empty
        assert checkpoints.restore_newest(listing, lambda prefix: None) is None


def test_transient_storage_errors_are_retried_a_bounded_number_of_times(monkeypatch):
    monkeypatch.setattr(files, "FIRST_RETRY_SECONDS", 0.0)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise tf.errors.UnavailableError(None, None, "the bucket blinked")
        return "read"

    assert files.with_retries(flaky, "reading") == "read" and len(calls) == 3

    def down():
        calls.append(1)
        raise tf.errors.UnavailableError(None, None, "down")

    calls.clear()
    with pytest.raises(tf.errors.UnavailableError):
        files.with_retries(down, "reading")
    assert len(calls) == files.RETRIES


def test_a_non_local_filesystem_is_listed_and_restored_through_gfile():
    directory = "ram://test_checkpoints/run"
    checkpoint, var = save_steps(directory, steps=(3, 5))
    tf.io.gfile.remove(f"{directory}/{checkpoints.INDEX_FILE}")
    listing = checkpoints.list_checkpoints(directory)
    assert checkpoints.restore_newest(listing, restore_into(checkpoint)) == f"{directory}/ckpt-5"
    np.testing.assert_array_equal(var.numpy(), np.full([256], 5.0))
