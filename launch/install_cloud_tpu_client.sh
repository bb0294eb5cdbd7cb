#!/usr/bin/env bash
# Installs cloud-tpu-client (needed only for legacy TPU nodes, `Runtime.tpu_node = True`) without
# breaking TensorFlow. Its release 0.10 pins google-api-python-client==1.8.0, which pulls an old
# protobuf that TensorFlow 2.21 cannot import; it works with google-api-python-client 2.x, so it
# is installed without its declared dependencies and those are installed at working versions.
# `pip check` then reports the pin as unmet: that line is expected, TensorFlow still imports.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install --no-deps "cloud-tpu-client==0.10"
"$PYTHON" -m pip install "google-api-python-client>=2,<3" "oauth2client>=4.1"
"$PYTHON" -c "import tensorflow, cloud_tpu_client; print('cloud-tpu-client OK with TensorFlow', tensorflow.__version__)"
