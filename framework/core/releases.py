"""The TensorFlow releases the project supports, in a module that imports no TensorFlow.

`framework.core.tf_internals` warns on any other release at import; the TPU launcher
(`launch/tpu/`), which runs on a workstation where TensorFlow need not be installed, refuses a
TPU VM whose image carries another and marks the runtimes that carry one. One list serves both.
"""

from __future__ import annotations

import re

# Releases (major.minor) the test suite passed on; 2.20 is the newest TPU build (`tensorflow-tpu`).
# Keep in step with setup.py's `tensorflow` and `tensorflow-text` ranges and .ci/run.
SUPPORTED_TENSORFLOW = ("2.20", "2.21")


def is_supported_tensorflow(version: str) -> bool:
    """Whether TensorFlow `version` ("2.21.0", "2.21.0rc1", "2.22.0-dev20260101") belongs to one
    of the `SUPPORTED_TENSORFLOW` releases: the patch level and any suffix do not matter."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return bool(match) and f"{match[1]}.{match[2]}" in SUPPORTED_TENSORFLOW
