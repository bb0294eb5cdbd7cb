"""Keeps TensorFlow's noise off the console, so that what a binary prints is about the user's run.

TensorFlow writes start-up banners, CUDA probes on machines without GPUs, C++ INFO lines and
known-harmless Python warnings on every run; some come from C++ before its log level is read, so
only a filter on the process' stderr itself can drop them. `--verbosity=1` (or `-v 1`) keeps
them all.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Sequence

from absl import flags

# Python warnings TensorFlow raises on every run that say nothing about the user's program.
HARMLESS_WARNINGS = (
    "To make it possible to preserve tf.data options across serialization boundaries",
)
# Lines TensorFlow's C++ runtime writes on every start (before its log level is read, so
# TF_CPP_MIN_LOG_LEVEL cannot hide them) or at every finite data set's end, which say nothing
# about the user's run: kept off the console by `quiet_tensorflow`.
TENSORFLOW_NOISE = (
    "All log messages before absl::InitializeLog() is called are written to STDERR",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
    "Unable to register cu",  # cuDNN, cuFFT, cuBLAS factories on GPU builds
    "computation placer already registered",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions",
    "TF-TRT Warning",
    "Local rendezvous is aborting with status: OUT_OF_RANGE: End of sequence",
    "does not implement the AsGraphDefInternal() method needed to apply optimizations",
)
# Reads this process' stderr from a pipe and passes on every line but the noise. A separate
# process, so that nothing is lost if this one crashes (it reads to the end of the pipe), and one
# that outlives Ctrl-C and SIGTERM, so that the run's last lines still reach the console.
_STDERR_FILTER = """
import re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
noise = re.compile(sys.argv[1].encode())
for line in sys.stdin.buffer:
    if not noise.search(line):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
"""
FLAGS = flags.FLAGS


def filter_stderr(noise: Sequence[str]) -> None:
    """From now on, lines of this process' stderr (Python's and C++'s alike) that contain one of
    `noise` are dropped; the others pass unchanged. At exit the filter is given the last lines
    and waited for, so that they are out before the process' status is (a shell prompt would
    come first, or a file the caller reads next would still lack its `error:` line)."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    console = os.dup(2)
    process = subprocess.Popen(
        [sys.executable, "-c", _STDERR_FILTER, "|".join(map(re.escape, noise))],
        stdin=read_end,
        stdout=console,
        close_fds=True,
    )
    os.dup2(write_end, 2)
    for fd in (read_end, write_end):
        os.close(fd)
    atexit.register(_drain, process, console)


def _drain(process: subprocess.Popen, console: int) -> None:
    """Writes what follows straight to the console, so that the filter reads the end of its
    pipe, and waits for it to pass on the lines before (a moment: a child process that
    inherited the pipe would hold it open)."""
    sys.stderr.flush()
    os.dup2(console, 2)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def quiet_tensorflow() -> None:
    """Keeps TensorFlow's noise (see `TENSORFLOW_NOISE`), its C++ INFO lines, its per-save
    Python INFO lines and known-harmless warnings off the console unless --verbosity is 1 or
    more. Called before TensorFlow loads."""
    if "verbosity" in FLAGS and FLAGS["verbosity"].value >= 1:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    for name in ("tensorflow", "absl"):  # our own lines use the root logger
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        # And a filter: saving a SavedModel sets absl's verbosity to FATAL and back (TensorFlow's
        # AutoTrackable), which leaves absl's logger at the root's level (INFO) for the rest.
        logger.addFilter(lambda record: record.levelno >= logging.WARNING)
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    filter_stderr(TENSORFLOW_NOISE)
