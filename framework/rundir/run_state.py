"""A run's state in its model directory: one writer, the newest good checkpoint restored, saves.

- One writer per model_dir: the chief holds `run_lock.RunLock` from the start and checks it
  before every save, so a run whose directory was taken over stops instead of overwriting.
- Restore: checkpoints are found from their files, not only from the index file, so a lost
  index is not a fresh start; a damaged checkpoint (TensorFlow checks each tensor's checksum) or
  a non-finite one is skipped for the one before it; and a model_dir whose checkpoints all fail
  stops the run (`TrainerError`) instead of starting over them (see `checkpoints`).
- Every worker restores from model_dir and saves (saving is collective), but only the chief
  writes into model_dir: the others write to a scratch directory of their own and delete it
  after each save, so that a long run does not fill a worker's local disk with copies no one
  reads (TensorFlow's handler does the same for the managers it makes). The scratch directory
  is the same for a worker of a run at every start, and emptied then: a worker killed during a
  save leaves one copy behind until the run restarts, not one per kill.
- After SIGTERM (a preempted TPU VM or GPU node), TensorFlow's handler makes the workers agree
  on a step, all save there, and the run stops with `PreemptedError`.
- A checkpoint holds every random state of the model (`random_state`) and the number of replicas
  that trained it, so that a resumed run is the uninterrupted one, bit for bit on the same
  devices; what makes it differ (an older checkpoint, another replica count, another model) is
  logged at restore.
- It holds where each input pipeline's stream stood at that step (`data_position`, for streams a
  step cannot address: `data.positions`), so that a resumed run starts reading there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Mapping

import keras
import numpy as np
import tensorflow as tf

from framework.core import files, tf_internals
from framework.core.errors import PreemptedError, TrainerError
from framework.rundir import checkpoints
from framework.rundir import lock as run_lock
from framework.runtime import distribute
from framework.shard import checkpoint_view


def random_state(model: keras.Model) -> list[keras.Variable]:
    """The model's random state: the state of each Keras `SeedGenerator` in its layers (dropout,
    noise, augmentation inside the model), which `model.variables` holds beside the weights.

    Each draw advances these states, so a resumed run that started them from their initial
    seeds would draw other dropout masks than the uninterrupted run from the restored step on.
    """
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _worker_scratch(model_dir: str, strategy: tf.distribute.Strategy) -> str:
    """An empty scratch directory for this worker's copy of each save, named after the run's
    model_dir and the worker (two workers of one cluster may share a host)."""
    resolver = strategy.cluster_resolver
    where = os.path.abspath(model_dir) if files.is_local(model_dir) else model_dir
    run = hashlib.sha256(where.encode()).hexdigest()[:16]
    path = os.path.join(
        tempfile.gettempdir(), f"framework-ckpt-{run}-{resolver.task_type}-{resolver.task_id}"
    )
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)
    return path


class RunState:
    """The checkpoints of `model`, `optimizer`, `learning_rate_scale`, the model's random state
    and `data_position` in `model_dir`.

    `is_finite()` says whether the state in memory is finite; a restored checkpoint must be.
    `set_data_position` keeps the input streams' positions at the current step ([pipelines,
    ...] int64, from the trainer); `saved_data_position` is the restored checkpoint's (None when
    it holds none). They are saved serialized, a scalar string: a checkpoint of 2 workers then
    still restores in a run of 1 (TensorFlow's preemption handler restores every saved value).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        learning_rate_scale: tf.Variable,
        is_finite: Callable[[], bool],
        strategy: tf.distribute.Strategy,
        keep: int | None,
        lease_seconds: float,
        replaced: Mapping[int, tf.__internal__.tracking.Trackable] | None = None,
        on_restore: Callable[[], None] | None = None,
    ):
        self.model, self.optimizer = model, optimizer
        self._saved_model = checkpoint_view(model, replaced or {})
        self._saved_optimizer = checkpoint_view(optimizer, replaced or {})
        self._on_restore = on_restore
        self._data_position = tf.Variable(b"", trainable=False, dtype=tf.string)
        self.saved_data_position: np.ndarray | None = None
        self.learning_rate_scale = learning_rate_scale
        self.is_finite = is_finite
        self.is_chief = is_chief = distribute.is_chief(strategy)
        self.random_state = random_state(model)
        self._replicas = strategy.num_replicas_in_sync
        self.workers = distribute.worker_count(strategy)
        self.directory = os.path.join(model_dir, "checkpoints")
        self._lock = run_lock.RunLock(model_dir, lease_seconds=lease_seconds)
        if is_chief:
            try:
                self._lock.acquire()
            except run_lock.LockError as error:
                raise TrainerError(str(error)) from None
        # First: it repairs the index the manager reads. None when the run starts afresh.
        self.restored = self.restore(at_start=True)
        # (A TPU pod's hosts are driven by one client, which restores once.)
        if self.workers > 1 and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            self._check_workers_agree(strategy)
        self.manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(
                model=self._saved_model,
                optimizer=self._saved_optimizer,
                learning_rate_scale=learning_rate_scale,
                random_state=self.random_state,
                replicas_in_sync=tf.Variable(self._replicas, trainable=False, dtype=tf.int64),
                data_position=self._data_position,
            ),
            self.directory if is_chief else _worker_scratch(model_dir, strategy),
            max_to_keep=keep if is_chief else 1,
            step_counter=optimizer.iterations,
        )
        # TensorFlow's handler makes all workers agree on the step to save at after SIGTERM.
        self._preemption = tf.distribute.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver,
            self.manager,
            termination_config=tf.distribute.experimental.TerminationConfig(
                exit_fn=self._preempted
            ),
        )

    @property
    def step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def set_data_position(self, rows: np.ndarray) -> None:
        """The input streams' positions at the current step, for the next save."""
        self._data_position.assign(tf.io.serialize_tensor(tf.constant(rows, tf.int64)))

    def restore(self, at_start: bool = False) -> str | None:
        """Restores the newest checkpoint that restores and is finite; returns it, or None
        when model_dir holds none. `at_start` (the lock is held, no save is running) also
        removes what interrupted saves left and repairs the index file."""
        listing = checkpoints.list_checkpoints(self.directory)
        if at_start and self.is_chief:
            for path in checkpoints.remove_temporary(listing):
                logging.info("removed %s, left by an interrupted save", path)
        try:
            if at_start and self.is_chief:
                checkpoints.check_saves_fit(listing)
            restored = checkpoints.restore_newest(listing, self._restore)
        except checkpoints.CheckpointError as error:
            raise TrainerError(str(error)) from None
        if restored is None:
            logging.info("no checkpoint in %s: starting from scratch", self.directory)
            return None
        if at_start and self.is_chief and checkpoints.repair_index(listing, restored):
            logging.warning("rewrote %s/checkpoint to name %s", self.directory, restored)
        logging.info("restored step %d from %s", self.step, restored)
        scale = float(self.learning_rate_scale.numpy())
        if at_start and scale != 1.0:
            logging.warning(
                "the learning rate is scaled by %g, as divergence rollbacks left it (saved with "
                "the checkpoints): it multiplies Trainer.learning_rate's schedule",
                scale,
            )
        return restored

    def _restore(self, prefix: str) -> None:
        status = tf.train.Checkpoint(
            model=self._saved_model, optimizer=self._saved_optimizer
        ).restore(prefix)
        # The rest is restored below (TF's own); and a checkpoint of another model, refused by
        # the assertion, must not leave TF to log each value it could not place at exit.
        status.expect_partial()
        status.assert_existing_objects_matched()
        if self._on_restore is not None:
            self._on_restore()
        # Apart, as checkpoints written before it existed lack it (they mean a scale of 1).
        self.learning_rate_scale.assign(1.0)
        tf.train.Checkpoint(learning_rate_scale=self.learning_rate_scale).restore(
            prefix
        ).expect_partial()
        if not self.is_finite():
            raise ValueError("it holds non-finite values (saved by a diverged run)")
        saved = checkpoints.reader(prefix)
        self._restore_random_state(prefix, saved)
        key = "data_position/.ATTRIBUTES/VARIABLE_VALUE"
        value = saved.get_tensor(key) if key in saved.get_variable_to_shape_map() else b""
        self.saved_data_position = tf.io.parse_tensor(value, tf.int64).numpy() if value else None

    def _restore_random_state(self, prefix: str, reader: tf_internals.CheckpointReader) -> None:
        """Restores the random state, saying why the run goes on other than the uninterrupted
        one would have, if it does."""
        names = reader.get_variable_to_shape_map()
        saved = sum(name.startswith("random_state/") for name in names)
        tf.train.Checkpoint(random_state=self.random_state).restore(prefix).expect_partial()
        name = os.path.basename(prefix)
        if saved != len(self.random_state):
            origin = f"{saved} random states" if saved else "no random state (an older save)"
            logging.warning(
                "%s holds %s, the model has %d: from here on its dropout and other random "
                "draws differ from those of the uninterrupted run",
                name,
                origin,
                len(self.random_state),
            )
        key = "replicas_in_sync/.ATTRIBUTES/VARIABLE_VALUE"
        replicas = int(reader.get_tensor(key)) if key in names else None
        if replicas is not None and replicas != self._replicas:
            logging.warning(
                "%s was saved by a run of %d replicas, this one has %d: the batches are split "
                "another way and each replica draws its own random numbers, so the run goes on "
                "other than the uninterrupted one would have",
                name,
                replicas,
                self._replicas,
            )

    def _check_workers_agree(self, strategy: tf.distribute.Strategy) -> None:
        """Stops the run unless every worker restored the same step.

        Each worker picks its checkpoint from its own listing of model_dir. They agree when the
        storage is consistent; where it is not (a listing that lags, a worker whose model_dir
        path names another directory), they would train on from different states silently.
        """
        steps = distribute.gather_workers(strategy, np.array(self.step, np.int64))
        if len(set(steps.tolist())) == 1:
            return
        restored = ", ".join(
            f"worker {i}: {f'ckpt-{step}' if step else 'none (a fresh start)'}"
            for i, step in enumerate(steps.tolist())
        )
        raise TrainerError(
            f"the workers restored different checkpoints from {self.directory} ({restored}): "
            "each worker must see the same model_dir; check that they all name one directory "
            "on shared storage, then run the same command again"
        )

    def save(self) -> str:
        """Saves the current step (unless it is saved already) after checking the lock."""
        self.check_lock()  # (on gs:// a read: only when a save is due)
        latest = self.manager.latest_checkpoint
        if latest is None or checkpoints.step_of(latest) != self.step:
            latest = self.manager.save(checkpoint_number=self.step)
            self._discard_worker_copy()
        return os.path.join(self.directory, os.path.basename(latest))

    def save_interrupted(self) -> str | None:
        """Saves the current step after Ctrl-C, so that the same command resumes there rather
        than at the last periodic checkpoint; returns the checkpoint holding this step, or None.

        The step counter and the weights change together, only inside a compiled loop, so a
        built trainer is always at a loop boundary. Not saved: step 0 (nothing trained), a
        non-finite state (never saved), and a run of several workers, whose saving is
        collective (one worker alone would wait for the others forever; `framework.train` turns
        their Ctrl-C into SIGTERM, on which they all save).
        """
        if self.workers > 1 or self.step == 0 or not self.is_finite():
            return None
        return self.save()

    def save_if_preempted(self) -> None:
        """After SIGTERM: saves where all workers agree, then raises `PreemptedError`."""
        self._preemption.save_checkpoint_if_preempted(checkpoint_number=self.step)

    def _preempted(self) -> None:
        self._discard_worker_copy()
        raise PreemptedError(self.step)

    def _discard_worker_copy(self) -> None:
        """Deletes what a worker other than the chief wrote in its save (see the module
        docstring); its manager writes the directory again at the next save."""
        if not self.is_chief:
            tf.io.gfile.rmtree(self.manager.directory)

    def check_lock(self) -> None:
        """Stops before a save if another run took model_dir over (see `run_lock`)."""
        if self.is_chief:
            try:
                self._lock.check()
            except run_lock.LockError as error:
                raise TrainerError(str(error)) from None

    def newest_finite(self) -> str | None:
        """The newest checkpoint in model_dir whose floating-point values are all finite (one
        written before finite checks existed may not be)."""
        for path in reversed(checkpoints.list_checkpoints(self.directory).committed):
            try:
                reader = checkpoints.reader(path)
                values = (reader.get_tensor(name) for name in reader.get_variable_to_shape_map())
                if all(
                    np.isfinite(v).all()
                    for v in values
                    if np.issubdtype(np.asarray(v).dtype, np.floating)
                ):
                    return path
            except (tf.errors.OpError, ValueError) as error:
                logging.warning("cannot read checkpoint %s: %s", path, error)
        return None
